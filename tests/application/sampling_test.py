"""Train batches as a function of (seed, step)."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
import numpy as np

from haiku_mp.vit.data import sampling

N, BATCH = 103, 10  # 10 steps per epoch; 3 examples left out of each.


class SamplingTest(absltest.TestCase):

  def test_an_epoch_reads_distinct_examples_and_the_next_another_order(self):
    epoch = lambda e: np.concatenate([
        sampling.batch_indices(0, s, BATCH, N) for s in range(10 * e, 10 * e + 10)])
    first, second = epoch(0), epoch(1)
    self.assertLen(set(first), 100)
    self.assertLen(set(second), 100)
    self.assertTrue(np.all((first >= 0) & (first < N)))
    self.assertFalse(np.array_equal(first, second))

  def test_a_batch_is_a_function_of_seed_and_step(self):
    np.testing.assert_array_equal(sampling.batch_indices(3, 17, BATCH, N),
                                  sampling.batch_indices(3, 17, BATCH, N))
    self.assertFalse(np.array_equal(sampling.batch_indices(3, 17, BATCH, N),
                                    sampling.batch_indices(4, 17, BATCH, N)))

  def test_shards_split_the_global_batch(self):
    whole = sampling.batch_indices(1, 5, BATCH, N)
    parts = [sampling.batch_indices(1, 5, BATCH, N, i, 2) for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)

  def test_batch_larger_than_the_data(self):
    with self.assertRaisesRegex(ValueError, 'batch_size=200 is larger'):
      sampling.batch_indices(0, 0, 200, N)


if __name__ == '__main__':
  absltest.main()
