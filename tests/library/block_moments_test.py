"""Adam's moments in 8 bits (haiku_mp/update/block_moments.py): the E4M3
grid and its stochastic rounding, the blocks and their scales, and Adam on
them against optax's float32 Adam."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from haiku_mp.update import block_moments
from haiku_mp.update import optimizer as optimizer_lib
from tests import helpers

# The functions under test, each compiled whole: run op by op, their many
# small operations are a program each, several times the CPU time.
_stochastic_round_e4m3 = jax.jit(block_moments.stochastic_round_e4m3)
_store = jax.jit(block_moments.store, static_argnums=2,
                 static_argnames='square_root')
_load = jax.jit(block_moments.load, static_argnums=1, static_argnames='square')

# Every finite non-negative E4M3 value, from ml_dtypes' own format: the
# reference the grid arithmetic is checked against.
_GRID = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(
    ml_dtypes.float8_e4m3fn).astype(np.float32)))
_GRID = _GRID[np.isfinite(_GRID)]


def _neighbours(x):
  """The grid points at or below and at or above |x| (numpy reference)."""
  magnitude = np.abs(x)
  below = _GRID[np.searchsorted(_GRID, magnitude, side='right') - 1]
  above = _GRID[np.minimum(np.searchsorted(_GRID, magnitude, side='left'),
                           len(_GRID) - 1)]
  return np.sign(x) * below, np.sign(x) * above


class StochasticRoundingTest(absltest.TestCase):

  def test_each_value_goes_to_one_of_its_two_grid_neighbours(self):
    x = np.concatenate([
        np.random.default_rng(0).uniform(-448, 448, 3000),
        np.random.default_rng(1).uniform(-0.02, 0.02, 3000),  # Subnormals.
        _GRID[:40], -_GRID[-5:], [0.0, 448.0]]).astype(np.float32)
    below, above = _neighbours(x)
    for seed in range(3):
      u = jax.random.uniform(jax.random.key(seed), x.shape)
      got = np.asarray(_stochastic_round_e4m3(jnp.asarray(x), u))
      self.assertTrue(np.all((got == below) | (got == above)))
      # On the grid: E4M3 holds each result exactly.
      np.testing.assert_array_equal(
          got.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), got)
    np.testing.assert_array_equal(below[np.isin(np.abs(x), _GRID)],
                                  x[np.isin(np.abs(x), _GRID)])

  def test_it_is_unbiased(self):
    # Values between grid points, in the normal and the subnormal range.
    x = jnp.asarray([0.3, -1.1, 5.7, 300.0, 0.0037, -0.0011], jnp.float32)
    draws = 20000
    u = jax.random.uniform(jax.random.key(0), (draws, x.size))
    mean = jax.jit(jax.vmap(lambda v: block_moments.stochastic_round_e4m3(
        x, v)))(u).mean(0)
    below, above = _neighbours(np.asarray(x))
    spacing = np.abs(above - below)
    # The mean of draws is within 4 standard errors of x (a draw's spread
    # is at most half the spacing).
    np.testing.assert_array_less(np.abs(np.asarray(mean) - np.asarray(x)),
                                 4 * 0.5 * spacing / np.sqrt(draws))
    # Rounding to nearest would be off by up to half a spacing: these are
    # not grid points.
    self.assertTrue(np.all(spacing > 0))


class BlocksTest(absltest.TestCase):

  def test_a_block_with_one_outlier_keeps_its_other_values(self):
    x = np.full((1, 256), 0.01, np.float32)
    x[0, 7] = 100.0
    u = jnp.full(x.shape, 0.5)
    codes, scales = block_moments.quantize(jnp.asarray(x), u, 256)
    self.assertEqual(codes.dtype, jnp.float8_e4m3fn)
    self.assertEqual(scales.shape, (1, 1))
    np.testing.assert_allclose(float(scales[0, 0]), 100.0 / 448)
    back = np.asarray(block_moments.dequantize(codes, scales, 256))
    self.assertEqual(back[0, 7], 100.0)  # The absmax codes exactly.
    # 0.01 is 4.5e-5 of the absmax: a subnormal code, not zero (linear
    # int8 codes would flush it).
    small = np.delete(back[0], 7)
    self.assertTrue(np.all(small > 0))
    np.testing.assert_allclose(small, 0.01, rtol=0.25)

  def test_zero_blocks_and_a_padded_last_block(self):
    x = np.zeros((3, 300), np.float32)
    x[1, 280:] = np.linspace(-2, 3, 20)  # Only the second block of row 1.
    codes, scales = block_moments.quantize(
        jnp.asarray(x), jnp.full(x.shape, 0.5), 256)
    self.assertEqual(codes.shape, (3, 300))
    self.assertEqual(scales.shape, (3, 2))
    # A block of zeros codes zeros (its scale is a harmless 1).
    np.testing.assert_array_equal(np.asarray(scales)[[0, 0, 1, 2, 2],
                                                     [0, 1, 0, 0, 1]], 1.0)
    # The padded block's scale is from its own 44 values.
    np.testing.assert_allclose(float(scales[1, 1]), 3.0 / 448)
    back = np.asarray(block_moments.dequantize(codes, scales, 256))
    np.testing.assert_array_equal(back[x == 0], 0.0)
    np.testing.assert_allclose(back[1, 280:], x[1, 280:], rtol=1 / 16,
                               atol=1e-6)

  def test_a_square_root_never_codes_a_nonzero_value_as_zero(self):
    v = np.full((1, 256), 1e-30, np.float32)  # Far below the block's range.
    v[0, 0] = 1.0
    stored = _store(jax.random.key(0), {'w': jnp.asarray(v)}, 256,
                    square_root=True)
    back = np.asarray(_load(stored, 256, square=True)['w'])
    self.assertTrue(np.all(back > 0))
    self.assertEqual(back[0, 0], 1.0)
    plain = _store(jax.random.key(0), {'w': jnp.asarray(v)}, 256)
    self.assertTrue(np.all(np.asarray(plain.codes['w'])[0, 1:] == 0))

  def test_scalars_and_vectors(self):
    tree = {'s': jnp.asarray(0.7), 'b': jnp.linspace(-1, 1, 10)}
    zeros = block_moments.zeros_like(tree, 256)
    chex.assert_trees_all_equal_shapes(zeros.codes, tree)
    self.assertEqual(zeros.scales['s'].shape, (1,))
    back = _load(_store(jax.random.key(1), tree, 256), 256)
    chex.assert_trees_all_close(back, tree, rtol=1 / 8)


@helpers.long_running
class EightBitAdamTest(parameterized.TestCase):

  def test_updates_follow_float32_adam(self):
    """200 steps of noisy gradients whose size differs 100-fold across a
    block and shrinks 4x over the run: the 8-bit moments' updates are
    float32 Adam's within the noise of 3 mantissa bits (18% of the updates'
    norm here)."""
    rng = np.random.default_rng(0)
    shape = (64, 384)
    params = {'w': jnp.zeros(shape)}
    scales = np.exp(rng.normal(0, 1, shape[1])).astype(np.float32)
    reference = optax.scale_by_adam()
    eight = optimizer_lib.scale_by_adam(mu_dtype='float8_blocks',
                                        nu_dtype='float8_blocks')
    ref_state, state = reference.init(params), eight.init(params)
    ref_update = jax.jit(reference.update)
    self.assertEqual(state.mu.codes['w'].dtype, jnp.float8_e4m3fn)
    self.assertEqual(state.nu.scales['w'].shape, (64, 2))
    update = jax.jit(eight.update)
    errors = []
    for step in range(200):
      size = 1.0 - 0.75 * step / 200
      grads = {'w': jnp.asarray(size * scales * (
          0.3 + rng.normal(0, 1, shape)).astype(np.float32))}
      ref_updates, ref_state = ref_update(grads, ref_state)
      updates, state = update(grads, state, key=jax.random.key(step))
      ref, got = np.asarray(ref_updates['w']), np.asarray(updates['w'])
      errors.append(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    self.assertLess(max(errors[-50:]), 0.25)

  def test_the_second_moment_decays_when_gradients_shrink(self):
    """At its steady state, then gradients halved but for each block's
    largest: float32's second moment falls by 0.1% a step, below half of
    E4M3's spacing, and the block's scale stays, so rounded to nearest it
    would stay put; rounded stochastically it follows."""
    shape = (8, 256)
    grads = jax.random.normal(jax.random.key(0), shape).at[:, 0].set(10.0)
    halved = jnp.full(shape, 0.5).at[:, 0].set(1.0)
    eight = optimizer_lib.scale_by_adam(mu_dtype='float8_blocks',
                                        nu_dtype='float8_blocks')

    @functools.partial(jax.jit, static_argnums=(0, 4))
    def run(update, state, size, first, steps):
      """`steps` steps from step `first` on, in one program."""
      def step(i, state):
        return update({'w': size * grads}, state, key=jax.random.key(i))[1]
      return jax.lax.fori_loop(first, first + steps, step, state)

    params = {'w': jnp.zeros(shape)}
    reference = optax.scale_by_adam()
    ref_update = lambda g, s, key: reference.update(g, s)
    update = eight.update
    whole = jnp.ones(shape)
    ref_state = run(ref_update, reference.init(params), whole, 0, 3000)
    state = run(update, eight.init(params), whole, 0, 3000)
    peak = np.asarray(ref_state.nu['w'])[:, 1:].mean()
    ref_state = run(ref_update, ref_state, halved, 3000, 500)
    state = run(update, state, halved, 3000, 500)
    want = np.asarray(ref_state.nu['w'])[:, 1:].mean()
    self.assertLess(want, 0.75 * peak)
    got = np.asarray(_load(state.nu, 256, square=True)['w'])
    np.testing.assert_allclose(got[:, 1:].mean(), want, rtol=0.03)

  def test_the_key_is_required(self):
    eight = optimizer_lib.scale_by_adam(mu_dtype='float8_blocks')
    params = {'w': jnp.zeros((4, 4))}
    with self.assertRaisesRegex(ValueError, 'pass the step\'s key'):
      eight.update(params, eight.init(params))
    with self.assertRaisesRegex(ValueError, "moment dtype 'int8'"):
      optimizer_lib.scale_by_adam(nu_dtype='int8')


if __name__ == '__main__':
  absltest.main()
