"""`launch.lab report --quick`: every part, its JSON, plots and report.md."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from haiku_mp import errors
from haiku_mp.lab.benchmarks import step_benchmark
from haiku_mp.lab import isolated
from haiku_mp.lab.report import report
from haiku_mp.lab.report import report_markdown
from haiku_mp.lab import variants
from haiku_mp.vit.data import npz_source
from haiku_mp.vit import settings as settings_lib
from tests import helpers


def _read(out, part):
  with open(os.path.join(out, f'{part}.json')) as f:
    return json.load(f)


@helpers.long_running
class QuickReportTest(parameterized.TestCase):
  """One quick report on a small .npz, read by every test of the class."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    rng = np.random.default_rng(0)
    arrays = {f'{s}_image': rng.integers(0, 256, (n, 32, 32, 3), np.uint8)
              for s, n in (('train', 40), ('test', 16))}
    arrays.update({f'{s}_label': rng.integers(0, 10, n).astype(np.int32)
                   for s, n in (('train', 40), ('test', 16))})
    path = os.path.join(cls.tmp.name, 'cifar10.npz')
    npz_source.save(path, arrays)
    cls.out = os.path.join(cls.tmp.name, 'report')
    cls.result = helpers.run_module(
        'launch.lab', 'report', '--quick', f'--out={cls.out}',
        # The CPU recipe: its augmentation, loss and schedule in every part.
        '--config=configs/vit_cpu_recipe.py:fp32', '--config.data.source=arrays',
        f'--config.data.arrays_path={path}',
        '--config.data.train_split=train[:32]',
        '--config.data.val_split=train[32:]')

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_every_part_and_the_markdown(self):
    self.assertEqual(self.result.returncode, 0, self.result.stderr[-3000:])
    index = json.loads(self.result.stdout.strip().splitlines()[-1])
    self.assertEqual(index['parts'], list(report.PARTS))
    # report.md has a section for every part, in the report's order.
    self.assertEqual(tuple(report_markdown.SECTIONS), report.PARTS)
    with open(os.path.join(self.out, 'report.md')) as f:
      markdown = f.read()
    for part in report.PARTS:
      result = _read(self.out, part)
      self.assertEqual((result['part'], result['quick']), (part, True))
      self.assertIn(f'## {report_markdown.SECTIONS[part][0]}', markdown)
      self.assertNotEmpty(result['plots'])
      for plot in result['plots']:
        self.assertGreater(os.path.getsize(os.path.join(self.out, plot)), 100)
        self.assertIn(f'({plot})', markdown)
    self.assertIn('Command: `python -m launch.lab report --quick', markdown)
    # --quick measures memory in one process, and says so.
    self.assertIn('Measured with every variant in one process.', markdown)

  def test_one_progress_line_per_part_and_variant(self):
    self.assertEqual(self.result.returncode, 0, self.result.stderr[-3000:])
    lines = self.result.stdout.strip().splitlines()[:-1]  # Then the index.
    variants = dict(
        benchmark=len(_read(self.out, 'benchmark')['results']),
        memory=len(_read(self.out, 'memory')['results']),
        precision=sum(len(_read(self.out, 'precision')[k])
                      for k in ('matmul', 'residual', 'loss_scale')),
        matmul=len(_read(self.out, 'matmul')['results']),
        dot_algorithms=len(_read(self.out, 'dot_algorithms')['results']),
        accuracy=len(_read(self.out, 'accuracy')['runs']))
    counted = {part: sum(line.startswith((f'{part} ', f'{part}:'))
                         for line in lines) for part in report.PARTS}
    # A line per variant and one when the part is done; nothing else.
    self.assertEqual(counted, {p: n + 1 for p, n in variants.items()})
    self.assertLen(lines, sum(counted.values()))
    self.assertLess(max(len(line) for line in lines), 200)
    # The trainer's own log (startup, progress, checkpoints, summary) is not
    # shown three times over, nor is a float64 truncation warning.
    for noise in ('loop.py', 'checkpoint.py', 'Summary', 'truncated'):
      self.assertNotIn(noise, self.result.stderr)

  def test_benchmark_and_memory_cover_every_dtype(self):
    self.assertEqual(self.result.returncode, 0, self.result.stderr[-3000:])
    for part in ('benchmark', 'memory'):
      rows = _read(self.out, part)['results']
      self.assertEqual([(r['dtype'], r['fits']) for r in rows],
                       [(d, True) for d in variants.DTYPES])
    bench = _read(self.out, 'benchmark')['results']
    for row in bench:
      self.assertAlmostEqual(row['vs_float32']['images_per_sec'],
                             row['images_per_sec'] / bench[0]['images_per_sec'])
      # An MFU of a quick report was 1.55: its 64^3 ceiling was no ceiling.
      # The ceiling now does at least a step's FLOPs per call, at --quick's
      # least side, and the MFU is one.
      self.assertGreaterEqual(row['matmul_ceiling_size'],
                              report.QUICK.ceiling_size)
      self.assertGreaterEqual(2 * row['matmul_ceiling_size']**3,
                              row['flops_per_step'])
      self.assertBetween(row['mfu'], 0, 1)
    memory = _read(self.out, 'memory')['results']
    # Half precision keeps fewer activation bytes than float32.
    for row in memory[1:]:
      self.assertLess(row['vs_float32']['kept_activation_bytes'], 0.8)

  def test_dot_algorithms_say_what_runs(self):
    self.assertEqual(self.result.returncode, 0, self.result.stderr[-3000:])
    rows = {r['algorithm']: r for r in _read(self.out, 'dot_algorithms')[
        'results']}
    self.assertIn('F16_F16_F32', rows)  # The seeds' algorithm: an answer.
    f32 = rows['F32_F32_F32']
    self.assertTrue(f32['compiles'])
    self.assertLess(f32['relative_error'], 1e-5)
    for row in rows.values():
      self.assertEqual(row['compiles'], row['error'] is None)
    # Measured with x64 on (a process of its own), not truncated to float32.
    f64 = rows['F64_F64_F64']
    self.assertEqual((f64['operand_dtype'], f64['result_dtype'], f64['x64']),
                     ('float64', 'float64', True))
    self.assertLess(f64['relative_error'], 1e-12)

  def test_accuracy_runs_are_workdirs_with_curves_and_the_gap(self):
    self.assertEqual(self.result.returncode, 0, self.result.stderr[-3000:])
    result = _read(self.out, 'accuracy')
    self.assertEqual([r['dtype'] for r in result['runs']], list(variants.DTYPES))
    for run in result['runs']:
      self.assertEqual(run['steps'], report.QUICK_TRAIN_STEPS)
      workdir = os.path.join(self.out, run['workdir'])
      self.assertTrue(os.path.exists(os.path.join(workdir, 'summary.json')))
    self.assertEqual(result['data_source'], 'arrays')
    accuracy = {r['dtype']: r['test_accuracy'] for r in result['runs']}
    for dtype in ('bfloat16', 'float16'):
      self.assertAlmostEqual(result["gap_points_vs_float32"][dtype],
                             100 * (accuracy[dtype] - accuracy['float32']))

  def test_a_later_part_keeps_the_others_in_the_markdown(self):
    self.assertEqual(self.result.returncode, 0, self.result.stderr[-3000:])
    again = helpers.run_module('launch.lab', 'report', '--quick',
                               f'--out={self.out}', '--parts=matmul')
    self.assertEqual(again.returncode, 0, again.stderr[-3000:])
    with open(os.path.join(self.out, 'report.md')) as f:
      markdown = f.read()
    for part in report.PARTS:
      self.assertIn(f'## {report_markdown.SECTIONS[part][0]}', markdown)


