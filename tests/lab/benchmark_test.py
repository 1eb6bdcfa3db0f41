"""The step benchmark: its fields, the arithmetic of MFU, the command line."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json
import re
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax

from haiku_mp.lab.benchmarks import loop_benchmark
from haiku_mp.lab.benchmarks import pipeline_benchmark
from haiku_mp.lab.benchmarks import step_benchmark
from haiku_mp.lab import compare
from haiku_mp.lab import hardware
from haiku_mp.model import half_dot
from haiku_mp.vit import settings as settings_lib
from tests import helpers
from tests import signal_at_step

FIELDS = {'device', 'jax_version', 'cpu', 'allocator', 'dtype', 'dot_form', 'policy',
          'batch_size', 'steps', 'step_time_s', 'step_times_s',
          'images_per_sec', 'flops_per_step', 'matmul_ceiling_flops',
          'matmul_ceiling_size', 'matmul_ceiling_times_s', 'mfu', 'mfu_note',
          'compile_s', 'sys_cpu_s_per_step',
          'argument_bytes', 'output_bytes', 'temp_bytes', 'code_bytes',
          'device_peak_bytes', 'privacy', 'train_batch_size',
          'dp_microbatch_size'}


@helpers.long_running
class StepBenchmarkTest(parameterized.TestCase):

  def test_fields_and_arithmetic_per_dtype(self):
    config = helpers.tiny_config()
    config.batch_size = 8
    # An 8^3 ceiling matmul is the call's fixed cost, not the device's speed:
    # the ceiling that gave `report --quick` an MFU above 1 (a 64^3 one against
    # a step of 9x its FLOPs), here far smaller still.
    rows = step_benchmark.run_dtypes(settings_lib.parse(config),
                                     ('float32', 'bfloat16'),
                                     steps=2,
                                     ceiling_size=8,
                                     ceiling_repeats=2)
    self.assertEqual([r['dtype'] for r in rows], ['float32', 'bfloat16'])
    # `auto`'s form for bf16 on this backend (on a CPU: per its features).
    self.assertEqual([r['dot_form'] for r in rows], ['plain', half_dot.form_for(
        'auto', 'bfloat16', jax.default_backend())])
    for row in rows:
      self.assertEqual(set(row) - {'vs_first'}, FIELDS)
      self.assertLen(row['step_times_s'], 2)
      self.assertEqual(row['step_time_s'], sorted(row['step_times_s'])[0] / 2 +
                       sorted(row['step_times_s'])[1] / 2)
      self.assertAlmostEqual(row['images_per_sec'], 8 / row['step_time_s'])
      self.assertGreater(row['flops_per_step'], 0)
      # The ceiling does at least one step's FLOPs per call, at the speed of
      # its fastest call.
      side = row['matmul_ceiling_size']
      self.assertGreaterEqual(2 * side**3, row['flops_per_step'])
      self.assertLen(row['matmul_ceiling_times_s'], 2)
      self.assertEqual(row['matmul_ceiling_flops'],
                       2 * side**3 / min(row['matmul_ceiling_times_s']))
      if row['mfu'] is None:  # The step beat the ceiling: no MFU, and why.
        self.assertIn('above the', row['mfu_note'])
      else:
        self.assertIsNone(row['mfu_note'])
        self.assertBetween(row['mfu'], 0, 1)
        self.assertAlmostEqual(
            row['mfu'], row['flops_per_step'] / row['step_time_s'] /
            row['matmul_ceiling_flops'])
      self.assertGreater(row['temp_bytes'], 0)
      self.assertIsInstance(row['sys_cpu_s_per_step'], float)
    # A bf16 step does the same work: XLA counts (nearly) the same FLOPs.
    self.assertBetween(rows[1]['flops_per_step'] / rows[0]['flops_per_step'],
                       0.9, 1.1)
    self.assertEqual(rows[0]['vs_first']['images_per_sec'], 1.0)
    self.assertAlmostEqual(rows[1]['vs_first']['step_time_s'],
                           rows[1]['step_time_s'] / rows[0]['step_time_s'])

  def test_dp_sgd_against_the_ordinary_step_in_one_run(self):
    # The ordinary step is the one of the test above: compiled once for both
    # (the tests' compilation cache).
    config = helpers.tiny_config()
    config.batch_size = 8
    config.privacy.microbatch_size = 4
    rows = step_benchmark.run_dtypes(settings_lib.parse(config), ('float32',),
                                     steps=2,
                                     ceiling_size=64,
                                     ceiling_repeats=2,
                                     dp_vs_ordinary=True)
    self.assertEqual([(r['dtype'], r['privacy']) for r in rows],
                     [('float32', False), ('float32', True)])
    ordinary, private = rows
    self.assertEqual(ordinary['train_batch_size'], 8)
    self.assertIsNone(ordinary['dp_microbatch_size'])
    # Padded to 8 + 3 standard deviations, in microbatches of 4.
    self.assertEqual(private['train_batch_size'], 20)
    self.assertEqual(private['dp_microbatch_size'], 4)
    # images/s counts the expected sampled batch, not the padding.
    self.assertAlmostEqual(private['images_per_sec'],
                           8 / private['step_time_s'])
    self.assertGreater(private['flops_per_step'], ordinary['flops_per_step'])
    self.assertAlmostEqual(private['vs_ordinary']['step_time_s'],
                           private['step_time_s'] / ordinary['step_time_s'])
    self.assertEqual(ordinary['vs_ordinary']['step_time_s'], 1.0)

  @parameterized.named_parameters(
      ('one_dtype_dp_vs_ordinary', (('float32', False), ('float32', True)),
       ['float32 DP-SGD vs ordinary float32: 0.50x the images/s']),
      ('two_dtypes_dp_vs_ordinary',
       (('float32', False), ('float32', True), ('bfloat16', False),
        ('bfloat16', True)),
       ['bfloat16 vs float32: 1.50x the images/s',
        'float32 DP-SGD vs ordinary float32: 0.50x the images/s',
        'bfloat16 DP-SGD vs ordinary bfloat16: 0.50x the images/s']),
      ('two_dtypes', (('float32', False), ('bfloat16', False)),
       ['bfloat16 vs float32: 1.50x the images/s']))
  def test_each_comparison_is_printed_once(self, kinds, lines):
    speed = dict(float32=100.0, bfloat16=150.0)
    rows = [dict(dtype=d, privacy=p,
                 images_per_sec=speed[d] / (2 if p else 1)) for d, p in kinds]
    compare.add_ratios(rows, 'vs_first', ('images_per_sec',),
                       is_base=lambda r: r is rows[0])
    compare.add_ratios(rows, 'vs_ordinary', ('images_per_sec',),
                       is_base=lambda r: not r['privacy'],
                       same_group=lambda a, b: a['dtype'] == b['dtype'])
    self.assertEqual(step_benchmark.ratio_lines(rows), lines)

  def test_the_ceiling_side_and_an_mfu_above_one(self):
    self.assertEqual(step_benchmark.ceiling_side(None, 64), 64)
    self.assertEqual(step_benchmark.ceiling_side(2 * 10**6, 64), 100)
    self.assertEqual(step_benchmark.ceiling_side(2 * 10**6, 512), 512)
    self.assertEqual(step_benchmark.ceiling_side(1e15, 64),
                     step_benchmark.MAX_GROWN_CEILING_SIZE)
    self.assertEqual(step_benchmark.mfu(4e9, 2.0, 4e9), (0.5, None))
    value, why = step_benchmark.mfu(4e9, 0.5, 4e9)
    self.assertIsNone(value)
    self.assertIn('8 GFLOP/s, above the 4 GFLOP/s of the ceiling', why)
    self.assertEqual(step_benchmark.mfu(None, 1.0, 4e9)[0], None)

  def test_cpu_flags(self):
    path = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                        'cpuinfo')
    with open(path, 'w') as f:
      f.write('processor\t: 0\nmodel name\t: Some CPU 9000\n'
              'flags\t\t: fpu avx512f avx512_bf16 amx_tile\n'
              'processor\t: 1\nmodel name\t: Some CPU 9000\nflags\t\t: fpu\n')
    self.assertEqual(hardware.cpu_info(path),
                     dict(model='Some CPU 9000', amx_bf16=False,
                          avx512_bf16=True, avx512_fp16=False))
    self.assertEqual(hardware.cpu_info('/nonexistent')['model'],
                     'unknown')


class PipelineBenchmarkTest(parameterized.TestCase):

  def test_pipeline_figures_and_their_arithmetic(self):
    config = helpers.tiny_config()
    config.model.image_size = 32
    config.model.patch_size = 8
    config.batch_size = 8
    config.data.source = 'synthetic'
    config.data.synthetic_train_examples = 64
    result = pipeline_benchmark.run(settings_lib.parse(config),
                                    steps=2,
                                    rounds=2,
                                    repeats=3)
    self.assertEqual(result['train_examples'], 64)
    for field in ('host_images_per_sec', 'augment_images_per_sec',
                  'pipeline_images_per_sec', 'step_images_per_sec'):
      self.assertGreater(result[field], 0, field)
    step = result['step_time_s']
    self.assertEqual(set(step), {'device_batch', 'pipeline_fed'})
    self.assertLen(result['step_times_s']['pipeline_fed'], 2)
    self.assertAlmostEqual(result['step_images_per_sec'],
                           8 / step['device_batch'])
    self.assertAlmostEqual(result['fed_slowdown'],
                           step['pipeline_fed'] / step['device_batch'] - 1)
    self.assertAlmostEqual(result['pipeline_over_step'],
                           result['pipeline_images_per_sec'] /
                           result['step_images_per_sec'])
    self.assertAlmostEqual(result['augment_share_of_step'],
                           8 / result['augment_images_per_sec'] /
                           step['device_batch'])


class LoopBenchmarkTest(parameterized.TestCase):

  def test_steady_pace_is_the_windows_after_the_first(self):
    events = [dict(split='train', step=10, images_per_sec=50.0),
              dict(split='val', step=10, images_per_sec=None),
              dict(split='train', step=20, images_per_sec=100.0),
              dict(split='train', step=25, images_per_sec=400.0)]
    # Windows 2 and 3: 15 steps of 8 images in 10*8/100 + 5*8/400 s.
    self.assertAlmostEqual(
        loop_benchmark.steady_images_per_sec(events, 8),
        15 * 8 / (0.8 + 0.1))
    with self.assertRaisesRegex(ValueError, 'two log windows'):
      loop_benchmark.steady_images_per_sec(events[:2], 8)


# The --loop test's run (its bf16 variant is the config's own). The pipeline
# and the SIGTERM tests run the same config, so that their train step is the
# loop's bf16 one (a round's steps set its schedule): whichever test runs
# first compiles it, the others load it from the tests' cache.
LOOP_FLAGS = ('--config=configs/vit_bf16.py', '--config.batch_size=8',
              '--config.eval_batch_size=8', '--config.log_every_steps=2',
              '--config.data.source=synthetic',
              '--config.data.synthetic_train_examples=64',
              '--config.data.synthetic_eval_examples=8',
              '--config.model.image_size=8', *helpers.TINY_MODEL_FLAGS)
LOOP_STEPS = 4


@helpers.long_running
class CommandLineTest(parameterized.TestCase):

  def test_pipeline_from_the_command_line(self):
    result = helpers.run_module(
        'launch.benchmark', *LOOP_FLAGS,
        f'--config.num_train_steps={LOOP_STEPS}', '--pipeline', '--steps=2',
        '--rounds=1', '--json')
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    lines = result.stdout.strip().splitlines()
    self.assertRegex(lines.pop(0), r'^Machine: .*; allocator: ')
    summary = json.loads(lines[-1])
    self.assertEqual((summary['source'], summary['batch_size']),
                     ('synthetic', 8))
    self.assertIn('x the step', lines[0])
    self.assertIn('fed by the pipeline', lines[1])

  def test_dtypes_in_one_run_end_with_one_json_object(self):
    result = helpers.run_module(
        'launch.benchmark', '--config=configs/vit_fp32.py', '--steps=2',
        '--dtypes=float32,float16', '--json', '--ceiling_size=64',
        '--config.batch_size=8', '--config.model.image_size=8',
        *helpers.TINY_MODEL_FLAGS)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    # The allocator in force, on the console's first line and in the JSON.
    self.assertRegex(lines.pop(0),
                     rf'^Machine: .*; allocator: {re.escape(summary["allocator"])}$')
    self.assertEqual(summary['ratios_vs'], 'float32')
    self.assertEqual([r['dtype'] for r in summary['results']],
                     ['float32', 'float16'])
    fp16 = summary['results'][1]
    self.assertEqual(set(fp16) - {'vs_first'}, FIELDS)
    self.assertIn('img/s', lines[0])  # A line a person reads per dtype.
    self.assertIn('float16 vs float32', lines[-2])

  def test_loop_against_its_step_per_dtype_and_bound_from_the_command_line(
      self):
    result = helpers.run_module(
        'launch.benchmark', *LOOP_FLAGS, '--loop', '--dtypes=float32,bfloat16',
        '--steps_in_flight=16,1', f'--steps={LOOP_STEPS}', '--rounds=1',
        '--json')
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    lines = result.stdout.strip().splitlines()
    self.assertRegex(lines.pop(0), r'^Machine: .*; allocator: ')
    summary = json.loads(lines[-1])
    rows = summary['results']
    self.assertEqual([(r['dtype'], r['steps_in_flight']) for r in rows],
                     [('float32', 16), ('float32', 1), ('bfloat16', 16),
                      ('bfloat16', 1)])
    self.assertEqual(summary['ratios_vs'], 'float32 steps_in_flight=16')
    # A line per round (the variants' rounds alternate), per variant and
    # per ratio.
    self.assertEqual([line.split(': loop')[0] for line in lines[:4]],
                     [f'{d} steps_in_flight={k} round 1/1'
                      for d in ('float32', 'bfloat16') for k in (16, 1)])
    self.assertRegex(lines[4], r"loop \d+ img/s = [\d.]+x the step's")
    self.assertIn('bfloat16 steps_in_flight=1 vs float32 steps_in_flight=16: '
                  'the loop', lines[-2])
    # The trainer's own lines stay out of the benchmark's console.
    self.assertNotIn('Compiled the train step', result.stderr)
    for row in rows:
      self.assertEqual((row['steps_per_round'], row['rounds'], row['source'],
                        row['batch_size']), (LOOP_STEPS, 1, 'synthetic', 8))
      self.assertEqual(row['loop_rounds_images_per_sec'],
                       [row['loop_images_per_sec']])
      self.assertEqual(row['step_rounds_images_per_sec'],
                       [row['step_images_per_sec']])
      self.assertAlmostEqual(row['loop_over_step'],
                             row['loop_images_per_sec'] /
                             row['step_images_per_sec'])
      self.assertEqual(row['target_met'],
                       row['loop_over_step'] >= row['target'])
      self.assertGreater(row['host_ms_per_step']['in_step_call'], 0)
      self.assertIsInstance(row['host_ms_per_step']['waiting_for_batch'],
                            float)
    self.assertAlmostEqual(
        rows[2]['vs_first']['loop_images_per_sec'],
        rows[2]['loop_images_per_sec'] / rows[0]['loop_images_per_sec'])

  def test_a_loop_round_stopped_by_sigterm_stops_the_benchmark_in_one_line(
      self):
    # It used to end in a ValueError traceback (a round with one window):
    # stopped after its first log window of two.
    result = helpers.run_module(
        'tests.signal_at_step', *LOOP_FLAGS, '--loop', f'--steps={LOOP_STEPS}',
        '--rounds=1',
        env={signal_at_step.ENV: 'TERM:2',
             signal_at_step.MODULE_ENV: 'launch.benchmark'}, timeout=300)
    self.assertEqual(result.returncode, 130, result.stderr[-3000:])
    self.assertNotIn('Traceback', result.stderr)
    self.assertEqual(result.stderr.strip().splitlines()[-1],
                     'interrupted: SIGTERM in a --loop round (step 2): the '
                     'benchmark stopped before its figures')

  @parameterized.parameters(
      (['--loop', '--pipeline'], '--pipeline and --loop are different'),
      (['--loop', '--steps=20'], '--steps=20 is less than two log windows'),
      (['--dtypes=float32,float8'], '--dtypes (float8)'),
      (['--dtypes=bfloat16,fp8_rowwise'], "--dtypes: unknown value "
       "'fp8_rowwise'; expected one of ('fp8_current', 'fp8_delayed', "
       "'fp8_mx')"),
      (['--steps=0'], '--steps=0 must be at least 1'),
      (['--pipeline', '--rounds=0'], '--rounds=0 must be at least 1'),
      (['--warmup_steps=-1'], '--warmup_steps=-1 must be at least 0'),
      (['--loop', '--steps_in_flight=2,17', '--steps=100'],
       '--steps_in_flight=2,17: expected integers in [1, 16]'),
      (['--steps_in_flight=2'], '--steps_in_flight compares training loops: '
       'add --loop'))
  def test_bad_input_is_one_line(self, flags, message):
    result = helpers.run_module('launch.benchmark',
                                '--config=configs/vit_fp32.py', *flags)
    self.assertNotEqual(result.returncode, 0)
    self.assertNotIn('Traceback', result.stderr)
    self.assertIn(message, result.stderr.strip().splitlines()[-1])


if __name__ == '__main__':
  absltest.main()
