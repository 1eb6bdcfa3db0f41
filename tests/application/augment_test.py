"""Augmentation on the device: crop windows, resize, flips, normalization."""

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

from configs import base
from configs import vit_recipe
from haiku_mp.vit.data import augment
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

DATA = base.get_config().data
SIZE = 32
# Two programs of different shapes (a device's part, the whole batch) give the
# same draws and the same arithmetic, but the one may fuse a multiply-add the
# other rounds twice: equal to float32 rounding (a different draw is off by
# far more).
_SAME_DRAWS = dict(rtol=1e-6, atol=1e-6)


# Every train augmentation on (the recipe's, configs/vit_recipe.py, spelled
# out so that tuning the recipe leaves these tests as they are), mixing for
# the whole run.
EVERY_AUGMENTATION = dict(erasing_probability=0.25, mixup_alpha=0.8,
                          cutmix_alpha=1.0, mixing_off_share=0.0)


def _recipe_data(**settings):
  """Every train augmentation (`EVERY_AUGMENTATION` on the recipe's),
  changed by `settings`."""
  data = vit_recipe.get_config().data
  data.update(EVERY_AUGMENTATION)
  data.update(settings)
  return data


def _pixels(normalized, data):
  """Normalized images back to pixel values."""
  return np.asarray(normalized) * np.float32(data.std) * 255 + np.float32(
      data.mean) * 255


def _images(batch, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, 256, (batch, SIZE, SIZE, 3)), jnp.uint8)


def _keys(seed, batch):
  return jax.random.split(jax.random.key(seed), batch)


def _jitted_augment(data):
  """`augment` under `data`, jitted: one program, not one per operation."""
  return jax.jit(lambda keys, images: augment.augment(keys, images, data))


# The seeds' augmentation of (keys, images), jitted once for the tests that
# run it (one program per batch shape; every caller passes uncommitted
# arrays, so none compiles it again for committed ones).
_augment_seeds = _jitted_augment(DATA)
# One image's window resized, jitted: one program serves every window (its
# corner and size are arguments), not one program per operation.
_crop_and_resize = jax.jit(augment.crop_and_resize)


def _windows(batch=2000, key=0, **ranges):
  data = dict(crop_area=DATA.crop_area, crop_aspect_ratio=DATA.crop_aspect_ratio,
              crop_max_attempts=DATA.crop_max_attempts)
  data.update(ranges)
  windows = augment.crop_windows(
      jax.random.split(jax.random.key(key), batch), SIZE, SIZE,
      data['crop_area'],
      data['crop_aspect_ratio'], data['crop_max_attempts'])
  return [np.asarray(x) for x in windows]


class CropWindowsTest(absltest.TestCase):

  def test_windows_stay_in_range_and_cover_it(self):
    top, left, height, width = _windows()
    area = height * width / SIZE**2
    aspect = width / height
    self.assertTrue(np.all((area >= 0.9) & (area <= 1.0)))
    self.assertTrue(np.all((aspect >= 0.9) & (aspect <= 1.1)))
    self.assertTrue(np.all((top >= 0) & (top + height <= SIZE)))
    self.assertTrue(np.all((left >= 0) & (left + width <= SIZE)))
    # Covered: the smallest areas, both sides of square, every offset.
    self.assertLess(area.min(), 0.92)
    self.assertEqual(area.max(), 1.0)
    self.assertLess(aspect.min(), 0.95)
    self.assertGreater(aspect.max(), 1.05)
    self.assertEqual(set(top[height == 30]), {0, 1, 2})
    self.assertEqual(set(left[width == 29]), {0, 1, 2, 3})

  def test_impossible_ranges_fall_back_to_the_whole_image(self):
    top, left, height, width = _windows(
        batch=50, crop_area=(0.1, 0.1), crop_aspect_ratio=(9.0, 9.0))
    self.assertTrue(np.all((height == SIZE) & (width == SIZE)))
    self.assertTrue(np.all((top == 0) & (left == 0)))


