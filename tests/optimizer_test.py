"""Tests for the optimizer: schedule, and the float32 master copy of half params."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from haiku_mp import optimizer as optimizer_lib
from haiku_mp import precision
from tests import helpers

LEARNING_RATE = 1e-4  # Below half of float16's spacing at 1.0 (2**-10).
STEPS = 30  # Enough to move even bfloat16 (spacing 2**-8 below 1).


def _run(optimizer, params, steps=STEPS):
  state = optimizer.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = optimizer.update(grads, state, params)
    return optimizer_lib.apply_updates(params, updates, state), state

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
        optimizer_lib.float32_master(optax.sgd(LEARNING_RATE)), params)
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
    mastered, state = _run(optimizer_lib.float32_master(inner), params)
    np.testing.assert_allclose(mastered['w'], plain['w'], rtol=1e-6)
    np.testing.assert_array_equal(mastered['w'], state.master['w'])
    np.testing.assert_array_equal(mastered['h'],
                                  state.master['h'].astype(jnp.bfloat16))
    self.assertEqual(mastered['h'].dtype, jnp.bfloat16)

  def test_wrapped_only_when_the_policy_stores_half_params(self):
    config = helpers.tiny_config()
    for policy, overrides, expected in (
        ('p=f32,c=bf16,o=f32', '', False),
        ('p=bf16,c=bf16,o=f32', '', True),
        ('p=f32,c=f16,o=f32', '*/head:p=f16,c=f16,o=f32', True)):
      plan = precision.make_precision(policy, overrides, model_class='X')
      self.assertEqual(plan.half_params, expected, policy + overrides)
      state = optimizer_lib.make_optimizer(
          config, 10, plan.half_params).init({'w': jnp.ones((2, 2))})
      self.assertEqual(isinstance(state, optimizer_lib.MasterState), expected)


class ScheduleTest(absltest.TestCase):

  def test_warmup_then_cosine_to_zero(self):
    config = helpers.tiny_config()
    config.learning_rate, config.warmup_steps = 1e-3, 10
    schedule = optimizer_lib.learning_rate_schedule(config, 100)
    self.assertEqual(float(schedule(0)), 0.0)
    self.assertAlmostEqual(float(schedule(10)), 1e-3, places=9)
    self.assertAlmostEqual(float(schedule(100)), 0.0, places=9)


if __name__ == '__main__':
  absltest.main()
