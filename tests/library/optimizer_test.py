"""Tests for the optimizer: schedule, and the float32 master copy of half params."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from haiku_mp.model import policies
from haiku_mp.update import moving_average
from haiku_mp.update import optimizer as optimizer_lib
from haiku_mp.update import param_updates
from haiku_mp.update import schedule as schedule_lib
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

LEARNING_RATE = 1e-4  # Below half of float16's spacing at 1.0 (2**-10).
STEPS = 30  # Enough to move even bfloat16 (spacing 2**-8 below 1).


def _run(optimizer, params, steps=STEPS):
  state = optimizer.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = optimizer.update(grads, state, params)
    return param_updates.apply_updates(params, updates, state), state

  for _ in range(steps):
    params, state = step(params, state)
  return params, state


class Float32MasterTest(parameterized.TestCase):

  @parameterized.parameters('float16', 'bfloat16')
  def test_small_updates_accumulate_in_the_master_copy(self, dtype):
    params = {'w': jnp.ones((3,), dtype)}
    plain, _ = _run(optax.sgd(LEARNING_RATE), params)
    # Without a master copy, 1 - 1e-4 rounds back to 1: nothing ever moves.
    np.testing.assert_array_equal(plain['w'], params['w'])

    mastered, state = _run(
        param_updates.float32_master(optax.sgd(LEARNING_RATE)), params)
    chex.assert_trees_all_equal_dtypes(mastered, params)
    self.assertEqual(state.master['w'].dtype, jnp.float32)
    np.testing.assert_allclose(state.master['w'], 1 - STEPS * LEARNING_RATE,
                               rtol=1e-6)
    np.testing.assert_array_equal(mastered['w'],
                                  state.master['w'].astype(dtype))
    self.assertTrue((mastered['w'] < 1).all())

  def test_float32_params_are_the_master_copy(self):
    params = {'w': jnp.linspace(-1, 1, 5, dtype=jnp.float32),
              'h': jnp.linspace(-1, 1, 5, dtype=jnp.bfloat16)}
    inner = optax.adamw(1e-2)
    plain, _ = _run(inner, {'w': params['w']})
    mastered, state = _run(param_updates.float32_master(inner), params)
    np.testing.assert_allclose(mastered['w'], plain['w'], rtol=1e-6)
    np.testing.assert_array_equal(mastered['w'], state.master['w'])
    np.testing.assert_array_equal(mastered['h'],
                                  state.master['h'].astype(jnp.bfloat16))
    self.assertEqual(mastered['h'].dtype, jnp.bfloat16)

  def test_wrapped_only_when_the_policy_stores_half_params(self):
    for policy, overrides, expected in (
        ('p=f32,c=bf16,o=f32', '', False),
        ('p=bf16,c=bf16,o=f32', '', True),
        ('p=f32,c=f16,o=f32', '*/head:p=f16,c=f16,o=f32', True)):
      plan = policies.make_precision(policy, overrides, model_class='X')
      self.assertEqual(plan.half_params, expected, policy + overrides)
      state = optimizer_lib.make_optimizer(
          optax.constant_schedule(1e-3), half_params=plan.half_params).init(
              {'w': jnp.ones((2, 2))})
      self.assertEqual(isinstance(state, param_updates.MasterState), expected)


class WeightDecayTest(absltest.TestCase):

  def test_decay_skips_biases_layer_norm_cls_token_and_positions(self):
    config = helpers.tiny_config()
    forward, _ = forward_lib.checked_forward(config)
    images = helpers.random_batch(config)['image']
    shapes = jax.eval_shape(
        lambda: forward.init(jax.random.key(0), images, True))
    # Every param non-zero, so that a decayed one moves.
    params = jax.tree.map(lambda p: jnp.full(p.shape, 0.1, p.dtype), shapes)
    optimizer = optimizer_lib.make_optimizer(
        schedule_lib.learning_rate_schedule(0.1, 0, total_steps=10),
        weight_decay=0.5)
    state = optimizer.init(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    # The first step's learning rate is the peak (no warmup): zero gradients
    # leave only the decay.
    updates, _ = jax.jit(optimizer.update)(zeros, state, params)
    names = {}
    for path, update in jax.tree_util.tree_flatten_with_path(updates)[0]:
      module, name = path[0].key, path[1].key
      names[f'{module}/{name}'] = bool(np.any(np.asarray(update) != 0))
    decayed = {n for n, moved in names.items() if moved}
    self.assertEqual(decayed, {n for n in names if n.endswith('/w')})
    self.assertIn('vit/cls_token', names)
    self.assertIn('vit/pos_embedding', names)
    self.assertTrue(any('ln_' in n for n in names))


class EmaTest(absltest.TestCase):

  def test_the_average_follows_the_params_in_float32(self):
    schedule = schedule_lib.learning_rate_schedule(0.01, 0, STEPS)
    params = {'m': {'w': jnp.ones(4, jnp.bfloat16)}}
    optimizer = optimizer_lib.make_optimizer(schedule, ema_decay=0.75,
                                             half_params=True)
    self.assertIsNone(moving_average.ema_params(
        optimizer_lib.make_optimizer(schedule).init(params)))
    state = optimizer.init(params)
    expected = np.ones(4, np.float32)
    for _ in range(3):
      grads = jax.tree.map(jnp.ones_like, params)
      updates, state = optimizer.update(grads, state, params)
      params = param_updates.apply_updates(params, updates, state)
      master = np.asarray(state.master['m']['w'])
      expected = 0.75 * expected + 0.25 * master
      ema = moving_average.ema_params(state)['m']['w']
      chex.assert_type(ema, jnp.float32)
      np.testing.assert_allclose(ema, expected, rtol=1e-6)
    self.assertTrue(np.all(np.asarray(ema) > master))  # It lags behind.


class EmaHorizonTest(absltest.TestCase):

  def test_the_decay_follows_the_runs_length(self):
    # Its time constant, 1 / (1 - decay), is the horizon's share of the run.
    for steps in (200, 70_200):
      decay = moving_average.ema_decay_for(0.0, 0.05, steps)
      self.assertAlmostEqual(1 / (1 - decay), 0.05 * steps, places=6)
    self.assertLess(moving_average.ema_decay_for(0.0, 0.05, 1_760),
                    moving_average.ema_decay_for(0.0, 0.05, 17_400))
    self.assertEqual(moving_average.ema_decay_for(0.9998, 0.0, 1_760), 0.9998)
    self.assertEqual(moving_average.ema_decay_for(0.0, 0.0, 1_760), 0.0)
    self.assertEqual(moving_average.ema_decay_for(0.0, 0.05, 3), 0.5)

  def test_the_experiment_keeps_that_average_and_says_so(self):
    config = helpers.tiny_config()
    config.num_train_steps, config.ema_horizon = 400, 0.05
    exp = experiment.build_without_data(settings_lib.parse(config))
    self.assertAlmostEqual(exp.ema_decay, 0.95)
    self.assertIsNotNone(
        moving_average.ema_params(exp.abstract_state.opt_state))
    self.assertIn('Moving average: decay 0.95 per step, a time constant of 20 '
                  "steps (5% of the run's 400)", '\n'.join(exp.describe()))
    config.ema_horizon = 0.0
    exp = experiment.build_without_data(settings_lib.parse(config))
    self.assertEqual((exp.ema_decay, exp.describe()), (0.0, []))
    self.assertIsNone(moving_average.ema_params(exp.abstract_state.opt_state))


class ScheduleTest(absltest.TestCase):

  def test_warmup_then_cosine_to_zero(self):
    schedule = schedule_lib.learning_rate_schedule(1e-3, warmup_steps=10,
                                                   total_steps=100)
    self.assertEqual(float(schedule(0)), 0.0)
    self.assertAlmostEqual(float(schedule(10)), 1e-3, places=9)
    self.assertAlmostEqual(float(schedule(100)), 0.0, places=9)


if __name__ == '__main__':
  absltest.main()
