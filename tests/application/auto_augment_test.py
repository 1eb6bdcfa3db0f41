"""RandAugment and AutoAugment: levels mapped to each op's parameter, draws
per image, and the CIFAR-10 policy's table."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.vit.data import auto_augment
from haiku_mp.vit.data import image_ops
from haiku_mp.vit.settings import dataset as data_settings
from tests.application import image_ops_test

OPS = data_settings.AUGMENT_OPS


def _images(count):
  """Images whose channels span less than [0, 255] (so autocontrast is not
  the identity)."""
  return jnp.asarray(np.stack([image_ops_test.sample_image(seed, 30, 200)
                               for seed in range(count)]), jnp.float32)


# One compiled program for every op, level and sign (all traced values).
_apply_op = jax.jit(auto_augment.apply_op)


def _op(image, name, level, sign=1.0):
  return _apply_op(image, jnp.int32(OPS.index(name)), jnp.float32(level),
                   jnp.float32(sign))


class LevelTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('rotate', 'rotate', 5, -1, lambda x: image_ops.rotate(x, -15.0)),
      ('shear_x', 'shear_x', 10, 1, lambda x: image_ops.shear_x(x, 0.3)),
      ('shear_y', 'shear_y', 5, -1, lambda x: image_ops.shear_y(x, -0.15)),
      # 10 pixels of 32 at the top level, rounded to whole pixels.
      ('translate_x', 'translate_x', 10, 1,
       lambda x: image_ops.translate_x(x, 10)),
      ('translate_y', 'translate_y', 5, -1,
       lambda x: image_ops.translate_y(x, -5)),
      ('brightness', 'brightness', 10, -1,
       lambda x: image_ops.brightness(x, 0.1)),
      ('color', 'color', 5, 1, lambda x: image_ops.color(x, 1.45)),
      ('contrast', 'contrast', 2, -1, lambda x: image_ops.contrast(x, 0.82)),
      ('sharpness', 'sharpness', 10, 1,
       lambda x: image_ops.sharpness(x, 1.9)),
      ('posterize', 'posterize', 10, 1, lambda x: image_ops.posterize(x, 4)),
      ('solarize', 'solarize', 5, 1, lambda x: image_ops.solarize(x, 128)),
      ('autocontrast', 'autocontrast', 7, 1, image_ops.autocontrast),
      ('equalize', 'equalize', 7, -1, image_ops.equalize),
      ('invert', 'invert', 0, 1, image_ops.invert),
      ('identity', 'identity', 9, -1, lambda x: x))
  def test_level_and_sign_give_the_op_its_parameter(self, name, level, sign,
                                                     expected):
    image = _images(1)[0]
    error = np.abs(_op(image, name, level, sign) - expected(image))
    # Two programs: one may fuse a multiply-add that the other rounds twice,
    # a level apart on a pixel that lands on a rounding boundary.
    self.assertLessEqual(error.max(), 1)
    self.assertLess(np.mean(error > 1e-4), 0.02)

  @parameterized.parameters('rotate', 'shear_x', 'translate_y', 'brightness',
                            'color', 'contrast', 'sharpness', 'posterize',
                            'solarize')
  def test_level_zero_leaves_the_image(self, name):
    image = _images(1)[0]
    np.testing.assert_array_equal(_op(image, name, 0.0), image)


def _candidates(image, ops, level):
  """What each of `ops` at `level` makes of `image`, both directions."""
  return {(name, sign): np.asarray(_op(image, name, level, sign))
          for name in ops for sign in (1.0, -1.0)}


def _same_image(got, want):
  """Whether two programs' images agree as LevelTest's do: one level apart
  at most, on under 2% of the pixels (a rounding boundary that one program
  fuses a multiply-add across); the images these tests tell apart differ
  on a quarter of the pixels or more."""
  error = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
  return error.max() <= 1 and np.mean(error > 1e-4) < 0.02


def _matching_ops(out, candidates):
  return {name for (name, _), want in candidates.items()
          if _same_image(out, want)}


class RandAugmentTest(absltest.TestCase):

  def test_each_image_takes_one_listed_op_at_the_magnitude(self):
    count, magnitude = 300, 7.0
    images = jnp.tile(_images(1), (count, 1, 1, 1))
    keys = jax.random.split(jax.random.key(0), count)
    out = np.asarray(jax.jit(jax.vmap(
        lambda k, x: auto_augment.randaugment(k, x, 1, magnitude)))(
            keys, images))
    candidates = _candidates(images[0], OPS, magnitude)
    drawn = [_matching_ops(o, candidates) for o in out]
    self.assertTrue(all(drawn), 'an output no op at the magnitude makes')
    # Each op's share: about 1/14 (identity included, never invert).
    unique = [next(iter(d)) for d in drawn if len(d) == 1]
    counts = {name: unique.count(name) for name in OPS}
    self.assertEqual(counts['invert'], 0)
    self.assertTrue(all(counts[name] > 5 for name in
                        data_settings.RANDAUGMENT_OPS), counts)
    self.assertLess(max(counts.values()), 3 * count / 14)

  def test_an_image_is_a_function_of_its_key(self):
    images = _images(4)
    keys = jax.random.split(jax.random.key(1), 4)
    run = jax.jit(jax.vmap(
        lambda k, x: auto_augment.randaugment(k, x, 2, 9.0)))
    whole = run(keys, images)
    order = np.array([2, 0, 3, 1])  # Shuffled, each image follows its key.
    np.testing.assert_array_equal(run(keys[order], images[order]),
                                  whole[order])
    other = run(jax.random.split(jax.random.key(2), 4), images)
    self.assertFalse(np.array_equal(whole, other))


class AutoAugmentTest(absltest.TestCase):

  def test_the_cifar10_policy_table(self):
    policy = auto_augment.CIFAR10_POLICY
    self.assertLen(policy, 25)
    for sub in policy:
      for name, probability, level in sub:
        self.assertIn(name, OPS)
        self.assertBetween(probability, 0.0, 1.0)
        self.assertBetween(level, 0, 9)

  def test_a_step_is_applied_at_its_probability(self):
    count = 400
    policy = (auto_augment.SubPolicy(('rotate', 1.0, 5),
                                     ('solarize', 0.5, 5)),)
    image = _images(1)[0]
    keys = jax.random.split(jax.random.key(3), count)
    out = np.asarray(jax.jit(jax.vmap(
        lambda k: auto_augment.autoaugment(k, image, policy)))(keys))
    rotated = {s: np.asarray(_op(image, 'rotate', 5, s)) for s in (1.0, -1.0)}
    solarized = {s: np.asarray(_op(jnp.asarray(r), 'solarize', 5))
                 for s, r in rotated.items()}
    plain = [any(_same_image(o, r) for r in rotated.values()) for o in out]
    both = [any(_same_image(o, r) for r in solarized.values()) for o in out]
    self.assertTrue(all(p != b for p, b in zip(plain, both)))
    self.assertAlmostEqual(np.mean(both), 0.5, delta=5 * 0.5 / np.sqrt(count))
    # Both rotation directions drawn.
    self.assertTrue(all(any(_same_image(o, r) for o in out)
                        for r in rotated.values()))


if __name__ == '__main__':
  absltest.main()