@helpers.long_running
class WhatDoesNotFitTest(absltest.TestCase):

  def test_a_variant_out_of_memory_is_a_row_not_the_end(self):
    config = report.quick_config(settings_lib.parse(helpers.tiny_config()))
    real = step_benchmark.run

    def run(variant, *args, **kwargs):
      if variant.batch_size > 8:
        raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating')
      return real(variant, *args, **kwargs)

    sizes = report.Sizes(batch_sizes=(8, 16), steps=1, ceiling_size=32,
                         ceiling_repeats=1)
    with mock.patch.object(step_benchmark, 'run', run):
      rows = report.benchmark(config, sizes, log=lambda _: None)['results']
    self.assertEqual([r['fits'] for r in rows], [True] * 3 + [False] * 3)
    self.assertIn('RESOURCE_EXHAUSTED', rows[-1]['error'])
    self.assertIsNone(rows[-1]['vs_float32'])

  def test_a_variant_that_fails_in_its_process_is_a_row(self):
    config = report.quick_config(settings_lib.parse(helpers.tiny_config()))
    sizes = report.Sizes(batch_sizes=(8,), steps=1)
    failure = errors.ConfigError('variant failed: RESOURCE_EXHAUSTED')
    with mock.patch.object(isolated, 'time_step', side_effect=failure):
      rows = report.memory_part(config, sizes, log=lambda _: None)['results']
    self.assertEqual([r['fits'] for r in rows], [False] * 3)
    self.assertGreater(rows[0]['kept_activation_bytes'], 0)

  def test_out_of_memory_in_this_process_is_a_row_too(self):
    config = report.quick_config(settings_lib.parse(helpers.tiny_config()))
    sizes = report.Sizes(batch_sizes=(8,), steps=1, isolate_memory=False)
    failure = RuntimeError('RESOURCE_EXHAUSTED: Out of memory')
    with mock.patch.object(isolated, 'time_step', side_effect=failure):
      rows = report.memory_part(config, sizes, log=lambda _: None)['results']
    self.assertEqual([r['fits'] for r in rows], [False] * 3)

  def test_other_errors_are_not_taken_for_memory(self):
    config = report.quick_config(settings_lib.parse(helpers.tiny_config()))
    sizes = report.Sizes(batch_sizes=(8,), steps=1)
    with mock.patch.object(step_benchmark, 'run',
                           side_effect=ValueError('a bug')):
      with self.assertRaisesRegex(ValueError, 'a bug'):
        report.benchmark(config, sizes, log=lambda _: None)


if __name__ == '__main__':
  absltest.main()
