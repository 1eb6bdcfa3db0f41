"""Walks the jaxpr of a full training loss (forward and backward) per policy.

Asserts the dtypes that reach every matmul and convolution, and that the
numerically fragile parts (LayerNorm statistics, softmax, loss) are float32.
"""

import functools
import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp

from haiku_mp.model import half_dot
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

POLICIES = dict(
    fp16=('params=float32,compute=float16,output=float32', 'float16'),
    bf16=('params=float32,compute=bfloat16,output=float32', 'bfloat16'),
    fp32=('params=float32,compute=float32,output=float32', 'float32'),
)
# Elementwise or reducing ops whose float16 version loses range or precision.
FLOAT32_ISLAND_PRIMITIVES = ('reduce_max', 'reduce_sum', 'exp', 'log', 'rsqrt')


@functools.cache
def _setup(policy, overrides='', **precision):
  """(experiment, params, batch, loss) of the two-block ViT: built once per
  setting for every test that traces it (none changes them). The params
  are abstract (shapes and dtypes, `exp.abstract_state`): a trace needs no
  values, so no setting compiles its initialization."""
  config = helpers.tiny_config(policy, overrides, num_layers=2)
  config.precision.update(precision)
  exp = experiment.build_without_data(settings_lib.parse(config))
  batch = helpers.random_batch(config)
  rng = jax.random.key(1)
  loss = lambda p: exp.loss_fn(p, rng, batch)[0]
  return exp, exp.abstract_state.params, batch, loss


@helpers.long_running
class MatmulDtypeTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(k, *v) for k, v in POLICIES.items()])
  def test_every_matmul_forward_and_backward_in_compute_dtype(self, policy,
                                                              dtype):
    # Traced for a GPU: `auto` is `native` for every matmul.
    _, params, _, loss = _setup(policy, dot_platform='gpu')
    forward_eqns = helpers.eqns_of(loss, params)
    all_eqns = helpers.eqns_of(jax.value_and_grad(loss), params)
    # 2 blocks x (q, k, v, out, fc1, fc2 + 2 attention einsums) + patches + head.
    self.assertLen(forward_eqns, 2 * 8 + 2)
    # Backward: two matmuls (operand and weight gradients) per forward matmul.
    # Float32's patch conv is Haiku's, whose input (the images) needs no
    # gradient; a half patch embedding's custom VJP computes it (XLA drops it).
    self.assertLen(all_eqns, 3 * len(forward_eqns) - (dtype == 'float32'))
    for eqn in all_eqns:
      self.assertEqual(helpers.operand_dtypes(eqn), (dtype, dtype), str(eqn))
      if dtype != 'float32':  # Half operands, float32 sums.
        self.assertEqual(eqn.params['preferred_element_type'], jnp.float32,
                         str(eqn))
    conv = [e for e in all_eqns if e.primitive.name == 'conv_general_dilated']
    self.assertLen(conv, 2 if dtype == 'float32' else 0)

  @parameterized.named_parameters(('fp16', 'fp16'), ('bf16', 'bf16'))
  def test_on_cpu_the_measured_form(self, name):
    policy, dtype = POLICIES[name]
    # This host CPU's: bf16 native only with bf16 instructions.
    form = half_dot.form_for('auto', dtype, 'cpu')
    _, params, _, loss = _setup(policy, dot_platform='cpu')
    eqns = helpers.eqns_of(jax.value_and_grad(loss), params)
    # XLA:CPU has a bf16 kernel for plain matmuls, none for float16 and none
    # for batched bf16 ones outside its fused dots: those are upcast.
    for eqn in eqns:
      batched = bool(eqn.params['dimension_numbers'][1][0])
      want = dtype if form == 'native' and not batched else 'float32'
      self.assertEqual(helpers.operand_dtypes(eqn), (want, want), str(eqn))
      self.assertEqual(eqn.params['preferred_element_type'], jnp.float32)

  @parameterized.named_parameters(('fp16', 'fp16'), ('bf16', 'bf16'))
  def test_softmax_layer_norm_and_loss_are_float32(self, name):
    policy, dtype = POLICIES[name]
    # Traced for a GPU: every matmul native.
    _, params, _, loss = _setup(policy, dot_platform='gpu')
    islands = helpers.eqns_of(loss, params,
                              primitives=FLOAT32_ISLAND_PRIMITIVES)
    attention = [e for e in helpers.eqns_of(loss, params,
                                            primitives=('dot_general',))
                 if e.outvars[0].aval.ndim == 4]
    kinds = {e.primitive.name for e in islands}
    self.assertContainsSubset({'reduce_max', 'reduce_sum', 'exp', 'rsqrt'},
                              kinds)
    for eqn in islands:
      self.assertEqual(set(helpers.operand_dtypes(eqn)), {'float32'}, str(eqn))
    # Attention: half-precision matmuls summed in float32; the logits stay
    # float32 into the softmax (checked above), weights.v is rounded to half.
    self.assertLen(attention, 2 * 2)  # Per block: q.k^T and weights.v.
    for eqn in attention:
      self.assertEqual(helpers.operand_dtypes(eqn), (dtype, dtype))
      self.assertEqual(eqn.outvars[0].aval.dtype, jnp.float32)

  @parameterized.named_parameters(('fp16', 'fp16'), ('bf16', 'bf16'))
  def test_params_and_gradients_float32_logits_float32(self, name):
    policy, _ = POLICIES[name]
    exp, _, batch, loss = _setup(policy)

    def run():
      params = exp.init_state().params
      return (params, exp.forward.apply(params, None, batch['image'], False),
              jax.grad(loss)(params))

    # The dtypes and shapes a run returns, from one trace: no program
    # compiled (op by op, the run was hundreds of one-op programs).
    params, logits, grads = jax.eval_shape(run)
    self.assertEqual({p.dtype for p in jax.tree.leaves(params)},
                     {jnp.dtype(jnp.float32)})
    chex.assert_type(logits, jnp.float32)
    chex.assert_shape(logits, (8, 10))
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)

  def test_overrides_change_only_the_named_matmuls(self):
    _, params, _, loss = _setup(
        POLICIES['fp16'][0],
        overrides='*/head:float32;Attention:p=f32,c=f32,o=f16',
        dot_platform='gpu')
    eqns = helpers.eqns_of(jax.value_and_grad(loss), params)
    f32 = [e for e in eqns
           if helpers.operand_dtypes(e) == ('float32', 'float32')]
    f16 = [e for e in eqns
           if helpers.operand_dtypes(e) == ('float16', 'float16')]
    self.assertLen(eqns, len(f32) + len(f16))
    # Attention: 6 matmuls per block, head: 1, each 3x with the backward pass.
    self.assertLen(f32, 3 * (2 * 6 + 1))
    self.assertLen(f16, 3 * (2 * 2 + 1))  # fc1, fc2 per block; the patches.



