"""Tests for the CIFAR-10 input pipeline (mock data, and the real data if present)."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import subprocess
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from haiku_mp import input_pipeline
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(download: bool = True):
  """A tiny config; `download` is a no-op under `tfds.testing.mock_data`."""
  config = helpers.tiny_config()
  config.model.image_size = 32
  config.batch_size = 4
  config.eval_batch_size = 8
  config.data.download = download
  return config


def _raw_images(split, num):
  """The mock data's uint8 images, in order (mock splits are all the same)."""
  ds = tfds.builder('cifar10').as_dataset(split=split, shuffle_files=False)
  return np.stack([x['image'] for x in tfds.as_numpy(ds.take(num))])


class AugmentTest(parameterized.TestCase):

  def test_crop_window_within_area_and_aspect_ranges(self):
    data = _config().data
    areas, aspects, begins = [], [], set()
    for i in range(64):
      begin, size = input_pipeline.crop_window(
          tf.constant([32, 32, 3]), tf.constant([7, i], tf.int64), data)
      height, width = int(size[0]), int(size[1])
      areas.append(height * width / 32**2)
      aspects.append(width / height)
      begins.add((int(begin[0]), int(begin[1])))
    # Integer pixel boxes: the ranges hold up to one pixel of rounding.
    self.assertGreaterEqual(min(areas), 0.9 - 2 / 32)
    self.assertLessEqual(max(areas), 1.0)
    self.assertGreaterEqual(min(aspects), 0.9 - 1 / 30)
    self.assertLessEqual(max(aspects), 1.1 + 1 / 30)
    self.assertGreater(len(begins), 1)  # The crop moves.
    self.assertLess(min(areas), 1.0)  # And it does crop.

  def test_flip_is_deterministic_and_mirrors(self):
    data = _config().data
    data.crop_area = (1.0, 1.0)
    data.crop_aspect_ratio = (1.0, 1.0)
    image = tf.random.stateless_uniform([32, 32, 3], seed=[1, 2])
    flips = []
    for i in range(16):
      seed = tf.constant([3, i], tf.int64)
      out = input_pipeline.augment(image, seed, data).numpy()
      np.testing.assert_array_equal(
          out, input_pipeline.augment(image, seed, data).numpy())
      if np.allclose(out, image.numpy(), atol=1e-6):
        flips.append(False)
      else:
        np.testing.assert_allclose(out, image.numpy()[:, ::-1], atol=1e-6)
        flips.append(True)
    self.assertIn(True, flips)
    self.assertIn(False, flips)

  def test_augmented_image_stays_close_to_the_original(self):
    data = _config().data
    # A smooth image: a crop of >= 90% of it, resized back, moves little.
    yy, xx = np.meshgrid(np.linspace(0, 1, 32), np.linspace(0, 1, 32),
                         indexing='ij')
    image = tf.constant(np.stack([yy, yy, yy], -1), tf.float32)
    for i in range(8):
      out = input_pipeline.augment(image, tf.constant([5, i], tf.int64), data)
      self.assertLess(float(tf.reduce_max(tf.abs(out - image))), 0.1)


class MockDataTest(parameterized.TestCase):

  def test_train_batches_normalized_and_unaugmented_when_off(self):
    config = _config()
    config.data.augment = False
    with tfds.testing.mock_data(num_examples=12):
      raw = _raw_images('train', 12)
      batches = input_pipeline.train_batches(config, input_pipeline.Shard())
      batch = next(batches)
    self.assertEqual(batch['image'].shape, (4, 32, 32, 3))
    self.assertEqual(batch['image'].dtype, np.float32)
    self.assertEqual(batch['label'].dtype, np.int32)
    expected = (raw / 255.0 - np.array(config.data.mean)) / np.array(
        config.data.std)
    # Shuffled: every image of the batch is one of the raw images.
    for image in batch['image']:
      distances = np.abs(expected - image).max(axis=(1, 2, 3))
      self.assertLess(distances.min(), 1e-5)

  def test_train_batches_are_a_function_of_the_step(self):
    config = _config()
    with tfds.testing.mock_data(num_examples=12):
      from_zero = input_pipeline.train_batches(config, input_pipeline.Shard())
      batches = [next(from_zero) for _ in range(5)]
      from_three = input_pipeline.train_batches(config, input_pipeline.Shard(),
                                                start_step=3)
      resumed = next(from_three)
    np.testing.assert_array_equal(resumed['image'], batches[3]['image'])
    np.testing.assert_array_equal(resumed['label'], batches[3]['label'])
    self.assertFalse(np.array_equal(batches[0]['image'], batches[3]['image']))

  def test_eval_covers_every_example_once_with_padding_masked(self):
    config = _config()
    with tfds.testing.mock_data(num_examples=21):
      raw = _raw_images('test', 21)
      batches = list(input_pipeline.eval_batches(config, 'test',
                                                 input_pipeline.Shard()))
    self.assertLen(batches, 3)
    for batch in batches:
      self.assertEqual(batch['image'].shape, (8, 32, 32, 3))
    np.testing.assert_array_equal(batches[-1]['mask'], [1] * 5 + [0] * 3)
    np.testing.assert_array_equal(batches[-1]['image'][5:], 0)
    images = np.concatenate([b['image'][b['mask'] > 0] for b in batches])
    expected = (raw / 255.0 - np.array(config.data.mean)) / np.array(
        config.data.std)
    np.testing.assert_allclose(images, expected, atol=1e-5)  # In order, once.

  def test_no_autotune_model_thread_to_wait_for_at_exit(self):
    # Destroying an iterator waits for tf.data's autotune model thread, which
    # sleeps up to a minute between optimizations: a finished run then took
    # 20-40 s to exit. Without autotuning there is no such thread.
    config = _config()
    with tfds.testing.mock_data(num_examples=12):
      datasets = (input_pipeline.train_dataset(config, input_pipeline.Shard()),
                  input_pipeline.eval_dataset(config, 'test',
                                               input_pipeline.Shard()))
      for ds in datasets:
        self.assertFalse(ds.options().autotune.enabled)

  def test_missing_data_is_a_clear_error(self):
    config = _config(download=False)
    config.data.data_dir = self.enter_context(tempfile.TemporaryDirectory())
    with self.assertRaisesRegex(input_pipeline.DataError,
                                'data.data_dir.*not prepared'):
      next(input_pipeline.train_batches(config, input_pipeline.Shard()))


