"""The library's random draws: 16-bit draws at four per threefry block, the
uniform floats made of them, and one draw for a whole tree."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.model import random_bits
from tests import helpers

SIZE = 2**20


class RandomBitsTest(absltest.TestCase):

  def test_draws_are_uniform_16_bit_integers(self):
    draws = np.asarray(random_bits.draws16(jax.random.key(1), (SIZE,)))
    self.assertEqual(draws.min(), 0)
    self.assertEqual(draws.max(), 2**16 - 1)
    counts = np.bincount(draws >> 12, minlength=16)  # 16 equal bins.
    expected = SIZE / 16
    chi2 = np.sum((counts - expected)**2 / expected)
    self.assertLess(chi2, 50.0)  # 15 degrees of freedom: p < 1e-5.

  def test_one_threefry_block_per_four_draws(self):
    eqns = helpers.eqns_of(lambda k: random_bits.draws16(k, (1000, 6)),
                           jax.random.key(0), primitives=('threefry2x32',))
    self.assertLen(eqns, 1)
    self.assertEqual(eqns[0].invars[2].aval.shape, (1500,))

  def test_uniform_is_the_middle_of_each_interval(self):
    u = random_bits.to_uniform(jnp.arange(4, dtype=jnp.uint32), 2)
    chex.assert_type(u, jnp.float32)
    np.testing.assert_array_equal(u, [0.125, 0.375, 0.625, 0.875])
    bits = random_bits.MAX_UNIFORM_BITS
    top = random_bits.to_uniform(jnp.uint32(2**bits - 1), bits)
    self.assertEqual(float(top), 1.0 - 2.0**-(bits + 1))
    with self.assertRaisesRegex(ValueError, 'at most 23'):
      random_bits.to_uniform(jnp.uint32(0), 24)

  def test_a_tree_draws_once_and_each_leaf_takes_its_slice(self):
    leaves = [jnp.zeros((3, 2)), jnp.zeros((5,))]
    key = jax.random.key(4)
    sliced = random_bits.tree_bits(key, leaves)
    chex.assert_shape(sliced, [(3, 2), (5,)])
    whole = jax.random.bits(key, (11,), jnp.uint32)
    np.testing.assert_array_equal(
        np.concatenate([np.ravel(b) for b in sliced]), whole)
    eqns = helpers.eqns_of(lambda k: random_bits.tree_bits(k, leaves), key,
                           primitives=('random_bits',))
    self.assertLen(eqns, 1)


if __name__ == '__main__':
  absltest.main()