class MatmulPrecisionTest(parameterized.TestCase):

  @parameterized.parameters(('highest', 'HIGHEST'), ('float32', 'HIGHEST'),
                            ('tensorfloat32', 'HIGH'), ('', None))
  def test_every_matmul_forward_and_backward_gets_it(self, name, expected):
    _, params, _, loss = _setup(POLICIES['bf16'][0], matmul_precision=name)
    eqns = helpers.eqns_of(jax.value_and_grad(loss), params)
    self.assertLen(eqns, 3 * (2 * 8 + 2))
    for eqn in eqns:  # The custom VJP's backward matmuls included.
      precision = eqn.params['precision']
      names = {getattr(p, 'name', None) for p in precision} if precision else {
          None}
      self.assertEqual(names, {expected}, str(eqn))


class ResidualStreamTest(parameterized.TestCase):

  @parameterized.named_parameters(('compute', 'compute', 'bfloat16'),
                                  ('float32', 'float32', 'float32'))
  def test_stream_dtype_and_matmuls_stay_half(self, stream, stream_dtype):
    config = helpers.tiny_config(POLICIES['bf16'][0], num_layers=2)
    config.precision.residual_stream = stream
    calls, _ = forward_lib.trace_modules(
        config.model, forward_lib.precision_from_config(config))
    blocks = [c for c in calls if c.class_name == 'EncoderBlock']
    self.assertLen(blocks, 2)
    for call in blocks:
      self.assertEqual(call.output.dtype, stream_dtype)
      self.assertEqual(call.args[0][0].dtype, stream_dtype)
    _, params, _, loss = _setup(POLICIES['bf16'][0], residual_stream=stream,
                                dot_platform='gpu')
    eqns = helpers.eqns_of(jax.value_and_grad(loss), params)
    for eqn in eqns:
      self.assertEqual(helpers.operand_dtypes(eqn), ('bfloat16', 'bfloat16'))


if __name__ == '__main__':
  absltest.main()
