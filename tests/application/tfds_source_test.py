"""A TFDS download that fails leaves one line and the data dir as it was.

With no network, TFDS's "Downloading and preparing ..." line and some twenty
lines of empty progress bars used to come before the one-line error, and the
data dir kept `cifar10/`, `downloads/` and a `downloads/cifar10/*.tmp.*`
folder. A local port that refuses connections stands in for the network that
is not there; a local server for one that answers (tests/fake_cifar10.py).
"""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import glob
import hashlib
import tempfile

from absl.testing import absltest

from tests import fake_cifar10
from tests import helpers


def _export(url, *flags, home=None):
  """`python -m launch.data export` of the CIFAR-10 at `url`."""
  env = {'TFDS_DATA_DIR': None}
  if home:
    env['HOME'] = home
  return fake_cifar10.run(url, 'launch.data', 'export', *flags, env=env)


def _tree(directory):
  """Every path under `directory`, with a hash of each file's bytes."""
  tree = {}
  for path in sorted(glob.glob(f'{directory}/**', recursive=True,
                               include_hidden=True)):
    digest = None
    if os.path.isfile(path):
      with open(path, 'rb') as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    tree[os.path.relpath(path, directory)] = digest
  return tree


def _fill(directory):
  """A data dir in use: another dataset, a download and an extraction."""
  for path in ('mnist/3.0.1/dataset_info.json', 'downloads/other.tar.gz',
               'downloads/extracted/other/a.bin', 'downloads/cifar10/old.txt',
               'cifar10/notes/keep.txt'):
    os.makedirs(os.path.dirname(os.path.join(directory, path)), exist_ok=True)
    with open(os.path.join(directory, path), 'w') as f:
      f.write(path)


@helpers.long_running
class FailedDownloadTest(absltest.TestCase):

  def _assert_only_the_error(self, result, url, why):
    """One line: `why` the download was tried, then that it failed."""
    self.assertEqual(result.returncode, 2, result.stderr[-3000:])
    self.assertEqual(result.stdout, '')
    lines = result.stderr.splitlines()
    self.assertLen(lines, 1, result.stderr[-3000:])
    self.assertStartsWith(
        lines[0], f'error: {why}, and the download of cifar10 failed: cannot '
        f'reach {url} (')

  def test_unreachable_export_to_a_data_dir_in_use(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    data_dir = f'{tmp}/data/tfds'
    _fill(data_dir)
    before = _tree(tmp)
    url = self.enter_context(fake_cifar10.refusing_url())
    result = _export(url, f'--out={tmp}/c.npz',
                     f'--config.data.data_dir={data_dir}')
    self._assert_only_the_error(
        result, url, f'data.data_dir={data_dir} holds no prepared cifar10')
    self.assertEqual(_tree(tmp), before)

  def test_unreachable_export_to_the_default_data_dir_not_there_yet(self):
    home = self.enter_context(tempfile.TemporaryDirectory())
    url = self.enter_context(fake_cifar10.refusing_url())
    result = _export(url, f'--out={home}/c.npz', home=home)
    self._assert_only_the_error(
        result, url, 'data.data_dir is empty: cifar10 is not prepared in the '
        'TFDS default data dir (TFDS_DATA_DIR)')
    # The folders the attempt made (~/tensorflow_datasets/{cifar10,downloads})
    # are gone with it.
    self.assertFalse(os.path.exists(f'{home}/tensorflow_datasets'))
    self.assertFalse(os.path.exists(f'{home}/c.npz'))

  def test_unreachable_train(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    url = self.enter_context(fake_cifar10.refusing_url())
    result = fake_cifar10.train(url, f'{tmp}/run',
                                f'--config.data.data_dir={tmp}/tfds')
    self.assertEqual(result.returncode, 2, result.stderr[-3000:])
    self.assertNotIn('Downloading and preparing', result.stdout)
    lines = result.stderr.splitlines()
    # Nothing but the run's own INFO lines (its config) before the error.
    self.assertEmpty([l for l in lines[:-1] if not l.startswith('I')],
                     result.stderr[-3000:])
    # "cannot reach" is said only by the download's fail-fast, at urllib3's
    # first retry (TFDS alone would retry for over three minutes). The dir
    # given is named, and that it did not exist: a mistyped path is not
    # taken for a network to fix.
    self.assertStartsWith(
        lines[-1], f'error: data.data_dir={tmp}/tfds does not exist, and the '
        f'download of cifar10 failed: cannot reach {url} (')
    self.assertIn('--config.data.data_dir', lines[-1])
    self.assertEqual(os.listdir(tmp), [])  # No workdir, no data dir.

  def test_prepare_failing_after_the_download(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    data_dir = f'{tmp}/tfds'
    _fill(data_dir)
    before = _tree(tmp)
    with fake_cifar10.serve(b'not a tar.gz') as (url, requests):
      result = _export(url, f'--out={tmp}/c.npz',
                       f'--config.data.data_dir={data_dir}')
    self.assertIn('GET /cifar-10-binary.tar.gz', requests)
    self.assertEqual(result.returncode, 2, result.stderr[-3000:])
    self.assertStartsWith(result.stderr.splitlines()[-1],
                          f'error: data.data_dir={data_dir} holds no prepared '
                          'cifar10, and cifar10 could not be downloaded and '
                          'prepared')
    self.assertEqual(_tree(tmp), before)


if __name__ == '__main__':
  absltest.main()
