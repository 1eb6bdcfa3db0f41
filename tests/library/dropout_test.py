"""Dropout with 16-bit draws: the rate, the expectation, the keys."""

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

from haiku_mp import errors
from haiku_mp.model import dropout

# The masks are threefry's integer bits compared with an integer threshold:
# the same on any CPU, and so is every share and mean below.
SIZE = 2**20


class DropoutTest(parameterized.TestCase):

  @parameterized.product(rate=(0.1, 0.5), dtype=('float32', 'bfloat16'))
  def test_rate_and_expectation(self, rate, dtype):
    x = jnp.full((SIZE,), 3.0, dtype)
    y = np.float32(jax.jit(lambda k, x: dropout.dropout(k, rate, x))(
        jax.random.key(0), x))
    chex.assert_type(y, np.float32)
    dropped = np.mean(y == 0)
    sigma = np.sqrt(rate * (1 - rate) / SIZE)
    self.assertAlmostEqual(dropped, rate, delta=5 * sigma)
    kept = y[y != 0]
    np.testing.assert_allclose(kept, np.float32(
        jnp.asarray(3.0 / (1 - round(rate * 2**16) / 2**16), dtype)))
    self.assertAlmostEqual(np.mean(y), 3.0, delta=0.02 if dtype == 'bfloat16'
                           else 5 * 3.0 * sigma / (1 - rate))

  def test_same_key_same_mask_other_key_other_mask(self):
    x = jnp.ones((64, 33))
    apply = jax.jit(lambda k: dropout.dropout(k, 0.3, x))
    np.testing.assert_array_equal(apply(jax.random.key(2)),
                                  apply(jax.random.key(2)))
    self.assertFalse(np.array_equal(apply(jax.random.key(2)),
                                    apply(jax.random.key(3))))

  def test_other_prng_implementations(self):
    key = jax.random.key(0, impl='rbg')
    y = np.asarray(dropout.dropout(key, 0.5, jnp.ones((SIZE // 16,))))
    self.assertAlmostEqual(np.mean(y == 0), 0.5, delta=0.01)

  def test_rate_zero_is_the_identity_and_out_of_range_an_error(self):
    x = jnp.arange(6.0)
    self.assertIs(dropout.dropout(jax.random.key(0), 0.0, x), x)
    with self.assertRaisesRegex(errors.ConfigError, r'must be in \[0, 1\)'):
      dropout.dropout(jax.random.key(0), 1.0, x)


if __name__ == '__main__':
  absltest.main()
