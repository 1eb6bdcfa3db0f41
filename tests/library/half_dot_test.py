"""Half-precision matmuls: half operands and float32 sums, forward and backward;
Haiku's params; float32 untouched."""

import os
import sys
import tempfile

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp import errors
from haiku_mp.model import cpu_features
from haiku_mp.model import half_dot
from haiku_mp.model import matmul_modules
from haiku_mp.model import matmuls as matmuls_lib
from tests import helpers

LOGITS = 'bqhd,bkhd->bhqk'
DENSE = 'ni,io->no'
_SHAPES = {LOGITS: ((2, 3, 2, 4), (2, 5, 2, 4)), DENSE: ((6, 4), (4, 5))}
# /proc/cpuinfo flags of the three kinds of CPU measured (abridged).
XEON_AMX = frozenset({'avx2', 'avx512f', 'avx512_bf16', 'avx512_fp16',
                      'amx_bf16', 'amx_tile'})
EPYC_ZEN4 = frozenset({'avx2', 'avx512f', 'avx512_bf16'})
EPYC_ZEN3 = frozenset({'avx2', 'fma', 'f16c'})
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 fma f16c
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2 avx2 fma f16c
"""


def _operands(spec, dtype, shapes=None):
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.normal(size=s), dtype)
               for s in shapes or _SHAPES[spec])


def _loss(fn):
  return lambda a, b: jnp.sum(jnp.sin(fn(a, b).astype(jnp.float32)))


class EinsumTest(parameterized.TestCase):

  @parameterized.product(spec=(LOGITS, DENSE), form=('native', 'upcast'),
                         dtype=('bfloat16', 'float16'))
  def test_gradients_match_float32_in_the_operands_dtype(self, spec, form,
                                                         dtype):
    a, b = _operands(spec, jnp.float32)
    expected = jax.grad(_loss(lambda a, b: jnp.einsum(spec, a, b)),
                        argnums=(0, 1))(a, b)
    out_dtype = jnp.float32 if spec == LOGITS else None
    matmuls = matmuls_lib.Matmuls(form)
    half = lambda a, b: matmuls.einsum(spec, a, b, out_dtype=out_dtype)
    a16, b16 = a.astype(dtype), b.astype(dtype)
    chex.assert_type(half(a16, b16), out_dtype or dtype)
    got = jax.grad(_loss(half), argnums=(0, 1))(a16, b16)
    chex.assert_trees_all_equal_dtypes(got, (a16, b16))
    chex.assert_trees_all_close(got, expected, atol=0.05, rtol=0.05)

  @parameterized.parameters('bfloat16', 'float16')
  def test_native_dots_are_half_by_half_into_float32(self, dtype):
    a, b = _operands(DENSE, dtype)
    matmuls = matmuls_lib.Matmuls('native')
    eqns = helpers.eqns_of(jax.value_and_grad(
        _loss(lambda a, b: matmuls.einsum(DENSE, a, b)), argnums=(0, 1)), a, b)
    self.assertLen(eqns, 3)  # Forward, and one per operand's cotangent.
    for eqn in eqns:
      self.assertEqual(helpers.operand_dtypes(eqn), (dtype, dtype), str(eqn))
      self.assertEqual(eqn.params['preferred_element_type'], jnp.float32)

  @parameterized.parameters('native', 'auto')
  def test_cpu_kernel_receives_bf16_in_every_dot_forward_and_backward(
      self, form):
    # XLA:CPU converts a bf16 dot whose operand layout its bf16 kernel does
    # not take (the weight gradient's, unless transposed first) to float32.
    if jax.default_backend() != 'cpu':
      self.skipTest('the layouts of XLA:CPU')
    if half_dot.form_for(form, jnp.bfloat16, 'cpu') != 'native':
      self.skipTest('auto is upcast on a CPU without bf16 instructions')
    a, b = (x.astype(jnp.bfloat16) for x in
            _operands(DENSE, jnp.float32, ((64, 16), (16, 32))))
    matmuls = matmuls_lib.Matmuls(form)
    grads = jax.jit(jax.grad(_loss(lambda a, b: matmuls.einsum(DENSE, a, b)),
                             argnums=(0, 1)))
    self.assertEqual(helpers.compiled_dot_operand_dtypes(
        grads.lower(a, b).compile().as_text()), [('bf16', 'bf16')] * 3)
    expected = jax.grad(_loss(lambda a, b: jnp.einsum(DENSE, a, b)),
                        argnums=(0, 1))(a.astype(jnp.float32),
                                        b.astype(jnp.float32))
    for got, want in zip(grads(a, b), expected):  # Within bf16 rounding.
      scale = float(jnp.max(jnp.abs(want)))
      chex.assert_trees_all_close(got.astype(jnp.float32), want,
                                  atol=0.02 * scale, rtol=0)

  def test_upcast_dots_take_half_operands_converted_to_float32(self):
    a, b = _operands(DENSE, jnp.float16)
    matmuls = matmuls_lib.Matmuls('upcast')
    fn = jax.value_and_grad(_loss(lambda a, b: matmuls.einsum(DENSE, a, b)),
                            argnums=(0, 1))
    for eqn in helpers.eqns_of(fn, a, b):
      self.assertEqual(helpers.operand_dtypes(eqn), ('float32', 'float32'))
    chex.assert_trees_all_equal_dtypes(fn(a, b)[1], (a, b))

  def test_float32_and_plain_are_jax_own_einsum(self):
    for dtype, form in (('float32', 'native'), ('bfloat16', 'plain')):
      a, b = _operands(DENSE, dtype)
      got = jax.make_jaxpr(
          lambda a, b: matmuls_lib.Matmuls(form).einsum(DENSE, a, b))
      want = jax.make_jaxpr(lambda a, b: jnp.einsum(DENSE, a, b))
      self.assertEqual(str(got(a, b)), str(want(a, b)), (dtype, form))

  def test_unknown_form_names_the_setting(self):
    with self.assertRaisesRegex(errors.ConfigError, '^dot_form: '):
      half_dot.check_form('fast')


class AutoFormTest(parameterized.TestCase):
  """`auto` per backend and, on a CPU, per the CPU's bf16 instructions."""

  def test_auto_form_per_backend(self):
    self.assertEqual(half_dot.form_for('auto', jnp.bfloat16, 'gpu'), 'native')
    self.assertEqual(half_dot.form_for('auto', jnp.float16, 'tpu'), 'native')
    self.assertEqual(half_dot.form_for('auto', jnp.float32, 'gpu'), 'plain')
    self.assertEqual(half_dot.form_for('native', jnp.float32, 'cpu'), 'plain')

  @parameterized.parameters(
      (XEON_AMX, 'bfloat16', 'native', 'cpu has amx_bf16'),
      (EPYC_ZEN4, 'bfloat16', 'native', 'cpu has avx512_bf16'),
      (EPYC_ZEN3, 'bfloat16', 'upcast',
       'cpu has no bf16 instructions: avx2 only'),
      (frozenset({'sse2'}), 'bfloat16', 'upcast',
       'cpu has no bf16 instructions: no avx2'),
      (None, 'bfloat16', 'native', 'cpu features unknown'),
      (XEON_AMX, 'float16', 'upcast', 'no float16 matmul kernel'),
      (EPYC_ZEN4, 'float16', 'upcast', 'no float16 matmul kernel'),
      (EPYC_ZEN3, 'float16', 'upcast', 'no float16 matmul kernel'))
  def test_cpu_form_per_feature_set(self, features, dtype, form, why):
    got, reason = half_dot.cpu_form(dtype, features)
    self.assertEqual(got, form)
    self.assertIn(why, reason)

  def test_auto_on_this_cpu_is_what_its_features_say(self):
    features = cpu_features.host_features()
    for dtype in (jnp.bfloat16, jnp.float16):
      form, _ = half_dot.cpu_form(dtype, features)
      self.assertEqual(half_dot.form_for('auto', dtype, 'cpu'), form)
      self.assertEqual(half_dot.auto_form(dtype, 'cpu'),
                       half_dot.cpu_form(dtype, features))
    bf16 = features is None or any(
        f in features for f in half_dot.CPU_BF16_FEATURES)
    self.assertEqual(half_dot.form_for('auto', jnp.bfloat16, 'cpu'),
                     'native' if bf16 else 'upcast')
    # Batched dots are never native on XLA:CPU, whatever the CPU.
    self.assertEqual(
        half_dot.form_for('auto', jnp.bfloat16, 'cpu', batched=True), 'upcast')

  def test_cpuinfo_flags_of_the_first_core(self):
    self.assertEqual(cpu_features.parse_flags(CPUINFO),
                     {'fpu', 'sse2', 'avx2', 'fma', 'f16c'})
    self.assertIsNone(cpu_features.parse_flags(
        'processor\t: 0\nFeatures\t: fp asimd bf16\n'))  # Arm: unknown.
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    self.assertIsNone(cpu_features.host_features(os.path.join(tmp, 'none')))
    path = os.path.join(tmp, 'cpuinfo')
    with open(path, 'w') as f:
      f.write(CPUINFO)
    self.assertEqual(cpu_features.describe(cpu_features.host_features(path)),
                     'avx2 only')
    self.assertEqual(cpu_features.describe(XEON_AMX),
                     'amx_bf16, avx512_bf16, avx512_fp16')

  def test_matmuls_line_says_the_form_and_why(self):
    form, why = half_dot.auto_form(jnp.bfloat16, 'cpu')
    self.assertEqual(
        half_dot.matmuls_line('auto', ['bfloat16', 'float32'], 'cpu'),
        f'Matmuls: bfloat16 dots {form} ({why}'
        + ('; batched dots upcast' if form == 'native' else '')
        + "); float32 dots plain (float32 operands: JAX's own dots)")
    self.assertEqual(
        half_dot.matmuls_line('native', [jnp.float16], 'gpu'),
        "Matmuls: float16 dots native (dot_form='native')")
    self.assertEqual(
        half_dot.matmuls_line('native', [jnp.bfloat16], 'cpu'),
        "Matmuls: bfloat16 dots native (dot_form='native'; "
        'batched dots upcast)')
    self.assertEqual(
        half_dot.matmuls_line('auto', [jnp.bfloat16], 'gpu'),
        'Matmuls: bfloat16 dots native (gpu: half operands, float32 sums)')


class LayersTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('linear', lambda: hk.Linear(5), lambda d: matmul_modules.Linear(5, d),
       (2, 3, 4)),
      ('patch_conv', lambda: hk.Conv2D(5, 2, stride=2, padding='VALID'),
       lambda d: matmul_modules.Conv2D(5, d, kernel_shape=2, stride=2,
                                       padding='VALID'), (2, 4, 6, 3)))
  def test_haiku_params_and_outputs(self, haiku_module, ours, shape):
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
    theirs = hk.without_apply_rng(hk.transform(lambda x: haiku_module()(x)))
    native = hk.without_apply_rng(hk.transform(
        lambda x: ours(matmuls_lib.Matmuls('native'))(x)))
    for dtype in (jnp.float32, jnp.bfloat16):
      params = theirs.init(jax.random.key(0), x.astype(dtype))
      # The same names, shapes, dtypes and initial values as Haiku's.
      chex.assert_trees_all_equal(
          native.init(jax.random.key(0), x.astype(dtype)), params)
      want = theirs.apply(params, x.astype(dtype))
      got = native.apply(params, x.astype(dtype))
      chex.assert_equal_shape((got, want))
      chex.assert_type(got, dtype)
      if dtype == jnp.float32:  # Haiku's own code path: bit for bit.
        np.testing.assert_array_equal(got, want)
      else:
        np.testing.assert_allclose(np.float32(got), np.float32(want),
                                   atol=0.05, rtol=0.02)

  @parameterized.parameters('native', 'upcast')
  def test_bias_joins_the_float32_sums_before_the_one_rounding(self, form):
    # x @ w = 16 * 16 + 1 = 257 and b = 0.5, exact in float32: one rounding
    # of 257.5 to bf16 (8 significant bits) gives 258; rounding the matmul
    # first (257 -> 256) and then the sum (256.5 -> 256) gives 256.
    x = jnp.asarray([[16.0, 1.0]] * 3, jnp.bfloat16)
    params = {'linear': {'w': jnp.asarray([[16.0], [1.0]], jnp.bfloat16),
                         'b': jnp.asarray([0.5], jnp.bfloat16)}}
    linear = hk.without_apply_rng(hk.transform(
        lambda x: matmul_modules.Linear(1, matmuls_lib.Matmuls(form))(x)))
    chex.assert_trees_all_equal_shapes_and_dtypes(
        linear.init(jax.random.key(0), x), params)
    np.testing.assert_array_equal(np.float32(linear.apply(params, x)), 258.0)
    # Its gradient is a float32 sum of the float32 cotangent.
    grad = jax.grad(lambda p: jnp.sum(linear.apply(p, x).astype(jnp.float32)))
    sums = [e for e in helpers.eqns_of(grad, params, primitives=('reduce_sum',))
            if e.outvars[0].aval.shape == (1,)]
    self.assertNotEmpty(sums)
    for eqn in sums:
      self.assertEqual(helpers.operand_dtypes(eqn), ('float32',))

  @parameterized.parameters((2, 'VALID', 'dot_general'),
                            (1, 'SAME', 'conv_general_dilated'))
  def test_conv_is_a_dot_only_as_a_patch_embedding(self, stride, padding,
                                                   primitive):
    x = jnp.zeros((2, 4, 4, 3), jnp.bfloat16)
    conv = hk.without_apply_rng(hk.transform(lambda x: matmul_modules.Conv2D(
        5, matmuls_lib.Matmuls('native'), kernel_shape=2, stride=stride,
        padding=padding)(x)))
    params = conv.init(jax.random.key(0), x)
    eqns = helpers.eqns_of(conv.apply, params, x)
    self.assertEqual([e.primitive.name for e in eqns], [primitive])


if __name__ == '__main__':
  absltest.main()
