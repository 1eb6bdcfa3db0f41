"""Models nobody here wrote: Haiku's own MLP, ResNet18 and a transformer
block of stock modules, unchanged, under `apply_precision`: their matmuls run
half x half into float32 sums, or fp8 where the targets say, forward and
backward; their params are Haiku's."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import collections
import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import haiku_mp
from tests import helpers

BF16 = 'params=float32,compute=bfloat16,output=float32'
F32 = 'params=float32,compute=float32,output=float32'
E4M3, E5M2, BF, F32 = 'f8E4M3FN', 'f8E5M2', 'bf16', 'f32'
CONVOLUTION = ('conv_general_dilated',)


def _images(size=8, batch=4):
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.normal(size=(batch, size, size, 3)), jnp.float32)


def _mlp(images, is_training):
  del is_training
  return hk.nets.MLP([32, 32, 10])(images.reshape(len(images), -1))


def _resnet(images, is_training):
  return hk.nets.ResNet18(10, resnet_v2=True)(images, is_training)


class _Block(hk.Module):
  """A pre-norm transformer classifier of stock Haiku modules: a patch
  embedding, attention, an MLP."""

  def __call__(self, images, is_training):
    del is_training
    x = hk.Conv2D(32, kernel_shape=4, stride=4, padding='VALID')(images)
    x = x.reshape(len(images), -1, 32)
    y = hk.LayerNorm(-1, True, True)(x)
    x = x + hk.MultiHeadAttention(2, 16, w_init=hk.initializers.VarianceScaling(
        1.0))(y, y, y)
    y = hk.LayerNorm(-1, True, True)(x)
    x = x + hk.nets.MLP([64, 32])(y)
    return hk.Linear(10, name='head')(x.mean(axis=1))


def _block(images, is_training):
  return _Block()(images, is_training)


# model: (forward, model class, overrides)
MODELS = {
    'mlp': (_mlp, 'MLP', ''),
    # Batch statistics in float32, as LayerNorm's are by default.
    'resnet': (_resnet, 'ResNet18', 'BatchNorm:p=f32,c=f32,o=bf16'),
    'block': (_block, '_Block', ''),
}


def _transformed(name, precision=None):
  fn = MODELS[name][0]

  def forward(images, is_training):
    if precision is None:
      return fn(images, is_training)
    with haiku_mp.apply_precision(precision):
      return fn(images, is_training)

  return hk.transform_with_state(forward)


def _precision(name, low_bit_modules='', fp8=haiku_mp.Fp8(), **kwargs):
  # Half operands into float32 sums whatever this CPU's `auto` form is.
  kwargs.setdefault('dot_form', 'native')
  _, model_class, overrides = MODELS[name]
  return haiku_mp.make_precision(BF16, overrides, model_class=model_class,
                                 low_bit=haiku_mp.LowBit(low_bit_modules, fp8),
                                 **kwargs)


def _train_step(forward, images):
  """A train step of `forward` (Adam, cross-entropy in float32) and its
  arguments' shapes (all that tracing it takes: no init is run)."""
  params, state = jax.eval_shape(
      lambda key: forward.init(key, images, True), jax.random.key(0))
  labels = jnp.arange(len(images)) % 10
  optimizer = optax.adam(1e-3)

  def train_step(params, state, opt_state):
    def loss_fn(params):
      logits, new_state = forward.apply(params, state, jax.random.key(1),
                                        images, True)
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), labels).mean()
      return loss, new_state
    grads, new_state = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), new_state, opt_state

  return train_step, (params, state, jax.eval_shape(optimizer.init, params))


def _model_images(name):
  return _images(16 if name == 'resnet' else 8)


@functools.cache
def _traced_step(name, low_bit_modules=''):
  """The train step of model `name` under its bf16 precision (fp8 on
  `low_bit_modules`), traced once for every test that reads its jaxpr or
  lowered program."""
  forward = _transformed(name, _precision(name, low_bit_modules))
  step, args = _train_step(forward, _model_images(name))
  return jax.jit(step).trace(*args)


