"""Stochastic rounding and Kahan summation into bfloat16 state, and the
layouts without a float32 master that use them."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from haiku_mp.update import optimizer as optimizer_lib
from haiku_mp.update import param_updates
from haiku_mp.update import rounding

BF16_ULP_AT_ONE = 2.0**-7
# Below half of bfloat16's spacing at 1.0: to nearest, 1 + this is 1.
TINY = 2.0**-10
DRAWS = 20_000


def _neighbours(x):
  """The bfloat16 values below and above each float32 in `x` (equal where x
  is one), as float32."""
  bits = np.asarray(x, np.float32).view(np.uint32)
  low = (bits & np.uint32(0xFFFF0000)).view(np.float32)
  exact = (bits & np.uint32(0xFFFF)) == 0
  high = np.where(exact, low, np.nextafter(
      low.astype(ml_dtypes.bfloat16), np.copysign(np.inf, low).astype(
          ml_dtypes.bfloat16)).astype(np.float32))
  return np.minimum(low, high), np.maximum(low, high)


class StochasticRoundTest(parameterized.TestCase):

  def test_each_result_is_one_of_the_two_neighbours(self):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)
         ).astype(np.float32)
    got = np.asarray(rounding.stochastic_round(jax.random.key(0), x,
                                               jnp.bfloat16))
    self.assertEqual(got.dtype, ml_dtypes.bfloat16)
    low, high = _neighbours(x)
    got = got.astype(np.float32)
    self.assertTrue(np.all((got == low) | (got == high)))
    # Both ways happen: it is not truncation, nor rounding to nearest.
    inexact = low != high
    self.assertGreater(np.mean(got[inexact] == high[inexact]), 0.3)
    self.assertGreater(np.mean(got[inexact] == low[inexact]), 0.3)

  @parameterized.parameters(1.0 + 2.0**-9, -(3.0 + 2.0**-8), 1e-30 * 1.1)
  def test_the_mean_of_many_draws_is_the_float32_value(self, value):
    x = jnp.full((DRAWS,), value, jnp.float32)
    got = np.asarray(rounding.stochastic_round(
        jax.random.key(1), x, jnp.bfloat16)).astype(np.float64)
    low, high = (float(v[0]) for v in _neighbours(np.float32([value])))
    share_up = (np.float32(value) - low) / (high - low)
    standard_error = (high - low) * np.sqrt(share_up * (1 - share_up) / DRAWS)
    self.assertLess(abs(got.mean() - np.float32(value)), 4 * standard_error)
    # To nearest, the mean would be off by this many standard errors:
    nearest = float(np.float32(value).astype(ml_dtypes.bfloat16))
    self.assertGreater(abs(nearest - np.float32(value)), 10 * standard_error)

  def test_reproducible_from_the_key(self):
    x = jnp.linspace(1.0, 2.0, 1000, dtype=jnp.float32) + TINY
    one = rounding.stochastic_round(jax.random.key(3), x, jnp.bfloat16)
    chex.assert_trees_all_equal(
        one, rounding.stochastic_round(jax.random.key(3), x, jnp.bfloat16))
    self.assertFalse(np.array_equal(
        one, rounding.stochastic_round(jax.random.key(4), x, jnp.bfloat16)))

  def test_non_finite_values_and_float32_stay(self):
    x = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0], jnp.float32)
    got = rounding.stochastic_round(jax.random.key(0), x, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), x)
    same = rounding.stochastic_round(jax.random.key(0), x + TINY, jnp.float32)
    chex.assert_trees_all_equal(same, x + TINY)


def _sum_updates(param_update, steps=10_000):
  """1.0 in bfloat16 after `steps` SGD updates of +TINY each, with no master
  copy, rounded as `param_update` says."""
  optimizer = param_updates.without_master(optax.sgd(1.0), param_update)
  params = {'w': jnp.ones((64,), jnp.bfloat16)}
  grads = {'w': jnp.full((64,), -TINY, jnp.float32)}

  def step(carry, key):
    params, state = carry
    updates, state = optimizer.update(grads, state, params, key=key)
    return (param_updates.apply_updates(params, updates, state, key),
            state), None

  keys = jax.random.split(jax.random.key(0), steps)
  (params, state), _ = jax.jit(lambda c: jax.lax.scan(step, c, keys))(
      (params, optimizer.init(params)))
  return params['w'], state


class NoMasterTest(parameterized.TestCase):

  def test_kahan_sums_updates_below_half_an_ulp_nearest_never_moves(self):
    want = np.float32(1.0) + np.float32(10_000 * TINY)  # float32: exact.
    kahan, state = _sum_updates('kahan')
    chex.assert_type(kahan, jnp.bfloat16)
    chex.assert_type(state.compensation['w'], jnp.bfloat16)
    ulp = 2.0**(np.floor(np.log2(want)) - 7)
    np.testing.assert_allclose(np.asarray(kahan, np.float32), want,
                               atol=ulp, rtol=0)
    nearest, _ = _sum_updates('nearest')
    np.testing.assert_array_equal(np.asarray(nearest, np.float32), 1.0)

  def test_kahans_bfloat16_buffer_drops_updates_far_below_an_ulp(self):
    """What docs/precision.md says of Kahan late in a schedule: updates of
    3e-4 of an ulp are below half an ulp of the bfloat16 buffer that carries
    them, and most of their sum is rounded away there; 3e-2 of an ulp are
    kept."""
    ulp = 2.0**-7  # bfloat16's at 1.0.

    def kept(fraction):
      update = jnp.float32(fraction * ulp)
      value, comp = jax.lax.fori_loop(
          0, 10_000, lambda _, vc: rounding.kahan_add(vc[0], update, vc[1]),
          (jnp.bfloat16(1.0), jnp.bfloat16(0.0)))
      return (float(value) + float(comp) - 1.0) / (10_000 * float(update))

    self.assertLess(kept(3e-4), 0.1)
    self.assertAlmostEqual(kept(3e-2), 1.0, delta=0.01)

  def test_stochastic_rounding_sums_them_on_average(self):
    want = 1.0 + 10_000 * TINY
    got = np.asarray(_sum_updates('stochastic')[0], np.float32)
    # Each element's own walk: all moved, their mean within 2% of the sum.
    self.assertTrue(np.all(got > 1.0))
    self.assertLess(abs(got.mean() - want) / want, 0.02)

  def test_no_float32_copy_and_float32_params_take_the_float32_result(self):
    params = {'h': jnp.ones((3,), jnp.bfloat16), 'f': jnp.ones((3,))}
    for update in ('nearest', 'stochastic', 'kahan'):
      optimizer = param_updates.without_master(optax.adam(1e-2), update)
      state = optimizer.init(params)
      shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
      # Adam's moments (float32 here) and the compensation: nothing else
      # the size of the params.
      self.assertNotIsInstance(state, param_updates.MasterState)
      if update == 'kahan':
        self.assertEqual(shapes.compensation,
                         {'h': ((3,), jnp.bfloat16), 'f': ((3,), jnp.float32)})
      grads = jax.tree.map(jnp.ones_like, params)
      updates, state = optimizer.update(grads, state, params,
                                        key=jax.random.key(0))
      new = param_updates.apply_updates(params, updates, state,
                                        jax.random.key(0))
      chex.assert_trees_all_equal_dtypes(new, params)
      np.testing.assert_allclose(new['f'], 1 - 1e-2, rtol=1e-6)


class BfloatMomentsTest(parameterized.TestCase):

  def test_optax_adam_bit_for_bit_with_float32_moments(self):
    params = {'w': jnp.linspace(-1, 1, 8)}
    mine = optimizer_lib.scale_by_adam()
    theirs = optax.scale_by_adam()
    state_mine, state_theirs = mine.init(params), theirs.init(params)
    self.assertEqual(jax.tree.structure(state_mine),
                     jax.tree.structure(state_theirs))
    for i in range(3):
      grads = {'w': jnp.sin(jnp.arange(8.0) + i)}
      u_mine, state_mine = mine.update(grads, state_mine)
      u_theirs, state_theirs = theirs.update(grads, state_theirs)
      chex.assert_trees_all_equal(u_mine, u_theirs)
    chex.assert_trees_all_equal(state_mine, state_theirs)

  def test_bfloat16_second_moment_follows_float32_only_stochastically(self):
    """Adam's second moment at b2 = 0.999 under a constant gradient of 1:
    float32 rises toward 1 (1 - 0.999**t). Rounded to nearest in bfloat16 it
    stops where (1 - b2) * (1 - nu) falls below half an ulp of nu (about
    0.4); rounded stochastically it follows float32."""
    steps, b2 = 3000, 0.999
    params = {'w': jnp.zeros((256,))}
    grads = {'w': jnp.ones((256,))}
    adam = optimizer_lib.scale_by_adam(b2=b2, mu_dtype='bfloat16',
                                       nu_dtype='bfloat16')

    def step(carry, key):
      state, nearest = carry
      _, state = adam.update(grads, state, key=key)
      nearest = (b2 * nearest.astype(jnp.float32) + (1 - b2)).astype(
          jnp.bfloat16)
      return (state, nearest), None

    keys = jax.random.split(jax.random.key(0), steps)
    (state, nearest), _ = jax.jit(lambda c: jax.lax.scan(step, c, keys))(
        (adam.init(params), jnp.zeros((256,), jnp.bfloat16)))
    want = 1 - b2**steps  # 0.950
    chex.assert_type(state.nu['w'], jnp.bfloat16)
    chex.assert_type(state.mu['w'], jnp.bfloat16)
    nu = np.asarray(state.nu['w'], np.float32)
    self.assertLess(abs(nu.mean() - want) / want, 0.01)
    self.assertLess(float(np.asarray(nearest, np.float32).max()), 0.6)

  def test_bfloat16_moments_need_the_key(self):
    adam = optimizer_lib.scale_by_adam(nu_dtype='bfloat16')
    params = {'w': jnp.ones(2)}
    with self.assertRaisesRegex(ValueError, 'key'):
      adam.update(params, adam.init(params))


class MakeOptimizerTest(parameterized.TestCase):

  def test_float32_moments_keep_optax_adamw_state(self):
    """States saved before moment dtypes existed restore: the default is
    optax's AdamW, and bfloat16 moments keep its structure too."""
    params = {'m': {'w': jnp.ones((2, 2)), 'b': jnp.ones(2)}}
    schedule = optax.constant_schedule(1e-3)
    default = optimizer_lib.make_optimizer(schedule).init(params)
    plain = optax.adamw(schedule, mask=optimizer_lib.decay_mask).init(params)
    self.assertEqual(jax.tree.structure(default), jax.tree.structure(plain))
    low = optimizer_lib.make_optimizer(
        schedule, mu_dtype='bfloat16', nu_dtype='bfloat16').init(params)
    self.assertEqual(jax.tree.structure(low), jax.tree.structure(plain))
    self.assertEqual({x.dtype for x in jax.tree.leaves(
        optax.tree_utils.tree_get(low, 'nu'))}, {jnp.dtype(jnp.bfloat16)})

  def test_rounding_float32_params_is_refused(self):
    with self.assertRaisesRegex(ValueError, 'float32'):
      optimizer_lib.make_optimizer(optax.constant_schedule(1e-3),
                                   param_update='stochastic')


if __name__ == '__main__':
  absltest.main()
