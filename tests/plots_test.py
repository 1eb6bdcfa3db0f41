"""Tests for run plots and `python -m launch.plot`."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json
import tempfile

from absl.testing import absltest

from haiku_mp.lab import plots
from tests import helpers



class PlotsTest(absltest.TestCase):

  def test_plot_from_workdirs(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    for name, scale in (('fp32', 1.0), ('fp16', 2.0**15)):
      os.makedirs(os.path.join(tmp, name))
      with open(os.path.join(tmp, name, 'metrics.jsonl'), 'w') as f:
        for step in (10, 20):
          f.write(json.dumps(dict(step=step, split='train', loss=2.0 / step,
                                  loss_scale=scale)) + '\n')
        f.write(json.dumps(dict(step=20, split='val', accuracy=0.3)) + '\n')
    self.assertLen(plots.read_metrics(os.path.join(tmp, 'fp16')), 3)
    out = os.path.join(tmp, 'runs.png')
    helpers.run_module('launch.plot', f'--workdirs={tmp}/fp32,{tmp}/fp16',
                       f'--out={out}', check=True)
    with open(out, 'rb') as f:
      self.assertEqual(f.read(8), b'\x89PNG\r\n\x1a\n')
    self.assertGreater(os.path.getsize(out), 10_000)

  def test_missing_workdir_is_a_clear_error(self):
    result = helpers.run_module('launch.plot', '--workdirs=/nonexistent/run')
    self.assertEqual(result.returncode, 2)
    self.assertNotIn('Traceback', result.stderr)
    self.assertEqual(result.stderr.strip().splitlines(), [
        'error: --workdirs: cannot read /nonexistent/run/metrics.jsonl (No '
        'such file or directory)'])


if __name__ == '__main__':
  absltest.main()