# A dot of the lowered program: its operands' and result's element types.
_DOT = re.compile(r'stablehlo\.dot_general .*: \(tensor<(?:\d+x)*(\w+)>, '
                  r'tensor<(?:\d+x)*(\w+)>\) -> tensor<(?:\d+x)*(\w+)>')


def _lowered_dots(name, low_bit_modules='') -> collections.Counter:
  """(lhs, rhs, result) element types of every dot in the lowered program
  of `_traced_step(name, low_bit_modules)` (what XLA receives: the
  backward's dots that nothing uses, such as the images' gradient, are
  gone)."""
  text = _traced_step(name, low_bit_modules).lower().as_text()
  return collections.Counter(m.groups() for m in _DOT.finditer(text))


def _pairs(matmuls) -> collections.Counter:
  pairs = collections.Counter()
  for (lhs, rhs, _), count in matmuls.items():
    pairs[lhs, rhs] += count
  return pairs


@helpers.long_running
class StockModulesTest(parameterized.TestCase):

  # Per model, the dots of its hk.Linear (and patch-embedding hk.Conv2D)
  # layers: one forward, the input's gradient (but the first layer's, of the
  # images) and the weight's. The block's attention has 2 batched dots of
  # its own (the logits and the weighted values, 3 each with the backward),
  # summed in float32 (`stock_attention`); batched, on a CPU they take
  # float32 operands (XLA:CPU runs no batched half x half -> float32 dot).
  @parameterized.parameters(('mlp', 3 * 3 - 1, 0), ('resnet', 3, 0),
                            ('block', 1 * 2 + (4 + 2 + 1) * 3, 2 * 3))
  def test_every_matmul_takes_bf16_operands_forward_and_backward(
      self, name, ours, attention):
    matmuls = _lowered_dots(name)
    # Every matmul sums in float32.
    expected = {(BF, BF, F32): ours}
    if attention:
      expected[(F32, F32, F32)] = attention
    self.assertEqual(matmuls, expected)

  def test_resnet_convolutions_stay_haikus_in_bf16(self):
    # Not a patch embedding: XLA's convolution, in the operands' dtype.
    eqns = [e for e in helpers.iter_eqns(_traced_step('resnet').jaxpr.jaxpr)
            if e.primitive.name in CONVOLUTION]
    self.assertEqual({helpers.operand_dtypes(e) for e in eqns},
                     {('bfloat16', 'bfloat16')})
    # ResNet18's 20 convolutions, forward and both gradients, but the
    # images' (no gradient asked).
    self.assertLen(eqns, 20 * 3 - 1)

  # fp8 on chosen layers: E4M3 forward, E5M2 output gradients, float32
  # sums; the others stay bf16. (fp8 layers, of them the first, whose input
  # gradient is not computed; bf16 x bf16 dots left; the attention's batched
  # dots, upcast on a CPU)
  @parameterized.parameters(
      ('mlp', '*/linear_0;*/linear_1', 2, 1, 3, 0),
      ('resnet', 'Linear', 1, 0, 0, 0),
      ('block', '*/multi_head_attention/*', 4, 0, 2 + 3 * 3, 2 * 3))
  def test_fp8_targets_run_fp8_forward_and_backward(self, name, targets,
                                                    fp8_layers, first,
                                                    bf16_dots, attention):
    matmuls = _lowered_dots(name, targets)
    for (lhs, rhs, out), count in matmuls.items():
      if lhs.startswith('f8'):
        self.assertEqual(out, F32)
    expected = {(E4M3, E4M3): fp8_layers, (E5M2, E4M3): fp8_layers - first,
                (E4M3, E5M2): fp8_layers}
    expected = {k: v for k, v in expected.items() if v}
    if bf16_dots:
      expected[(BF, BF)] = bf16_dots
    if attention:
      expected[(F32, F32)] = attention
    self.assertEqual(_pairs(matmuls), expected)

  @parameterized.parameters('mlp', 'resnet', 'block')
  def test_params_are_haikus_own(self, name):
    images = _model_images(name)
    inits = [_transformed(name).init] + [
        _transformed(name, _precision(name, fp8)).init
        for fp8 in ('', 'Linear')]
    # The stock model's params, then ours in bf16 and with fp8 Linears, in
    # one program (run op by op, each init's forward pass compiled every
    # operation in each dtype).
    stock, *ours = jax.jit(lambda key: [init(key, images, True)[0]
                                        for init in inits])(jax.random.key(0))
    for params in ours:
      # A stock model's checkpoint restores either way.
      chex.assert_trees_all_equal(params, stock)

  def test_delayed_scaling_keeps_histories_in_the_layer(self):
    precision = _precision('mlp', '*/linear_1',
                           fp8=haiku_mp.Fp8('delayed', history_length=4))
    params, _ = jax.eval_shape(
        lambda key: _transformed('mlp', precision).init(key, _images(), True),
        jax.random.key(0))
    self.assertEqual(
        sorted(params['mlp/~/linear_1']),
        ['b', 'fp8_g_amax_history', 'fp8_w_amax_history',
         'fp8_x_amax_history', 'w'])
    self.assertEqual(sorted(params['mlp/~/linear_0']), ['b', 'w'])

  def test_plain_policies_give_hk_mixed_precisions_logits(self):
    # The policies alone (Haiku's matmuls: dot_form 'plain'): the program and
    # logits of hk.mixed_precision with the same class rule.
    images = _images()
    ours = _transformed('mlp', _precision('mlp', dot_form='plain'))

    def haiku_forward(images, is_training):
      with hk.mixed_precision.push_policy(hk.nets.MLP, jmp.get_policy(BF16)):
        return _mlp(images, is_training)

    theirs = hk.transform_with_state(haiku_forward)
    params, state = theirs.init(jax.random.key(0), images, True)
    apply = lambda f: f.apply(params, state, None, images, True)[0]
    # The same operations, but for the names that remat's 'dots' saves by.
    ops = lambda f: [(e.primitive.name, helpers.operand_dtypes(e))
                     for e in helpers.iter_eqns(
                         jax.make_jaxpr(lambda: apply(f))().jaxpr)
                     if e.primitive.name != 'name']
    self.assertEqual(ops(ours), ops(theirs))
    logits = apply(ours)
    chex.assert_type(logits, jnp.float32)
    np.testing.assert_array_equal(logits, apply(theirs))


