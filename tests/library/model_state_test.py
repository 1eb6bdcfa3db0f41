"""Models with Haiku state (`hk.transform_with_state`): BatchNorm's moving
statistics live in `TrainState.model_state`, in float32 by default, are kept
by a skipped step, averaged over replicas, and read by the eval step."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import haiku_mp
from tests import helpers

BF16 = 'params=float32,compute=bfloat16,output=float32'
F16 = 'params=float32,compute=float16,output=float32'
PURE_BF16 = 'params=bfloat16,compute=bfloat16,output=float32'


class _Net(hk.Module):
  """Linear -> BatchNorm -> ReLU -> Linear: one module with state."""

  def __call__(self, x, is_training):
    x = hk.Linear(16)(x)
    x = hk.BatchNorm(True, True, decay_rate=0.5)(x, is_training)
    return hk.Linear(4)(jax.nn.relu(x))


def _forward(policy=BF16, overrides='', **kwargs):
  precision = haiku_mp.make_precision(policy, overrides, model_class=_Net,
                                      **kwargs)

  def forward(x, is_training):
    with haiku_mp.apply_precision(precision):
      return _Net()(x, is_training)

  return hk.transform_with_state(forward)


def _batch(scale=1.0, offset=3.0):
  rng = np.random.default_rng(0)
  x = offset + scale * rng.normal(size=(32, 6)).astype(np.float32)
  return dict(image=jnp.asarray(x, jnp.float32),
              label=jnp.asarray(rng.integers(0, 4, 32), jnp.int32))


def _state_dtypes(model_state):
  return {jnp.dtype(x.dtype).name for x in jax.tree.leaves(model_state)
          if jnp.issubdtype(x.dtype, jnp.floating)}


class BatchNormPrecisionTest(parameterized.TestCase):

  @parameterized.parameters(BF16, F16, PURE_BF16)
  def test_statistics_and_compute_in_float32_by_default(self, policy):
    forward = _forward(policy)
    batch = _batch()
    params, model_state = forward.init(jax.random.key(0), batch['image'],
                                       True)
    self.assertEqual(_state_dtypes(model_state), {'float32'})
    _, new_state = forward.apply(params, model_state, None, batch['image'],
                                 True)
    self.assertEqual(_state_dtypes(new_state), {'float32'})
    # Its statistics are reduced from float32 values.
    eqns = helpers.eqns_of(
        lambda x: forward.apply(params, model_state, None, x, True)[0],
        batch['image'], primitives=('reduce_sum',))
    self.assertTrue(eqns)
    self.assertEqual({helpers.operand_dtypes(e) for e in eqns},
                     {('float32',)})

  def test_an_override_takes_batch_norm_to_half(self):
    forward = _forward(BF16, 'BatchNorm:p=bf16,c=bf16,o=bf16')
    params, model_state = forward.init(jax.random.key(0), _batch()['image'],
                                       True)
    self.assertEqual(_state_dtypes(model_state), {'bfloat16'})
    self.assertEqual(
        _state_dtypes(forward.apply(params, model_state, None,
                                    _batch()['image'], True)[1]),
        {'bfloat16'})

  def test_float32_batch_norm_false_leaves_it_to_the_model_policy(self):
    forward = _forward(BF16, float32_batch_norm=False)
    _, model_state = forward.init(jax.random.key(0), _batch()['image'], True)
    # Created from the model's bfloat16 activations, kept in its params'
    # dtype (float32), as a param would be.
    self.assertEqual(_state_dtypes(model_state), {'float32'})


class TrainStateWithModelStateTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.forward = _forward()
    cls.batch = _batch()
    cls.loss_fn = haiku_mp.make_classification_loss(cls.forward)
    cls.optimizer = optax.adam(1e-2)
    cls.scaler = haiku_mp.LossScaler('dynamic', initial=2.0**4, period=100)
    params, model_state = cls.forward.init(jax.random.key(0),
                                           cls.batch['image'], True)
    cls.state = haiku_mp.init_train_state(params, cls.optimizer, cls.scaler,
                                          jax.random.key(1), model_state)
    # Static: a jitted function set on the class would be bound as a method.
    cls.step = staticmethod(jax.jit(haiku_mp.make_train_step(
        cls.loss_fn, cls.optimizer, cls.scaler)))
    cls.eval_step = staticmethod(jax.jit(haiku_mp.make_eval_step(
        cls.forward)))

  def test_the_loss_is_a_loss_with_state(self):
    self.assertIsInstance(self.loss_fn, haiku_mp.LossWithState)

  def test_steps_train_and_move_the_moving_statistics(self):
    state, losses = self.state, []
    for _ in range(4):
      state, metrics = self.step(state, self.batch)
      losses.append(float(metrics['loss']))
    self.assertLess(losses[-1], losses[0])
    self.assertEqual(int(state.skipped_steps), 0)
    mean = jax.tree.leaves(
        {k: v for k, v in state.model_state.items() if 'mean_ema' in k})
    before = jax.tree.leaves({k: v for k, v in self.state.model_state.items()
                              if 'mean_ema' in k})
    self.assertFalse(all(np.array_equal(a, b) for a, b in zip(mean, before)))
    self.assertEqual(_state_dtypes(state.model_state), {'float32'})

  def test_a_skipped_step_keeps_the_model_state(self):
    bad = dict(self.batch, image=self.batch['image'].at[0, 0].set(jnp.inf))
    state, metrics = self.step(self.state, bad)
    self.assertFalse(bool(metrics['grads_finite']))
    chex.assert_trees_all_equal(state.model_state, self.state.model_state)
    chex.assert_trees_all_equal(state.params, self.state.params)

  def test_eval_reads_the_moving_statistics(self):
    state = self.state
    for _ in range(3):
      state, _ = self.step(state, self.batch)
    shifted = dict(self.batch, image=self.batch['image'] + 5.0)
    # In eval, BatchNorm normalizes by the moving statistics, not by the
    # batch's own: a shifted batch changes the logits.
    a = self.eval_step(state.params, self.batch, state.model_state)['logits']
    b = self.eval_step(state.params, shifted, state.model_state)['logits']
    self.assertGreater(float(jnp.abs(a - b).max()), 0.1)
    # Two different moving statistics give two different evaluations.
    c = self.eval_step(state.params, self.batch,
                       self.state.model_state)['logits']
    self.assertGreater(float(jnp.abs(a - c).max()), 1e-3)

  def test_eval_without_the_state_is_one_line(self):
    with self.assertRaisesRegex(TypeError, 'eval_step: the model has Haiku '
                                'state; pass it'):
      self.eval_step(self.state.params, self.batch)

  def test_a_stateless_loss_refuses_a_state_with_model_state(self):
    stateless = haiku_mp.make_classification_loss(hk.transform(
        lambda x, t: hk.Linear(4)(x)))
    step = haiku_mp.make_train_step(stateless, self.optimizer, self.scaler)
    with self.assertRaisesRegex(TypeError, 'state.model_state holds Haiku '
                                'state but the loss takes none'):
      jax.eval_shape(step, self.state, self.batch)

  def test_init_with_the_pair_from_init_is_one_line(self):
    pair = self.forward.init(jax.random.key(0), self.batch['image'], True)
    with self.assertRaisesRegex(TypeError, 'pass the state as model_state'):
      haiku_mp.init_train_state(pair, self.optimizer, self.scaler,
                                jax.random.key(1))


if __name__ == '__main__':
  absltest.main()
