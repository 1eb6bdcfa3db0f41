"""numerics: simulated half formats equal real casts; statistics equal a
direct NumPy computation."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from haiku_mp.advisor import numerics
from tests import helpers

# Compiled whole: run op by op, its many small operations are a program
# each, several times the CPU time.
_tensor_stats = jax.jit(numerics.tensor_stats)


def _values() -> np.ndarray:
  """Magnitudes from 2^-40 to 2^20 (float16's subnormals, its overflow and
  the ties at both ends included), both signs, zeros, inf and NaN."""
  rng = np.random.default_rng(0)
  magnitudes = np.exp2(rng.uniform(-40, 20, 20000))
  edges = np.array([2.0**-25, 2.0**-24, 1.5 * 2.0**-24, 2.0**-14 * (1 - 2**-12),
                    65504.0, 65519.0, 65520.0, 3.0])
  values = np.concatenate([magnitudes, -magnitudes, edges, -edges,
                           [0.0, -0.0, np.inf, -np.inf, np.nan]])
  return values.astype(np.float32)


class RoundingTest(parameterized.TestCase):

  @parameterized.parameters(('float16', np.float16),
                            ('bfloat16', ml_dtypes.bfloat16))
  def test_rounding_is_a_real_cast_bit_for_bit(self, name, dtype):
    x = _values()
    finite = np.isfinite(x)
    with np.errstate(over='ignore'):
      want = x[finite].astype(dtype).astype(np.float32)
    got = np.asarray(jax.jit(numerics.round_to, static_argnums=1)(
        jnp.asarray(x[finite]), numerics.FORMATS[name]))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))

  def test_reduce_precision_alone_flushes_float16_subnormals(self):
    """Why `round_to` has its own subnormal path."""
    x = jnp.float32(3 * 2.0**-24)
    self.assertEqual(float(jax.lax.reduce_precision(x, 5, 10)), 0.0)
    self.assertEqual(float(numerics.round_to(x, numerics.FLOAT16)),
                     3 * 2.0**-24)


class TensorStatsTest(parameterized.TestCase):

  @parameterized.parameters(1.0, 2.0**10, 3.0)
  def test_stats_equal_a_direct_computation(self, scale):
    x = _values()
    got = numerics.as_dict(np.asarray(_tensor_stats(
        jnp.asarray(x), scale)))
    want = helpers.numpy_stats(x, scale)
    self.assertEqual((want['zeros'], want['nonfinite']), (2, 3))
    self.assertGreater(want['f16_flush'], 0)
    self.assertGreater(want['f16_subnormal'], 0)
    self.assertGreater(want['f16_overflow'], 0)
    helpers.assert_stats_equal(self, got, want)

  def test_norm_share_below_is_an_upper_bound_within_four_times(self):
    x = np.float32(np.exp2(np.random.default_rng(1).uniform(-30, 0, 5000)))
    stats = np.asarray(_tensor_stats(jnp.asarray(x)))
    for exponent in (-25, -14, -5):
      small = x[x < 2.0**exponent].astype(np.float64)
      true = np.sum(small**2) / np.sum(x.astype(np.float64)**2)
      bound = numerics.norm_share_below(stats, exponent)
      self.assertGreaterEqual(bound, true * (1 - 1e-6))
      self.assertLessEqual(bound, 4 * true * (1 + 1e-6))
    self.assertEqual(numerics.norm_share_below(stats, 1), 1.0)

  def test_merge_adds_counts_and_keeps_the_larger_amax(self):
    a = np.asarray(_tensor_stats(jnp.asarray([1.0, 4.0])))
    b = np.asarray(_tensor_stats(jnp.asarray([-8.0, 0.0, 2.0])))
    both = numerics.as_dict(numerics.merge(a, b))
    direct = numerics.as_dict(np.asarray(_tensor_stats(
        jnp.asarray([1.0, 4.0, -8.0, 0.0, 2.0]))))
    for field in ('count', 'zeros', 'amax', 'sum_squares', 'histogram'):
      self.assertEqual(both[field], direct[field], field)


if __name__ == '__main__':
  absltest.main()