class MatmulsInForceTest(absltest.TestCase):

  def _call(self, matmuls, precision):
    def forward(x):
      with haiku_mp.apply_precision(precision):
        return haiku_mp.Linear(4, matmuls=matmuls)(x)
    return hk.transform(forward).init(jax.random.key(0), jnp.ones((2, 3)))

  def test_a_linear_without_matmuls_takes_the_precisions(self):
    precision = haiku_mp.make_precision(BF16, model_class='Linear',
                                        low_bit=haiku_mp.LowBit('Linear'))
    params = self._call(None, precision)
    apply = hk.transform(
        lambda x: _in(precision, lambda: haiku_mp.Linear(4)(x))).apply
    eqns = helpers.eqns_of(lambda x: apply(params, None, x), jnp.ones((2, 3)))
    self.assertEqual([helpers.operand_dtypes(e) for e in eqns],
                     [('float8_e4m3fn', 'float8_e4m3fn')])

  def test_matmuls_that_contradict_the_precision_are_an_error(self):
    precision = haiku_mp.make_precision(BF16, model_class='Linear',
                                        low_bit=haiku_mp.LowBit('Linear'))
    with self.assertRaisesRegex(haiku_mp.errors.ConfigError,
                                'linear: matmuls=.* contradicts the precision'):
      self._call(haiku_mp.Matmuls(), precision)
    self._call(precision.matmuls, precision)  # Agreeing matmuls are fine.


def _in(precision, fn):
  with haiku_mp.apply_precision(precision):
    return fn()


def _mlp_init(precision, second_top_level=False):
  """`init` of Haiku's MLP under `precision`, with another top-level Linear
  after it if asked."""

  def forward(x):
    with haiku_mp.apply_precision(precision):
      y = hk.nets.MLP([8, 4])(x)
      return hk.Linear(2)(y) if second_top_level else y

  return hk.transform(forward).init(jax.random.key(0), jnp.ones((2, 3)))


