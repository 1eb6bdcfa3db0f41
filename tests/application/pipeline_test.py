"""Tests for the input pipeline: splits in memory, batches by index, padding."""

import functools
import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import itertools
import subprocess
import tempfile
import threading

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from haiku_mp.vit.data import npz_source
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.data import prefetch
from haiku_mp.vit.data import sampling
from haiku_mp.vit.data import tfds_source
from haiku_mp.vit.privacy import dp_sgd
from tests import helpers

ROOT = helpers.ROOT
SIZES = dict(train=50, test=20)


def _config(source='synthetic'):
  config = helpers.tiny_config()
  config.model.image_size = 32
  config.batch_size = 4
  config.eval_batch_size = 8
  config.data.source = source
  config.data.synthetic_train_examples = 30
  config.data.synthetic_eval_examples = 21
  return config


def _write_arrays(directory, train=SIZES['train'], test=SIZES['test']):
  """A small .npz whose image i of a split is filled with i (and label i%10)."""
  arrays = {}
  for split, num in (('train', train), ('test', test)):
    index = np.arange(num)
    arrays[f'{split}_image'] = np.broadcast_to(
        (index % 256).astype(np.uint8)[:, None, None, None],
        (num, 32, 32, 3)).copy()
    arrays[f'{split}_label'] = (index % 10).astype(np.int32)
  path = os.path.join(directory, 'cifar10.npz')
  npz_source.save(path, arrays)
  return path


def _ids(images):
  """The index each test image was filled with."""
  return images[:, 0, 0, 0].astype(int).tolist()



def _load(config):
  return pipeline.load(config.data, config.model, config.seed,
                       config.batch_size)

class SplitStringTest(parameterized.TestCase):

  @parameterized.parameters(
      ('train', 'train', 0, 50), ('train[:40]', 'train', 0, 40),
      ('train[40:]', 'train', 40, 50), ('test[-5:]', 'test', 15, 20),
      ('train[:90%]', 'train', 0, 45), ('train[90%:]', 'train', 45, 50),
      ('train[10:20]', 'train', 10, 20))
  def test_slices(self, spec, name, start, stop):
    self.assertEqual(pipeline.split_slice('train_split', spec, SIZES),
                     (name, range(start, stop)))

  @parameterized.parameters(
      ('train[:40', 'val_split', 'is not a split'),
      ('validation', 'val_split', "no split 'validation'"),
      ('train[60:]', 'test_split', 'selects no example'))
  def test_bad_splits_name_the_setting(self, spec, setting, message):
    with self.assertRaisesRegex(pipeline.DataError,
                                f'data.{setting}=.*{message}'):
      pipeline.split_slice(setting, spec, SIZES)


