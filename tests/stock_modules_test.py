"""Models nobody here wrote: Haiku's own MLP, ResNet18 and a transformer
block of stock modules, unchanged, under `apply_precision`: their matmuls run
half x half into float32 sums, or fp8 where the targets say, forward and
backward; their params are Haiku's."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import collections
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


def _precision(name, fp8_modules='', **kwargs):
  _, model_class, overrides = MODELS[name]
  return haiku_mp.make_precision(BF16, overrides, model_class=model_class,
                                 fp8_modules=fp8_modules, **kwargs)


def _train_step(forward, images):
  """A train step of `forward` (Adam, cross-entropy in float32) and its
  arguments."""
  params, state = forward.init(jax.random.key(0), images, True)
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

  return train_step, (params, state, optimizer.init(params))


# A dot of the lowered program: its operands' and result's element types.
_DOT = re.compile(r'stablehlo\.dot_general .*: \(tensor<(?:\d+x)*(\w+)>, '
                  r'tensor<(?:\d+x)*(\w+)>\) -> tensor<(?:\d+x)*(\w+)>')


def _lowered_dots(forward, images) -> collections.Counter:
  """(lhs, rhs, result) element types of every dot in the train step's
  lowered program (what XLA receives: the backward's dots that nothing
  uses, such as the images' gradient, are gone)."""
  step, args = _train_step(forward, images)
  text = jax.jit(step).lower(*args).as_text()
  return collections.Counter(m.groups() for m in _DOT.finditer(text))


def _pairs(dots) -> collections.Counter:
  pairs = collections.Counter()
  for (lhs, rhs, _), count in dots.items():
    pairs[lhs, rhs] += count
  return pairs


class StockModulesTest(parameterized.TestCase):

  # Per model, the dots of its hk.Linear (and patch-embedding hk.Conv2D)
  # layers: one forward, the input's gradient (but the first layer's, of the
  # images) and the weight's. The block's attention has 2 batched dots of
  # its own (jnp.einsum, Haiku's code: bf16 x bf16 into bf16, 3 each with
  # the backward).
  @parameterized.parameters(('mlp', 3 * 3 - 1, 0), ('resnet', 3, 0),
                            ('block', 1 * 2 + (4 + 2 + 1) * 3, 2 * 3))
  def test_every_matmul_takes_bf16_operands_forward_and_backward(
      self, name, ours, haikus):
    dots = _lowered_dots(_transformed(name, _precision(name)),
                         _images(16 if name == 'resnet' else 8))
    # Ours sum in float32, Haiku's attention einsums in bf16.
    expected = {(BF, BF, F32): ours}
    if haikus:
      expected[(BF, BF, BF)] = haikus
    self.assertEqual(dots, expected)

  def test_resnet_convolutions_stay_haikus_in_bf16(self):
    # Not a patch embedding: XLA's convolution, in the operands' dtype.
    step, args = _train_step(_transformed('resnet', _precision('resnet')),
                             _images(16))
    eqns = helpers.eqns_of(step, *args, primitives=CONVOLUTION)
    self.assertEqual({helpers.operand_dtypes(e) for e in eqns},
                     {('bfloat16', 'bfloat16')})
    # ResNet18's 20 convolutions, forward and both gradients, but the
    # images' (no gradient asked).
    self.assertLen(eqns, 20 * 3 - 1)

  # fp8 on chosen layers: E4M3 forward, E5M2 output gradients, float32
  # sums; the others stay bf16. (fp8 layers, of them the first, whose input
  # gradient is not computed; bf16 x bf16 dots left)
  @parameterized.parameters(
      ('mlp', '*/linear_0;*/linear_1', 2, 1, 3),
      ('resnet', 'Linear', 1, 0, 0),
      ('block', '*/multi_head_attention/*', 4, 0, 2 + 3 * 3 + 2 * 3))
  def test_fp8_targets_run_fp8_forward_and_backward(self, name, targets,
                                                    fp8_layers, first,
                                                    bf16_dots):
    dots = _lowered_dots(_transformed(name, _precision(name, targets)),
                         _images(16 if name == 'resnet' else 8))
    for (lhs, rhs, out), count in dots.items():
      if lhs.startswith('f8'):
        self.assertEqual(out, F32)
    expected = {(E4M3, E4M3): fp8_layers, (E5M2, E4M3): fp8_layers - first,
                (E4M3, E5M2): fp8_layers}
    expected = {k: v for k, v in expected.items() if v}
    if bf16_dots:
      expected[(BF, BF)] = bf16_dots
    self.assertEqual(_pairs(dots), expected)

  @parameterized.parameters('mlp', 'resnet', 'block')
  def test_params_are_haikus_own(self, name):
    images = _images(16 if name == 'resnet' else 8)
    stock, _ = _transformed(name).init(jax.random.key(0), images, True)
    for fp8 in ('', 'Linear'):
      ours, _ = _transformed(name, _precision(name, fp8)).init(
          jax.random.key(0), images, True)
      # A stock model's checkpoint restores either way.
      chex.assert_trees_all_equal(ours, stock)

  def test_delayed_scaling_keeps_histories_in_the_layer(self):
    precision = _precision('mlp', '*/linear_1',
                           fp8=haiku_mp.Fp8('delayed', history_length=4))
    params, _ = _transformed('mlp', precision).init(
        jax.random.key(0), _images(), True)
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


class DotsInForceTest(absltest.TestCase):

  def _call(self, dots, precision):
    def forward(x):
      with haiku_mp.apply_precision(precision):
        return haiku_mp.Linear(4, dots=dots)(x)
    return hk.transform(forward).init(jax.random.key(0), jnp.ones((2, 3)))

  def test_a_linear_without_dots_takes_the_precisions(self):
    precision = haiku_mp.make_precision(BF16, model_class='Linear',
                                        fp8_modules='Linear')
    params = self._call(None, precision)
    apply = hk.transform(
        lambda x: _in(precision, lambda: haiku_mp.Linear(4)(x))).apply
    eqns = helpers.eqns_of(lambda x: apply(params, None, x), jnp.ones((2, 3)))
    self.assertEqual([helpers.operand_dtypes(e) for e in eqns],
                     [('float8_e4m3fn', 'float8_e4m3fn')])

  def test_dots_that_contradict_the_precision_are_an_error(self):
    precision = haiku_mp.make_precision(BF16, model_class='Linear',
                                        fp8_modules='Linear')
    with self.assertRaisesRegex(haiku_mp.errors.ConfigError,
                                'linear: dots=.* contradicts the precision'):
      self._call(haiku_mp.Dots(), precision)
    self._call(precision.dots, precision)  # Agreeing dots are fine.


def _in(precision, fn):
  with haiku_mp.apply_precision(precision):
    return fn()


if __name__ == '__main__':
  absltest.main()
