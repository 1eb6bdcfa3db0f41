"""Blocks along an axis (haiku_mp/model/blocks.py): in place or moved last,
zero-padded, and undone exactly."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import numpy as np

from haiku_mp.model import blocks


def _x(shape):
  return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1


class BlocksTest(parameterized.TestCase):

  @parameterized.parameters((0, 4), (1, 4), (-1, 3), (2, 5))
  def test_split_holds_each_block_on_the_next_axis_and_merges_back(
      self, axis, block):
    x = _x((6, 8, 10))
    split = blocks.split(x, axis, block)
    size = x.shape[axis]
    axis %= x.ndim
    self.assertEqual(split.shape[axis:axis + 2],
                     (-(-size // block), block))
    # Block j holds values j*block.. of the axis, then zeros.
    padded = np.concatenate(
        [np.moveaxis(x, axis, 0),
         np.zeros((-size % block, *np.moveaxis(x, axis, 0).shape[1:]))])
    want = padded.reshape(-1, block, *padded.shape[1:])
    np.testing.assert_array_equal(
        np.moveaxis(np.asarray(split), (axis, axis + 1), (0, 1)), want)
    chex.assert_trees_all_equal(blocks.merge(split, axis, size), x)

  @parameterized.parameters((0, 4), (-1, 3))
  def test_along_last_is_split_with_the_blocks_last(self, axis, block):
    x = _x((6, 10))
    last = blocks.along_last(x, axis, block)
    split = blocks.split(x, axis, block)
    a = axis % x.ndim
    np.testing.assert_array_equal(
        last, np.moveaxis(np.asarray(split), (a, a + 1), (-2, -1)))
    chex.assert_trees_all_equal(
        blocks.from_last(last, axis, x.shape[axis]), x)

  def test_tiles(self):
    x = _x((5, 7))
    tiled = blocks.tiles(x, 4)
    self.assertEqual(tiled.shape, (2, 4, 2, 4))
    np.testing.assert_array_equal(tiled[1, 0, 1, :3], x[4, 4:7])
    np.testing.assert_array_equal(tiled[1, 1:, :, :], 0)  # Padding.
    chex.assert_trees_all_equal(blocks.untiles(tiled, x.shape), x)


if __name__ == '__main__':
  absltest.main()
