"""Mixup and CutMix: the images and the soft labels agree, per example."""

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
import numpy as np

from haiku_mp.vit.data import mixing
from tests import helpers

BATCH = 64
CLASSES = 10


# One jitted function: a setting's program is compiled once for every test
# that draws with it.
_MIX = jax.jit(mixing.mix, static_argnums=(3, 4, 5, 6))


@functools.cache
def _mixed(mixup_alpha, cutmix_alpha, seed=0, probability=1.0):
  """(images, partners, mixed images, targets, own label's weight), as
  read-only host arrays (shared by the tests that ask for the same)."""
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.normal(size=(BATCH, 8, 8, 3)), jnp.float32)
  # Partners (2k, 2k + 1) always differ in label, so a weight is readable.
  labels = jnp.asarray(np.arange(BATCH) % CLASSES)
  keys = jax.random.split(jax.random.key(seed), BATCH)
  mixed, targets = _MIX(keys, images, labels, CLASSES, mixup_alpha,
                        cutmix_alpha, probability)
  partner = np.asarray(mixing.partners(images))
  own = np.asarray(targets)[np.arange(BATCH), np.asarray(labels)]
  arrays = (np.array(images), partner, np.array(mixed), np.array(targets), own)
  for array in arrays:
    array.flags.writeable = False
  return arrays


@helpers.long_running  # Its five compiled mixes: over 10 s cold.
class MixTest(parameterized.TestCase):

  def test_partners_are_neighbours(self):
    np.testing.assert_array_equal(mixing.partners(jnp.arange(6)),
                                  [1, 0, 3, 2, 5, 4])

  @parameterized.parameters((0.8, 0.0), (0.0, 1.0), (0.8, 1.0))
  def test_soft_labels_are_the_two_labels_weights(self, mixup, cutmix):
    _, _, _, targets, own = _mixed(mixup, cutmix)
    chex.assert_type(targets, jnp.float32)
    np.testing.assert_allclose(targets.sum(1), 1.0, rtol=1e-6)
    labels = np.arange(BATCH) % CLASSES
    partner_labels = labels.reshape(-1, 2)[:, ::-1].reshape(-1)
    np.testing.assert_allclose(
        targets[np.arange(BATCH), partner_labels], 1 - own, rtol=1e-5,
        atol=1e-6)
    self.assertEqual(np.count_nonzero(targets > 0, axis=1).max(), 2)

  def test_mixup_blends_pixels_as_the_labels(self):
    images, partner, mixed, _, own = _mixed(0.8, 0.0)
    expected = (own[:, None, None, None] * images +
                (1 - own[:, None, None, None]) * partner)
    np.testing.assert_allclose(mixed, expected, atol=1e-5)
    # Beta(0.8, 0.8): weights all over [0, 1], mean 1/2, each example its own.
    self.assertAlmostEqual(own.mean(), 0.5, delta=0.12)
    self.assertGreater(len(set(np.round(own, 6))), BATCH - 2)

  def test_cutmix_pastes_a_box_as_large_as_the_labels_say(self):
    images, partner, mixed, _, own = _mixed(0.0, 1.0)
    from_self = np.all(mixed == images, axis=-1)
    from_partner = np.all(mixed == partner, axis=-1)
    self.assertTrue(np.all(from_self | from_partner))
    np.testing.assert_allclose(from_self.mean(axis=(1, 2)), own, atol=1e-6)
    for pasted in ~from_self:  # One rectangle (or nothing) per image.
      rows, cols = np.nonzero(pasted)
      if rows.size:
        self.assertEqual(rows.size, (np.ptp(rows) + 1) * (np.ptp(cols) + 1))

  def test_both_on_split_the_examples_between_them(self):
    images, partner, mixed, _, own = _mixed(0.8, 1.0, seed=1)
    whole_pixels = np.all((mixed == images) | (mixed == partner),
                          axis=(1, 2, 3))
    blended = ~whole_pixels & (own > 1e-3) & (own < 1 - 1e-3)
    self.assertBetween(blended.mean(), 0.25, 0.75)
    self.assertBetween(whole_pixels.mean(), 0.25, 0.75)


  def test_a_mixing_probability_keeps_the_other_examples_whole(self):
    mixup, cutmix = 0.8, 1.0  # Both methods, so both are held to it.
    images, _, mixed, targets, own = _mixed(mixup, cutmix, seed=2,
                                            probability=0.5)
    whole = np.all(mixed == images, axis=(1, 2, 3)) & (own == 1.0)
    # An example left whole keeps its one-hot label.
    np.testing.assert_array_equal(
        targets[whole], np.eye(CLASSES, dtype=np.float32)[
            (np.arange(BATCH) % CLASSES)[whole]])
    self.assertBetween(whole.mean(), 0.3, 0.7)
    _, _, always, _, _ = _mixed(mixup, cutmix, seed=2)
    self.assertLess(np.mean(np.all(always == images, axis=(1, 2, 3))), 0.1)
    # The mixed ones are mixed as with probability 1: same partner, ratio, box
    # (to float32 rounding: the draw changes how XLA fuses the blend).
    np.testing.assert_allclose(mixed[~whole], always[~whole], rtol=1e-6,
                               atol=1e-6)

  def test_an_inactive_batch_is_left_whole(self):
    # The batch, keys and settings of `_mixed(0.8, 1.0)`: its draw is what no
    # switch gives (one program for both).
    images, _, plain_mixed, plain_targets, _ = _mixed(0.8, 1.0)
    labels = jnp.arange(BATCH) % CLASSES
    keys = jax.random.split(jax.random.key(0), BATCH)
    on = _MIX(keys, images, labels, CLASSES, 0.8, 1.0, 1.0, jnp.asarray(True))
    off = _MIX(keys, images, labels, CLASSES, 0.8, 1.0, 1.0,
               jnp.asarray(False))
    np.testing.assert_array_equal(off[0], images)
    np.testing.assert_array_equal(off[1], jax.nn.one_hot(labels, CLASSES))
    # Active: what no switch gives, draw for draw (to float32 rounding: the
    # switch changes how XLA fuses the blend).
    np.testing.assert_allclose(on[0], plain_mixed, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(on[1], plain_targets, rtol=1e-6, atol=1e-6)
    self.assertGreater(np.count_nonzero(np.asarray(on[1]) % 1), 0)


if __name__ == '__main__':
  absltest.main()
