"""The README's first-run command on a machine with network and no data yet.

A local server stands in for CIFAR-10's host: `launch.train` downloads,
prepares into an empty data dir (TFDS's own download and preparation; only the
URL is changed, see tests/fake_cifar10.py) and trains.
"""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import glob
import json
import tempfile

from absl.testing import absltest

from tests import fake_cifar10
from tests import helpers


@helpers.long_running
class DownloadTest(absltest.TestCase):

  def test_downloads_prepares_and_trains(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    data_dir, workdir = f'{tmp}/tensorflow_datasets', f'{tmp}/run'
    data = fake_cifar10.archive(train_per_file=50, num_test=50)
    with fake_cifar10.serve(data) as (url, requests):
      result = fake_cifar10.train(
          url, workdir,
          f'--config.data.data_dir={data_dir}')
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertIn('GET /cifar-10-binary.tar.gz', requests)
    # Once the server answered, TFDS's own progress reaches the console.
    self.assertIn('Downloading and preparing dataset', result.stdout)
    self.assertIn('Dl Completed', result.stderr)
    self.assertTrue(os.path.exists(
        f'{data_dir}/cifar10/3.0.2/dataset_info.json'))
    self.assertEmpty([p for p in glob.glob(f'{data_dir}/**', recursive=True)
                      if '.tmp.' in p or 'incomplete' in p.lower()])
    with open(f'{workdir}/metrics.jsonl') as f:
      events = [json.loads(line) for line in f]
    self.assertEqual([e['step'] for e in events if e['split'] == 'train'],
                     [1, 2, 3])
    self.assertEqual([(e['split'], e['num_examples']) for e in events
                      if e['split'] != 'train'], [('val', 50), ('test', 50)])
    self.assertNotIn('oneDNN', result.stderr)


if __name__ == '__main__':
  absltest.main()