class BatchesTest(parameterized.TestCase):

  def test_synthetic_splits_are_uint8_of_the_configured_sizes(self):
    splits = _load(_config())
    self.assertEqual([len(s.labels) for s in splits], [30, 21, 21])
    for split in splits:
      self.assertEqual(split.images.dtype, np.uint8)
      self.assertEqual(split.labels.dtype, np.int32)
    self.assertFalse(np.array_equal(splits.val.images, splits.test.images))

  def test_train_batches_are_a_function_of_the_step(self):
    config = _config()
    split = _load(config).train
    shard = pipeline.Shard()
    batches_from = functools.partial(pipeline.train_batches, config.seed,
                                     config.batch_size, split, shard)
    from_zero = batches_from()
    batches = [next(from_zero) for _ in range(10)]
    resumed = next(batches_from(start_step=8))
    for key in ('image', 'label'):
      np.testing.assert_array_equal(resumed[key], batches[8][key])
    self.assertEqual(batches[0]['image'].dtype, np.uint8)
    self.assertEqual(batches[0]['image'].shape, (4, 32, 32, 3))
    self.assertFalse(np.array_equal(batches[0]['image'], batches[1]['image']))

  def test_process_shards_split_every_global_batch(self):
    config = _config()
    config.batch_size = 6
    split = _load(config).train
    batches = functools.partial(pipeline.train_batches, config.seed,
                                config.batch_size, split)
    whole = batches(pipeline.Shard())
    parts = [batches(pipeline.Shard(i, 3)) for i in range(3)]
    for _ in range(7):  # Past the end of the first epoch (5 steps).
      expected = next(whole)
      got = [next(p) for p in parts]
      np.testing.assert_array_equal(
          np.concatenate([g['image'] for g in got]), expected['image'])

  def test_private_batches_pad_with_zeros_split_and_resume(self):
    config = _config()
    split = _load(config).train
    settings = dp_sgd.DpSgd(1.0, 1.0, batch_size=4, num_examples=30,
                             delta=1e-5, padded_batch_size=12)
    batches = lambda shard, start=0: pipeline.private_train_batches(
        config.seed, split, shard, settings, total_steps=20, start_step=start)
    whole = list(batches(pipeline.Shard()))
    self.assertLen(whole, 20)
    indices = sampling.poisson_batches(config.seed, settings, 20)
    for batch, rows in zip(whole, indices):
      sampled = rows >= 0
      np.testing.assert_array_equal(batch['mask'], sampled.astype(np.float32))
      np.testing.assert_array_equal(batch['image'][sampled],
                                    split.images[rows[sampled]])
      np.testing.assert_array_equal(batch['label'][sampled],
                                    split.labels[rows[sampled]])
      # Padding is no example: zero pixels, label 0.
      self.assertFalse(batch['image'][~sampled].any())
      self.assertFalse(batch['label'][~sampled].any())
    self.assertGreater(sum(b['mask'].sum() for b in whole), 40)
    parts = [list(batches(pipeline.Shard(i, 2))) for i in range(2)]
    resumed = list(batches(pipeline.Shard(), start=17))
    for step, expected in enumerate(whole):
      for key in ('image', 'label', 'mask'):
        np.testing.assert_array_equal(
            np.concatenate([parts[0][step][key], parts[1][step][key]]),
            expected[key])
        if step >= 17:
          np.testing.assert_array_equal(resumed[step - 17][key],
                                        expected[key])

  def test_eval_covers_every_example_once_with_padding_masked(self):
    config = _config()
    split = _load(config).val
    batches = list(pipeline.eval_batches(config.eval_batch_size, split,
                                               pipeline.Shard()))
    self.assertLen(batches, 3)
    for batch in batches:
      self.assertEqual(batch['image'].shape, (8, 32, 32, 3))
    np.testing.assert_array_equal(batches[-1]['mask'], [1] * 5 + [0] * 3)
    np.testing.assert_array_equal(batches[-1]['image'][5:], 0)
    images = np.concatenate([b['image'][b['mask'] > 0] for b in batches])
    np.testing.assert_array_equal(images, split.images)  # In order, once.

  def test_every_process_gets_as_many_eval_batches(self):
    config = _config()
    config.data.synthetic_eval_examples = 17
    split = _load(config).val
    per_process = [list(pipeline.eval_batches(
        config.eval_batch_size, split, pipeline.Shard(i, 2))) for i in (0, 1)]
    self.assertEqual([len(b) for b in per_process], [3, 3])
    self.assertEqual([sum(x['mask'].sum() for x in b) for b in per_process],
                     [8, 9])
    self.assertEqual(per_process[0][-1]['mask'].sum(), 0)  # All padding.

  @parameterized.parameters((128, 1, 128), (128, 4, 32))
  def test_local_batch_size(self, global_size, processes, local):
    self.assertEqual(pipeline.local_batch_size(
        global_size, pipeline.Shard(0, processes)), local)

  @parameterized.parameters((0, 1), (-8, 1), (10, 4))
  def test_bad_batch_size(self, global_size, processes):
    with self.assertRaisesRegex(pipeline.DataError, 'batch_size'):
      pipeline.local_batch_size(global_size,
                                      pipeline.Shard(0, processes))