class TargetsCheckedTest(parameterized.TestCase):
  """Every target is checked at the end of the first forward pass under
  `apply_precision`, in the library: one line naming it, with the nearest
  class names and paths."""

  @parameterized.named_parameters(
      ('model_class_typo', dict(model_class='MPL'),
       "model_class: target 'MPL' matches no module class or module path "
       '(its policy would reach no module: the model would run in float32). '
       'Nearest: MLP.'),
      ('override_of_nothing', dict(overrides='*/nothing:float32'),
       "overrides: target '*/nothing' matches no module class or "
       'module path.'),
      ('override_of_a_bare_name', dict(overrides='linear_1:float32'),
       "overrides: target 'linear_1' matches no module class or "
       "module path (for a module path ending in it, write '*/linear_1')"),
      ('override_class_typo', dict(overrides='Lienar:float32'),
       "overrides: target 'Lienar' matches no module class or "
       'module path. Nearest: Linear.'),
      ('fp8_on_a_class_not_there', dict(low_bit=haiku_mp.LowBit('LayerNorm')),
       "low_bit.modules: target 'LayerNorm' matches no module class "
       'or module path.'),
      ('fp8_of_nothing', dict(low_bit=haiku_mp.LowBit('*/nothing')),
       "low_bit.modules: target '*/nothing' matches no module class or "
       'module path.'),
      ('fp8_bare_name', dict(low_bit=haiku_mp.LowBit('linear_1')),
       "low_bit.modules: target 'linear_1' matches no module class or "
       "module path (for a module path ending in it, write '*/linear_1')"))
  def test_a_target_that_matches_nothing(self, settings, message):
    settings = dict(dict(model_class=hk.nets.MLP), **settings)
    precision = haiku_mp.make_precision(BF16, **settings)
    with self.assertRaises(haiku_mp.errors.ConfigError) as raised:
      _mlp_init(precision)
    self.assertIn(message, str(raised.exception))
    self.assertIn('Classes: Linear, MLP', str(raised.exception))
    self.assertNotIn('\n', str(raised.exception))

  def test_a_second_top_level_module(self):
    precision = haiku_mp.make_precision(BF16, model_class=hk.nets.MLP)
    with self.assertRaisesRegex(
        haiku_mp.errors.ConfigError,
        "model_class: module 'linear' \\(Linear\\) is called outside 'MLP' "
        'and would run under no policy'):
      _mlp_init(precision, second_top_level=True)
    # With a rule of its own it runs under that rule.
    _mlp_init(haiku_mp.make_precision(BF16, 'linear:' + BF16,
                                      model_class=hk.nets.MLP),
              second_top_level=True)

  def test_targets_that_match_pass_and_check_is_public(self):
    precision = haiku_mp.make_precision(
        BF16, {'*/linear_1': F32}, model_class=hk.nets.MLP,
        low_bit=haiku_mp.LowBit([hk.Linear]))
    _mlp_init(precision)  # No error.
    modules = {('MLP', 'mlp'), ('Linear', 'mlp/~/linear_0')}
    with self.assertRaisesRegex(haiku_mp.errors.ConfigError,
                                "target '\\*/linear_1' matches no module"):
      precision.check(modules)

  def test_only_the_first_forward_pass_is_checked(self):
    precision = haiku_mp.make_precision(BF16, '*/linear_1:float32',
                                        model_class=hk.nets.MLP)

    def forward(x, first_layer_only):
      with haiku_mp.apply_precision(precision):
        mlp = hk.nets.MLP([8, 4])
        return mlp.layers[0](x) if first_layer_only else mlp(x)

    forward = hk.transform(forward)
    params = forward.init(jax.random.key(0), jnp.ones((2, 3)), False)
    # A later pass through part of the model (its override's module not
    # called) is not a whole model's: nothing to check against.
    forward.apply(params, None, jnp.ones((2, 3)), True)


class _Attend(hk.Module):
  """One `hk.MultiHeadAttention` over padded sequences, Haiku's own mask
  convention (1 where a key may be attended to), and a linear head."""

  def __call__(self, tokens):
    valid = tokens > 0
    length = tokens.shape[1]
    mask = valid[:, None, None, :] * jnp.tril(jnp.ones((length, length)))
    x = hk.Embed(8, 16)(tokens)
    x = hk.MultiHeadAttention(2, 8, w_init=hk.initializers.VarianceScaling(
        1.0))(x, x, x, mask=mask)
    return hk.Linear(8)(x)