@helpers.long_running
class AugmentTest(parameterized.TestCase):

  def test_the_whole_window_is_the_image(self):
    image = _images(1)[0].astype(jnp.float32)
    whole = augment.Windows(*(jnp.int32(v) for v in (0, 0, SIZE, SIZE)))
    np.testing.assert_allclose(_crop_and_resize(image, whole), image,
                               atol=1e-4)

  def test_resize_matches_tensorflow_bilinear(self):
    try:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
    except ImportError:
      self.skipTest('TensorFlow is not installed: nothing to compare with')
    image = np.asarray(_images(1)[0], np.float32)
    for top, left, height, width in ((1, 2, 30, 29), (0, 3, 29, 29),
                                     (2, 0, 30, 32)):
      window = augment.Windows(*(jnp.int32(v)
                                 for v in (top, left, height, width)))
      ours = _crop_and_resize(jnp.asarray(image), window)
      theirs = tf.image.resize(
          image[top:top + height, left:left + width], (SIZE, SIZE),
          method='bilinear').numpy()
      np.testing.assert_allclose(ours, theirs, atol=1e-3)

  def test_flips_about_half_the_images(self):
    data = base.get_config().data
    data.crop_area, data.crop_aspect_ratio = (1.0, 1.0), (1.0, 1.0)
    images = _images(1000)
    out = np.asarray(_jitted_augment(data)(_keys(3, 1000), images))
    plain = np.asarray(augment.normalize(images, data))
    same = np.all(np.isclose(out, plain, atol=1e-5), axis=(1, 2, 3))
    flipped = np.all(np.isclose(out, plain[:, :, ::-1], atol=1e-5),
                     axis=(1, 2, 3))
    self.assertTrue(np.all(same ^ flipped))
    self.assertAlmostEqual(flipped.mean(), 0.5, delta=5 * 0.5 / np.sqrt(1000))

  def test_eval_images_are_only_normalized(self):
    images = _images(4)
    expected = ((np.float32(images) / 255.0 - np.float32(DATA.mean))
                / np.float32(DATA.std))
    got = augment.normalize(images, DATA)
    chex.assert_type(got, jnp.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

  def test_same_key_same_batch_in_and_out_of_jit(self):
    images = _images(8)
    a = augment.augment(_keys(5, 8), images, DATA)
    # Op by op and jitted: two programs, equal to float32 rounding.
    np.testing.assert_allclose(a, _augment_seeds(_keys(5, 8), images),
                               **_SAME_DRAWS)
    self.assertFalse(np.allclose(a, _augment_seeds(_keys(6, 8), images)))
    chex.assert_shape(a, images.shape)
    chex.assert_type(a, jnp.float32)

  def test_an_image_depends_on_its_own_key_alone(self):
    images = _images(8)
    keys = _keys(2, 8)
    whole = _augment_seeds(keys, images)
    # The batch shuffled: each image still follows its key (one compile).
    order = np.array([3, 6, 0, 7, 2, 5, 1, 4])
    np.testing.assert_array_equal(_augment_seeds(keys[order], images[order]),
                                  whole[order])


@helpers.long_running
class RecipeAugmentTest(parameterized.TestCase):

  def test_pad_and_crop_is_a_window_of_the_padded_image(self):
    data = _recipe_data(policy='none', flip=False, erasing_probability=0.0)
    count = 800  # 81 offsets: each drawn (missing one: 1 in 300 seeds).
    images = jnp.tile(_images(1), (count, 1, 1, 1))
    out = np.round(_pixels(_jitted_augment(data)(_keys(4, count), images),
                           data))
    pad = data.crop_padding
    padded = np.pad(np.asarray(images[0], np.float32),
                    ((pad, pad), (pad, pad), (0, 0)))
    # found[i, o]: image i is the padded image's window at offset o.
    found = np.stack([
        np.all(out == padded[dy:dy + SIZE, dx:dx + SIZE], axis=(1, 2, 3))
        for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)], axis=1)
    np.testing.assert_array_equal(found.sum(axis=1), 1)  # One window each.
    self.assertTrue(found.any(axis=0).all())  # Every offset drawn.

  def test_erasing_fills_one_box_per_image_at_its_probability(self):
    count = 400
    plain = _recipe_data(policy='none', flip=False, crop='none',
                         erasing_probability=0.0)
    erased = _recipe_data(policy='none', flip=False, crop='none',
                          erasing_probability=0.5)
    images = _images(count)
    keys = _keys(5, count)
    before = np.asarray(_jitted_augment(plain)(keys, images))
    after = np.asarray(_jitted_augment(erased)(keys, images))
    changed = np.any(before != after, axis=-1)
    hit = changed.any(axis=(1, 2))
    self.assertAlmostEqual(hit.mean(), 0.5, delta=5 * 0.5 / np.sqrt(count))
    for image, box in zip(after[hit], changed[hit]):
      rows, cols = np.nonzero(box)
      top, left = rows.min(), cols.min()
      height, width = np.ptp(rows) + 1, np.ptp(cols) + 1
      self.assertBetween(height * width / SIZE**2, 0.02 - 0.01, 1 / 3 + 0.01)
      inside = image[top:top + height, left:left + width].reshape(-1, 3)
      np.testing.assert_array_equal(inside, np.broadcast_to(inside[0],
                                                            inside.shape))

  @parameterized.parameters('randaugment', 'autoaugment')
  def test_a_recipe_image_depends_on_its_own_key_alone(self, policy):
    data = _recipe_data(policy=policy)
    run = jax.jit(lambda keys, images: augment.augment(keys, images, data))
    images = _images(8)
    keys = _keys(2, 8)
    whole = run(keys, images)
    # The batch shuffled: each image still follows its key (one compile).
    order = np.array([5, 2, 7, 0, 1, 6, 3, 4])
    np.testing.assert_array_equal(run(keys[order], images[order]),
                                  whole[order])
    self.assertFalse(np.array_equal(whole, run(_keys(3, 8), images)))

  def test_the_seeds_draws_are_unchanged_by_the_recipe_keys(self):
    """The seeds' crop and flip draw from the keys they always did: turning
    a recipe op on changes nothing else."""
    images = _images(8)
    keys = _keys(6, 8)
    data = base.get_config().data
    data.erasing_probability = 1.0
    seeds = np.asarray(_augment_seeds(keys, images))
    erased = np.asarray(_jitted_augment(data)(keys, images))
    kept = np.all(erased == seeds, axis=-1)
    self.assertTrue(np.all(kept.mean(axis=(1, 2)) >= 2 / 3 - 0.01))
    self.assertFalse(kept.all())