class DevicePrefetchTest(absltest.TestCase):

  def test_every_batch_in_order_placed_by_another_thread(self):
    placed_by = set()

    def place(batch):
      placed_by.add(threading.get_ident())
      return batch * 10

    with prefetch.DevicePrefetch(iter(range(7)), place, 2) as batches:
      self.assertEqual(list(batches), [i * 10 for i in range(7)])
      self.assertEqual(list(batches), [])  # Ended, and stays ended.
    self.assertLen(placed_by, 1)
    self.assertNotIn(threading.get_ident(), placed_by)

  def test_an_error_in_the_thread_is_raised_where_its_batch_was_due(self):
    def batches():
      yield 0
      yield 1
      raise pipeline.DataError('batch 2 is unreadable')

    with prefetch.DevicePrefetch(batches(), lambda b: b, 1) as fed:
      self.assertEqual([next(fed), next(fed)], [0, 1])
      with self.assertRaisesRegex(pipeline.DataError, 'batch 2'):
        next(fed)
      self.assertEqual(list(fed), [])

  def test_leaving_early_stops_a_thread_blocked_on_a_full_queue(self):
    made = []

    def endless():
      for i in itertools.count():
        made.append(i)
        yield i

    fed = prefetch.DevicePrefetch(endless(), lambda b: b, 2)
    with fed:
      self.assertEqual(next(fed), 0)
    self.assertFalse(any(t.name == 'haiku_mp-prefetch' and t.is_alive()
                         for t in threading.enumerate()))
    # It made no more than the queue's two, the one it was blocked putting
    # and the one taken, plus the one the emptied queue let it finish.
    self.assertLessEqual(len(made), 5)

  def test_the_trainers_batches_are_the_pipelines(self):
    config = _config()
    split = _load(config).train
    batches = functools.partial(pipeline.train_batches, config.seed,
                                config.batch_size, split, pipeline.Shard(), 3)
    direct = batches()
    with prefetch.DevicePrefetch(batches(), lambda b: b, 2) as fed:
      for _ in range(10):
        got, want = next(fed), next(direct)
        np.testing.assert_array_equal(got['image'], want['image'])
        np.testing.assert_array_equal(got['label'], want['label'])


class ArraysSourceTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.config = _config('arrays')
    self.config.data.arrays_path = _write_arrays(
        self.enter_context(tempfile.TemporaryDirectory()))
    self.config.data.train_split = 'train[:40]'
    self.config.data.val_split = 'train[40:]'

  def test_splits_are_the_slices_the_settings_name(self):
    splits = _load(self.config)
    self.assertEqual(_ids(splits.train.images), list(range(40)))
    self.assertEqual(_ids(splits.val.images), list(range(40, 50)))
    self.assertEqual(_ids(splits.test.images), list(range(20)))
    np.testing.assert_array_equal(splits.val.labels, np.arange(40, 50) % 10)
    self.assertEqual(pipeline.check_available(self.config.data), 40)

  def test_an_epoch_reads_every_training_example_once(self):
    split = _load(self.config).train
    batches = pipeline.train_batches(self.config.seed, self.config.batch_size,
                                     split, pipeline.Shard())
    seen = sum((_ids(next(batches)['image']) for _ in range(10)), [])
    self.assertCountEqual(seen, range(40))
    for image, label in zip(split.images, split.labels):
      self.assertEqual(image[0, 0, 0] % 10, label)

  @parameterized.parameters(('val_split', 'train[:40'), ('test_split', 'val'))
  def test_bad_split_is_caught_before_the_run(self, setting, spec):
    self.config.data[setting] = spec
    with self.assertRaisesRegex(pipeline.DataError, f'data.{setting}='):
      pipeline.check_available(self.config.data)

  def test_missing_file_names_the_setting(self):
    self.config.data.arrays_path = '/nonexistent/c.npz'
    with self.assertRaisesRegex(pipeline.DataError,
                                'data.arrays_path=/nonexistent/c.npz'):
      pipeline.check_available(self.config.data)

  def test_a_batch_larger_than_the_train_split_is_an_error(self):
    self.config.batch_size = 41
    with self.assertRaisesRegex(pipeline.DataError,
                                'batch_size=41 is larger than the 40'):
      _load(self.config)

  def test_arrays_and_synthetic_need_no_tensorflow(self):
    code = '\n'.join([
        'import sys',
        'sys.modules["tensorflow"] = None',
        'sys.modules["tensorflow_datasets"] = None',
        'from haiku_mp.vit.data import pipeline',
        'from tests import helpers',
        'c = helpers.tiny_config(); c.data.source = "arrays"',
        'c.batch_size = 4; c.model.image_size = 32',
        f'c.data.arrays_path = {self.config.data.arrays_path!r}',
        'c.data.train_split = "train[:40]"; c.data.val_split = "train[40:]"',
        'pipeline.check_available(c.data)',
        's = pipeline.load(c.data, c.model, c.seed, c.batch_size)',
        'b = next(pipeline.train_batches(c.seed, c.batch_size, s.train, '
        'pipeline.Shard()))',
        'assert b["image"].dtype == "uint8", b["image"].dtype',
        'c.data.source = "synthetic"',
        'pipeline.load(c.data, c.model, c.seed, c.batch_size)',
    ])
    subprocess.run([sys.executable, '-c', code], cwd=ROOT, check=True)


