"""The lab experiments at tiny sizes: JSON fields and their arithmetic."""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from configs import base
from haiku_mp.lab import matmul
from haiku_mp.lab import params
from haiku_mp.lab import sweep
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LabTest(parameterized.TestCase):

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

  def test_sweep_fields_and_arithmetic(self):
    config = helpers.tiny_config()
    result = sweep.run(config, ('float32', 'bfloat16'), (8, 16), ['pjit:8x1'],
                       num_steps=2, isolate=False, log=lambda _: None)
    rows = result['results']
    self.assertEqual([(r['dtype'], r['batch_size']) for r in rows],
                     [('float32', 8), ('bfloat16', 8), ('float32', 16),
                      ('bfloat16', 16)])
    for r in rows:
      self.assertEqual(r['policy'],
                       f'params=float32,compute={r["dtype"]},output=float32')
      self.assertEqual((r['strategy'], r['mesh_shape']), ('pjit', [8, 1]))
      self.assertLen(r['step_times_sec'], 2)
      self.assertAlmostEqual(r['median_step_sec'],
                             sum(r['step_times_sec']) / 2)
      self.assertAlmostEqual(r['images_per_sec'],
                             r['batch_size'] / r['median_step_sec'])
      self.assertAlmostEqual(r['epoch_sec'], 45_000 / r['images_per_sec'])
      self.assertEqual(r['compiled_total_bytes'],
                       r['argument_size_in_bytes'] + r['output_size_in_bytes']
                       - r['alias_size_in_bytes'] + r['temp_size_in_bytes'])
      self.assertGreater(r['temp_size_in_bytes'], 0)
      self.assertIsNone(r['device_peak_bytes'])  # No GPU in tests.
      base = rows[0] if r['batch_size'] == 8 else rows[2]
      self.assertAlmostEqual(r['vs_float32']['temp_size_in_bytes'],
                             r['temp_size_in_bytes'] / base['temp_size_in_bytes'])
    self.assertEqual(rows[0]['vs_float32']['median_step_sec'], 1.0)
    # The batch is split over 8 devices: 8 more examples are one more
    # float32 8x8x3 image and int32 label on each device.
    self.assertEqual(rows[2]['argument_size_in_bytes'] -
                     rows[0]['argument_size_in_bytes'], 8 * 8 * 3 * 4 + 4)

  def test_command_line_writes_json_and_png(self):
    out = self.enter_context(tempfile.TemporaryDirectory())
    for args in (['params', '--config=configs/vit_fp32.py',
                  '--config.model.num_layers=1'],
                 ['matmul', '--rows=8', '--cols=32', '--repeats=1'],
                 ['sweep', '--config=configs/vit_fp16.py',
                  '--config.model.num_layers=1', '--config.model.embed_dim=16',
                  '--config.model.mlp_dim=16', '--config.model.image_size=8',
                  '--batch_sizes=4', '--dtypes=float32,float16', '--steps=1']):
      subprocess.run([sys.executable, '-m', 'launch.lab', *args,
                      f'--out={out}'], cwd=ROOT, check=True,
                     capture_output=True)
      with open(os.path.join(out, f'{args[0]}.json')) as f:
        result = json.load(f)
      self.assertEqual(result['experiment'], args[0])
      plots = result['plots']
      for plot in plots:
        self.assertGreater(os.path.getsize(os.path.join(out, plot)), 1000)
      self.assertTrue(plots)

  @parameterized.parameters(
      (['sweepp'], "expected one experiment of ('params', 'sweep', 'matmul'"),
      (['sweep', '--dtypes=float32,float12'], "sweep dtype 'float12'"),
      (['sweep', '--batch_sizes=128,0'], '--batch_sizes'),
      (['sweep', '--layouts=pjit:3x1'], 'parallel.mesh_shape=(3, 1)'),
      (['sweep', '--layouts=pjit'], "bad layout 'pjit'"))
  def test_bad_input_one_line_error(self, args, message):
    out = self.enter_context(tempfile.TemporaryDirectory())
    bad = subprocess.run([sys.executable, '-m', 'launch.lab', *args,
                          f'--out={out}/lab'], cwd=ROOT, capture_output=True,
                         text=True)
    self.assertEqual(bad.returncode, 1, bad.stderr[-2000:])
    self.assertIn(message, bad.stderr.strip().splitlines()[-1])
    self.assertFalse(os.path.exists(f'{out}/lab'))


if __name__ == '__main__':
  absltest.main()
