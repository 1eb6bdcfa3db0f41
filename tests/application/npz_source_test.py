"""CIFAR-10 as a .npz: export from TFDS, load without TensorFlow, bad files."""

import os
import subprocess
import sys
import tempfile

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from haiku_mp import errors
from haiku_mp.vit.data import npz_source
from haiku_mp.vit.data import tfds_source
from tests import helpers


def _arrays(train=6, test=4, seed=0):
  rng = np.random.default_rng(seed)
  return dict(
      train_image=rng.integers(0, 256, (train, 32, 32, 3), dtype=np.uint8),
      train_label=rng.integers(0, 10, train).astype(np.int32),
      test_image=rng.integers(0, 256, (test, 32, 32, 3), dtype=np.uint8),
      test_label=rng.integers(0, 10, test).astype(np.int32))


class CifarArraysTest(parameterized.TestCase):

  def _tmp(self) -> str:
    return self.enter_context(tempfile.TemporaryDirectory())

  def test_round_trip(self):
    path = os.path.join(self._tmp(), 'c.npz')
    arrays = _arrays()
    npz_source.save(path, arrays)
    loaded = npz_source.load(path)
    for key in npz_source.KEYS:
      np.testing.assert_array_equal(loaded[key], arrays[key])
    self.assertEqual(os.listdir(os.path.dirname(path)), ['c.npz'])

  @parameterized.named_parameters(
      ('missing_key', lambda a: a.pop('test_label'), 'has no test_label'),
      ('float_images', lambda a: a.update(
          train_image=a['train_image'].astype(np.float32)),
       'train_image is float32'),
      ('label_count', lambda a: a.update(test_label=a['test_label'][:2]),
       r'test_label is int32\[2\]'),
      ('label_range', lambda a: a.update(train_label=a['train_label'] + 10),
       'train_label has values outside 0..9'))
  def test_bad_arrays_are_one_line_errors(self, spoil, message):
    path = os.path.join(self._tmp(), 'bad.npz')
    arrays = _arrays()
    spoil(arrays)
    np.savez(path, **arrays)
    with self.assertRaisesRegex(errors.DataError, message):
      npz_source.load(path)

  @parameterized.named_parameters(
      ('cut_short', lambda good: good[:len(good) // 2],
       r'cannot be read as .npz \(File is not a zip file\): it is cut short '
       'or damaged; write one with `python -m launch.data export`'),
      ('a_text_file', lambda good: b'not arrays',
       r"is not a .npz \(a zip of NumPy arrays\): it begins with b'not '; "
       'write one with'),
      ('an_npy_file', lambda good: b'\x93NUMPY' + good[:40],
       r"is not a .npz .*begins with b'\\x93NUM'"))
  def test_a_damaged_or_foreign_file_is_one_line_naming_the_setting(
      self, spoil, message):
    good = os.path.join(self._tmp(), 'good.npz')
    npz_source.save(good, _arrays())
    with open(good, 'rb') as f:
      data = spoil(f.read())
    bad = os.path.join(self._tmp(), 'bad.npz')
    with open(bad, 'wb') as f:
      f.write(data)
    for read in (npz_source.load, npz_source.split_sizes):
      with self.assertRaisesRegex(errors.DataError,
                                  f'^data.arrays_path={bad} {message}'):
        read(bad)

  def test_unreadable_or_unset_path(self):
    with self.assertRaisesRegex(errors.DataError, 'cannot be read as .npz'):
      npz_source.load(os.path.join(self._tmp(), 'no'))
    with self.assertRaisesRegex(errors.DataError, 'data.arrays_path is empty'):
      npz_source.load('')

  def test_export_from_tfds_keeps_its_order(self):
    tfds_source.tensorflow()  # TensorFlow before TFDS, as in training.
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    config = helpers.tiny_config()
    path = os.path.join(self._tmp(), 'c.npz')
    with tfds.testing.mock_data(num_examples=7):
      counts = npz_source.export_from_tfds(config.data, path, log=lambda _: 0)
      ds = tfds.builder('cifar10').as_dataset(split='test', shuffle_files=False)
      expected = np.stack([x['image'] for x in tfds.as_numpy(ds)])
    self.assertEqual(counts, dict(train=7, test=7))
    np.testing.assert_array_equal(npz_source.load(path)['test_image'],
                                  expected)

  def test_load_needs_no_tensorflow(self):
    path = os.path.join(self._tmp(), 'c.npz')
    npz_source.save(path, _arrays())
    code = ('import sys\n'
            'sys.modules["tensorflow"] = None\n'  # Importing it now fails.
            'from haiku_mp.vit.data import npz_source\n'
            f'print(len(npz_source.load({path!r})["train_label"]))\n'
            'assert "tensorflow_datasets" not in sys.modules\n')
    result = subprocess.run([sys.executable, '-c', code], cwd=helpers.ROOT,
                            capture_output=True, text=True)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout.strip(), '6')


  def test_export_command_without_out_is_a_one_line_error(self):
    result = helpers.run_module('launch.data', 'export')
    self.assertNotEqual(result.returncode, 0)
    self.assertNotIn('Traceback', result.stderr)
    self.assertEqual(result.stderr.strip().splitlines()[-1],
                     'error: --out is required: the .npz to write')


if __name__ == '__main__':
  absltest.main()