def _two_devices(test_case):
  """Two of the devices: a batch split in two shows what a split in eight
  does (each device's part is keyed as on one device), in smaller programs."""
  if jax.local_device_count() < 2:
    test_case.skipTest('needs several devices (run under the suite\'s '
                       'XLA_FLAGS)')
  return jax.local_devices()[:2]


# Steps of a 400-step run on either side of where its mixing stops (step
# 300): mixed, then whole examples.
_MIXED_STEP, _WHOLE_STEP = 299, 300


@helpers.long_running
class ModelInputsTest(parameterized.TestCase):
  """The experiment's train inputs, with mixing (mixup and CutMix) on the
  seeds' crop and flip until the last quarter of the run. Their programs on
  one device, under pmap and sharded over devices each compile once for
  the class: the step is an argument, so one program gives the mixed and
  the whole batches."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    config = helpers.tiny_config()
    config.num_train_steps = 400
    config.data.update(mixup_alpha=0.8, cutmix_alpha=1.0,
                       mixing_off_share=0.25)
    cls.exp = experiment.build_without_data(settings_lib.parse(config))
    # (key, batch, axis_name, step) -> the model's inputs.
    cls.inputs = staticmethod(jax.jit(cls.exp.train_inputs))
    # Two pairs per device when split over two.
    cls.batch = dict(image=_images(8), label=jnp.arange(8) % 10)
    cls.key = jax.random.key(9)

  def _on_one_device(self, step):
    # Uncommitted arrays, as every caller's: one program for the class.
    return self.inputs(self.key, self.batch, None, jnp.int32(step))

  def _assert_same_draws(self, got, step):
    want = self._on_one_device(step)
    for name in ('image', 'targets'):  # The same draws; see _SAME_DRAWS.
      np.testing.assert_allclose(got[name].reshape(want[name].shape),
                                 want[name], err_msg=f'{name}, step {step}',
                                 **_SAME_DRAWS)
    # Soft targets at the mixed step, one-hot ones at the whole step.
    self.assertEqual(bool(np.count_nonzero(want['targets'] % 1)),
                     step == _MIXED_STEP)

  def test_train_inputs_augment_uint8_and_keep_labels(self):
    batch = dict(image=_images(8), label=jnp.arange(8))
    out = augment.train_inputs(DATA, jax.random.key(1), batch)
    np.testing.assert_array_equal(
        out['image'], augment.augment(jax.random.split(jax.random.key(1), 8),
                                      batch['image'], DATA))
    np.testing.assert_array_equal(out['label'], batch['label'])

  def test_without_augmentation_train_images_are_only_normalized(self):
    data = base.get_config().data
    data.augment = False
    batch = dict(image=_images(4), label=jnp.arange(4))
    out = augment.train_inputs(data, jax.random.key(1), batch)
    np.testing.assert_array_equal(out['image'],
                                  augment.normalize(batch['image'], data))

  @parameterized.parameters('train', 'eval')
  def test_float_images_are_taken_as_model_inputs(self, kind):
    batch = dict(image=jnp.ones((2, SIZE, SIZE, 3), jnp.float32),
                 label=jnp.zeros(2, jnp.int32))
    out = (augment.train_inputs(DATA, jax.random.key(0), batch)
           if kind == 'train' else augment.eval_inputs(DATA, batch))
    self.assertIs(out, batch)

  def test_every_replica_augments_and_mixes_its_part_as_one_device_would(
      self):
    """The seeds' crop and flip of each example (whole examples) and the
    mixing of its pair (mixed): each replica's part as on one device."""
    devices = _two_devices(self)
    n = len(devices)
    split = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]),
                         self.batch)
    per_replica = jax.pmap(
        lambda b, step: self.exp.train_inputs(self.key, b, 'b', step),
        axis_name='b', in_axes=(0, None), devices=devices)
    # A device's part and the whole batch: two programs, equal to float32
    # rounding (_SAME_DRAWS), not bit for bit.
    for step in (_MIXED_STEP, _WHOLE_STEP):
      self._assert_same_draws(per_replica(split, jnp.int32(step)), step)

  def test_a_batch_sharded_over_devices_is_augmented_as_on_one(self):
    """pjit's layout: the batch axis sharded, one program for all devices."""
    devices = _two_devices(self)
    mesh = jax.sharding.Mesh(np.array(devices), ('batch',))
    spread = jax.device_put(self.batch, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec('batch')))
    for step in (_MIXED_STEP, _WHOLE_STEP):
      sharded = self.inputs(self.key, spread, None, jnp.int32(step))
      self.assertLen(sharded['image'].sharding.device_set, len(devices))
      self._assert_same_draws(sharded, step)

  def test_mixing_stops_where_the_experiments_first_lines_say(self):
    self.assertIn('Mixing: off from step 300 of 400',
                  '\n'.join(self.exp.describe()))
    self.assertEqual(augment.mixing_off_step(
        _recipe_data(mixing_off_share=0.25), 100), 75)
    self.assertIsNone(augment.mixing_off_step(
        _recipe_data(mixing_off_share=0.0), 100))
    mixed = self._on_one_device(_MIXED_STEP)
    whole = self._on_one_device(_WHOLE_STEP)
    self.assertGreater(np.count_nonzero(mixed['targets'] % 1), 0)
    np.testing.assert_array_equal(whole['targets'],
                                  jax.nn.one_hot(self.batch['label'], 10))
    # Whole examples: the images as a run without mixing draws them (here
    # op by op; see _SAME_DRAWS).
    np.testing.assert_allclose(
        whole['image'],
        augment.train_inputs(DATA, self.key, self.batch)['image'],
        **_SAME_DRAWS)

  def test_an_odd_batch_cannot_be_mixed(self):
    batch = dict(image=_images(3), label=jnp.arange(3))
    with self.assertRaisesRegex(ValueError, 'even number per device'):
      augment.train_inputs(_recipe_data(), jax.random.key(0), batch,
                           num_classes=10)


if __name__ == '__main__':
  absltest.main()