class TfdsSourceTest(parameterized.TestCase):

  def test_mock_tfds_splits_are_read_into_memory_in_order(self):
    tfds_source.tensorflow()  # TensorFlow before TFDS, as in training.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    config = _config('tfds')
    config.data.train_split = 'train[:8]'
    config.data.val_split = 'train[8:]'
    with tfds.testing.mock_data(num_examples=12):
      splits = _load(config)
      ds = tfds.builder('cifar10').as_dataset(split='train[8:]',
                                              shuffle_files=False)
      expected = np.stack([x['image'] for x in tfds.as_numpy(ds)])
    # (mock_data gives every split string all of its examples.)
    self.assertEqual(splits.train.images.dtype, np.uint8)
    self.assertEqual(splits.train.labels.dtype, np.int32)
    np.testing.assert_array_equal(splits.val.images, expected)

  def test_missing_data_is_a_clear_error(self):
    config = _config('tfds')
    config.data.download = False
    config.data.data_dir = self.enter_context(tempfile.TemporaryDirectory())
    with self.assertRaisesRegex(pipeline.DataError,
                                'data.data_dir.*not prepared'):
      _load(config)


class RealDataTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    helpers.skip_without_real_data(self)
    self.config = _config('tfds')
    self.config.data.download = False
    self.config.data.data_dir = helpers.real_data_dir()

  def test_split_sizes(self):
    data = self.config.data
    builder = tfds_source.builder(data)
    sizes = [builder.info.splits[s].num_examples
             for s in (data.train_split, data.val_split, data.test_split)]
    self.assertEqual(sizes, [45000, 5000, 10000])
    self.assertEqual(pipeline.check_available(data), 45000)

  def test_real_images_normalize_to_zero_mean(self):
    from haiku_mp.vit.data import augment  # pylint: disable=g-import-not-at-top
    builder = tfds_source.builder(self.config.data)
    images, labels = tfds_source.read_split(builder, self.config.data.val_split)
    self.assertEqual(images.shape, (5000, 32, 32, 3))
    self.assertEqual(set(np.unique(labels)), set(range(10)))
    normalized = np.asarray(augment.normalize(images, self.config.data))
    np.testing.assert_allclose(normalized.mean(axis=(0, 1, 2)), 0.0, atol=0.1)
    # CIFAR's configured 'std' is ~0.25 of the real one (~1.2 after dividing).
    np.testing.assert_allclose(normalized.std(axis=(0, 1, 2)), 1.2, atol=0.15)


if __name__ == '__main__':
  absltest.main()
