"""Tests for the per-module table and `python -m launch.tabulate`."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import collections
import json

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from configs import vit_fp16
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import overview
from tests import helpers

FIELDS = {'path', 'class', 'policy', 'policy_source', 'params', 'param_dtypes',
          'input_dtypes', 'output_dtypes', 'param_count', 'param_bytes',
          'matmul', 'matmul_flops_share', 'matmul_runs'}



def _tabulate_json(config: str, *flags: str):
  """`launch.tabulate --json` of a one-block `config`: its rows by module
  path, and the finished process."""
  result = helpers.run_module(
      'launch.tabulate', f'--config={config}', '--json',
      '--config.model.num_layers=1', *flags, check=True)
  return {r['path']: r for r in json.loads(result.stdout)}, result

@helpers.long_running
class TabulateTest(parameterized.TestCase):

  def test_rows_for_the_reference_fp16_model(self):
    rows = overview.module_rows(
        experiment.build_without_data(settings_lib.parse(
            vit_fp16.get_config())))
    by_path = {r['path']: r for r in rows}
    self.assertEqual(rows[0]['path'], 'vit')
    self.assertEqual(sum(r['param_count'] for r in rows), 10_695_562)
    self.assertEqual(sum(r['param_bytes'] for r in rows), 4 * 10_695_562)
    for row in rows:
      self.assertEqual(set(row), FIELDS)
      count = sum(np.prod(p['shape']) for p in row['params'].values())
      self.assertEqual(row['param_count'], count)
      self.assertEqual(row['param_bytes'], 4 * count)  # float32 master params.
    head = by_path['vit/head']
    self.assertEqual((head['class'], head['param_count']), ('Linear', 3850))
    self.assertEqual(head['input_dtypes'], ['float16'])
    ln = by_path['vit/encoder_block_3/ln_attention']
    self.assertEqual((ln['policy'], ln['policy_source']),
                     ('p=f32,c=f32,o=f16', 'default LayerNorm'))
    self.assertEqual((ln['input_dtypes'], ln['output_dtypes']),
                     (['float32'], ['float16']))
    self.assertEqual(by_path['vit']['output_dtypes'], ['float32'])
    self.assertLess(list(by_path).index('vit/encoder_block_0'),
                    list(by_path).index('vit/encoder_block_0/attention'))

  def test_text_table_has_every_module_and_the_total(self):
    rows = overview.module_rows(
        experiment.build_without_data(settings_lib.parse(
            helpers.tiny_config())))
    text = overview.format_table(rows)
    for row in rows:
      self.assertIn(row['path'], text)
    total = sum(r['param_count'] for r in rows)
    self.assertRegex(text.splitlines()[-1], rf'^total\s+{total}\s')

  def test_summary_line_counts_the_modules_and_policies_in_force(self):
    config = helpers.tiny_config(
        'params=float32,compute=float16,output=float32',
        overrides='*/head:float32')
    rows = overview.module_rows(
        experiment.build_without_data(settings_lib.parse(config)))
    total = sum(r['param_count'] for r in rows)
    policies = collections.Counter(r['policy'] for r in rows)
    self.assertLen(policies, 3)  # Half, LayerNorm's float32, the head's.
    self.assertEqual(
        overview.summary_line(rows, '*/head:float32'),
        f'Model: {len(rows)} modules, {total:,} parameters '
        f'({4 * total / 1e6:.2f} MB); policies (modules): '
        + '; '.join(f'{p} ({n})' for p, n in policies.most_common())
        + '; overrides: */head:float32')

  def test_command_line_json_with_override(self):
    rows, _ = _tabulate_json('configs/vit_fp16.py',
                             '--config.precision.overrides=*/head:float32')
    self.assertEqual(rows['vit/head']['input_dtypes'], ['float32'])
    self.assertEqual(rows['vit/head']['policy_source'], 'override */head')
    self.assertEqual(rows['vit/encoder_block_0/mlp_block/fc1']['policy'],
                     'p=f32,c=f16,o=f32')

  def test_command_line_bad_override_is_a_one_line_error(self):
    result = helpers.run_module(
        'launch.tabulate', '--config=configs/vit_fp16.py',
        '--config.precision.overrides=Nope:float32')
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("target 'Nope' matches no module", result.stderr)
    self.assertNotIn('Traceback', result.stderr)


if __name__ == '__main__':
  absltest.main()