class ShardAndSyntheticTest(parameterized.TestCase):

  @parameterized.parameters((128, 1, 128), (128, 4, 32))
  def test_local_batch_size(self, global_size, processes, local):
    self.assertEqual(input_pipeline.local_batch_size(
        global_size, input_pipeline.Shard(0, processes)), local)

  @parameterized.parameters((0, 1), (-8, 1), (10, 4))
  def test_bad_batch_size(self, global_size, processes):
    with self.assertRaisesRegex(input_pipeline.DataError, 'batch_size'):
      input_pipeline.local_batch_size(global_size,
                                      input_pipeline.Shard(0, processes))

  def test_every_process_gets_as_many_eval_batches(self):
    config = _config()
    config.data.source = 'synthetic'
    config.data.synthetic_eval_examples = 17
    config.eval_batch_size = 8  # 4 per process of 2: 8 and 9 examples.
    per_process = [list(input_pipeline.eval_batches(
        config, 'val', input_pipeline.Shard(i, 2))) for i in (0, 1)]
    self.assertEqual([len(b) for b in per_process], [3, 3])
    self.assertEqual([sum(x['mask'].sum() for x in b) for b in per_process],
                     [8, 9])
    self.assertEqual(per_process[0][-1]['mask'].sum(), 0)  # All padding.

  def test_synthetic_needs_no_tensorflow_and_shards_differ(self):
    code = '\n'.join([
        'import sys',
        'from haiku_mp import input_pipeline as ip',
        'from tests import helpers',
        'c = helpers.tiny_config(); c.data.source = "synthetic"',
        'c.data.synthetic_eval_examples = 10; c.eval_batch_size = 4',
        'c.batch_size = 8',
        'a = next(ip.train_batches(c, ip.Shard(0, 2)))',
        'b = next(ip.train_batches(c, ip.Shard(1, 2)))',
        'assert a["image"].shape == (4, 8, 8, 3), a["image"].shape',
        'assert not (a["image"] == b["image"]).all()',
        'ev = [list(ip.eval_batches(c, "val", ip.Shard(i, 2))) for i in (0, 1)]',
        'assert [sum(x["mask"].sum() for x in e) for e in ev] == [5, 5]',
        'assert "tensorflow" not in sys.modules, "tensorflow was imported"',
    ])
    subprocess.run([sys.executable, '-c', code], cwd=ROOT, check=True)


class RealDataTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    helpers.skip_without_real_data(self)
    self.config = _config(download=False)
    self.config.data.data_dir = helpers.real_data_dir()

  def test_split_sizes(self):
    builder = tfds.builder('cifar10', data_dir=self.config.data.data_dir)
    data = self.config.data
    sizes = [builder.info.splits[s].num_examples
             for s in (data.train_split, data.val_split, data.test_split)]
    self.assertEqual(sizes, [45000, 5000, 10000])
    self.assertEqual(input_pipeline.num_train_examples(data), 45000)

  def test_process_shards_are_disjoint_and_cover_the_split(self):
    builder = tfds.builder('cifar10', data_dir=self.config.data.data_dir)
    ids = []
    for index in range(3):
      split = input_pipeline._process_split(  # pylint: disable=protected-access
          self.config.data.val_split, input_pipeline.Shard(index, 3))
      ds = builder.as_dataset(split=split, shuffle_files=False)
      ids.append({x['id'] for x in tfds.as_numpy(ds.map(
          lambda x: {'id': x['id']}))})
    self.assertEqual(sum(len(s) for s in ids), 5000)
    self.assertLen(set.union(*ids), 5000)
    train = builder.as_dataset(split=self.config.data.train_split,
                               shuffle_files=False)
    train_ids = {x['id'] for x in tfds.as_numpy(train.map(
        lambda x: {'id': x['id']}))}
    self.assertEmpty(train_ids & set.union(*ids))  # Val is held out.

  def test_real_batches_are_normalized(self):
    self.config.batch_size = 512
    batch = next(input_pipeline.train_batches(self.config,
                                              input_pipeline.Shard()))
    mean = batch['image'].mean(axis=(0, 1, 2))
    std = batch['image'].std(axis=(0, 1, 2))
    np.testing.assert_allclose(mean, 0.0, atol=0.1)
    np.testing.assert_allclose(std, 1.2, atol=0.15)  # CIFAR's 'std' is ~0.25.
    self.assertEqual(set(np.unique(batch['label'])), set(range(10)))


if __name__ == '__main__':
  absltest.main()
