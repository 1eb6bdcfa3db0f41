"""The lab experiments at tiny sizes: JSON fields and their arithmetic."""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

from configs import base
from haiku_mp.lab import matmul
from haiku_mp.lab import params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LabTest(absltest.TestCase):

  def test_params_of_the_reference_model(self):
    result = params.run(base.get_config())
    totals = result['totals']
    self.assertEqual(totals['float32']['count'], 10_695_562)
    self.assertEqual(totals['float32']['bytes'], 4 * 10_695_562)
    self.assertEqual(totals['bfloat16']['bytes'], 2 * 10_695_562)
    self.assertAlmostEqual(totals['float32']['megabytes'], 42.782248)
    for module in result['modules']:
      self.assertEqual(module['bytes_float16'], 2 * module['param_count'])
    self.assertEqual(sum(m['param_count'] for m in result['modules']),
                     10_695_562)

  def test_matmul_every_dtype_really_computed(self):
    result = matmul.run(16, 64, repeats=2)
    self.assertEqual([r['dtype'] for r in result['results']],
                     list(matmul.DTYPES))
    for r in result['results']:
      self.assertEqual(r['computed_dtype'], r['dtype'])
      self.assertAlmostEqual(r['gflops_per_sec'],
                             2 * 16 * 16 * 64 / r['median_sec'] / 1e9)
    self.assertEqual(result['results'][0]['time_vs_first'], 1.0)

  def test_command_line_writes_json_and_png(self):
    out = self.enter_context(tempfile.TemporaryDirectory())
    for args in (['params', '--config=configs/vit_fp32.py',
                  '--config.model.num_layers=1'],
                 ['matmul', '--rows=8', '--cols=32', '--repeats=1']):
      subprocess.run([sys.executable, '-m', 'launch.lab', *args,
                      f'--out={out}'], cwd=ROOT, check=True,
                     capture_output=True)
      with open(os.path.join(out, f'{args[0]}.json')) as f:
        self.assertEqual(json.load(f)['experiment'], args[0])
      self.assertGreater(os.path.getsize(os.path.join(out, f'{args[0]}.png')),
                         1000)
    bad = subprocess.run([sys.executable, '-m', 'launch.lab', 'sweepp',
                          f'--out={out}'], cwd=ROOT, capture_output=True,
                         text=True)
    self.assertNotEqual(bad.returncode, 0)
    self.assertIn("expected one experiment of ('params', 'matmul')",
                  bad.stderr.strip().splitlines()[-1])


if __name__ == '__main__':
  absltest.main()