def _masked_attention(policy=None, **kwargs):
  """`_Attend` under `policy` (None: Haiku alone)."""
  if policy is None:
    return hk.transform(lambda tokens: _Attend()(tokens))
  precision = haiku_mp.make_precision(policy, model_class=_Attend, **kwargs)

  def forward(tokens):
    with haiku_mp.apply_precision(precision):
      return _Attend()(tokens)

  return hk.transform(forward)


# Left-padded sequences: a padding query row's keys are all masked.
_TOKENS = jnp.array([[0, 0, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])
F16 = 'params=float32,compute=float16,output=float32'


@functools.cache
def _attention_params():
  """`_Attend`'s params, initialized once under the float32 policy."""
  return jax.jit(_masked_attention(F32).init)(jax.random.key(0), _TOKENS)


def _next_token_loss(forward, params):
  logits = forward.apply(params, None, _TOKENS).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], _TOKENS[:, 1:]).mean()


@helpers.long_running
class HalfPrecisionAttentionTest(parameterized.TestCase):

  @parameterized.parameters(F16, BF16)
  def test_masked_rows_stay_finite_and_losses_near_float32s(self, policy):
    reference = _masked_attention(F32)
    params = _attention_params()
    expected = jax.jit(lambda p: _next_token_loss(reference, p))(params)
    half = _masked_attention(policy)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: _next_token_loss(half, p)))(params)
    self.assertTrue(np.isfinite(float(loss)))
    self.assertTrue(all(bool(jnp.isfinite(g).all())
                        for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(loss, expected, rtol=2e-2)

  def test_logits_and_softmax_in_float32_projections_in_half(self):
    # The program a GPU runs: half operands into float32 sums.
    forward = _masked_attention(F16, dot_platform='gpu')
    params = jax.eval_shape(forward.init, jax.random.key(0), _TOKENS)
    apply = lambda p: forward.apply(p, None, _TOKENS)
    exps = helpers.eqns_of(apply, params, primitives=('exp',))
    self.assertEqual({helpers.operand_dtypes(e) for e in exps},
                     {('float32',)})
    matmuls = [helpers.operand_dtypes(e)
            for e in helpers.eqns_of(apply, params, primitives=('dot_general',))]
    # Four projections and the head; the logits' and the values' batched
    # dots take float16 operands too, into float32 sums.
    self.assertEqual(matmuls.count(('float16', 'float16')), 7)
    self.assertLen(matmuls, 7)

  def test_a_float32_policy_runs_haikus_own_attention(self):
    params = _attention_params()
    ours = jax.jit(_masked_attention(F32).apply)(params, None, _TOKENS)
    np.testing.assert_array_equal(
        ours, jax.jit(_masked_attention().apply)(params, None, _TOKENS))


class InheritedInputTest(absltest.TestCase):

  def test_a_convolution_takes_a_float32_input_made_inside_the_model(self):
    # hk.Sequential as the model class; its first layer divides integer
    # images by 255, which makes float32 after the policy's cast.
    precision = haiku_mp.make_precision(BF16, model_class=hk.Sequential,
                                        dot_form='native')

    def forward(images):
      with haiku_mp.apply_precision(precision):
        return hk.Sequential([lambda x: x / 255.0, hk.Conv2D(4, 3),
                              jax.nn.relu, hk.Flatten(), hk.Linear(3)])(images)

    forward = hk.transform(forward)
    images = np.zeros((2, 8, 8, 3), np.uint8)
    params = forward.init(jax.random.key(0), images)  # Eager, NumPy input.
    eqns = helpers.eqns_of(lambda p: forward.apply(p, None, images), params,
                           primitives=('conv_general_dilated', 'dot_general'))
    self.assertEqual({helpers.operand_dtypes(e) for e in eqns},
                     {('bfloat16', 'bfloat16')})


if __name__ == '__main__':
  absltest.main()
