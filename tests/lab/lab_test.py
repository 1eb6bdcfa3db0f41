"""The lab experiments at tiny sizes: JSON fields and their arithmetic."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import contextlib
import copy
import io
import json
import math
import re
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np

from configs import base
from configs import vit_pure_bf16 as configs_pure_bf16
from haiku_mp import errors
from haiku_mp.lab import compare
from haiku_mp.lab.studies import ladder
from haiku_mp.lab.studies import lost_updates
from haiku_mp.lab.studies import matmul
from haiku_mp.lab.studies import matmul_precision as precision_lab
from haiku_mp.lab.studies import memory
from haiku_mp.lab.studies import params
from haiku_mp.lab.studies import profile
from haiku_mp.lab.studies import state_layouts
from haiku_mp.lab.studies import sweep
from haiku_mp.lab import variants
from haiku_mp.model import meta_params
from haiku_mp.update import state_layout
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from launch import flag_checks
from tests import helpers

TINY_FLAGS = ('--config.model.num_layers=1', '--config.model.embed_dim=16',
              '--config.model.mlp_dim=16', '--config.model.image_size=8')


def assert_writes_its_files(test, result, plot, experiment_name):
  """What `launch.lab`'s main writes of a study's result, in-process: its
  JSON (the experiment named) and its plots (and files such as a trace),
  each more than 100 bytes."""
  test.assertEqual(json.loads(json.dumps(result))['experiment'],
                   experiment_name)
  out = test.enter_context(tempfile.TemporaryDirectory())
  written = [os.path.basename(p) for p in plot(result, out)]
  test.assertNotEmpty(written)
  for path in written:
    test.assertGreater(os.path.getsize(os.path.join(out, path)), 100)


class ParamsMatmulRatiosTest(parameterized.TestCase):

  def test_params_of_the_reference_model(self):
    result = params.run(settings_lib.parse(base.get_config()),
                        log=lambda _: None)
    totals = result['totals']
    self.assertEqual(totals['float32']['count'], 10_695_562)
    self.assertEqual(totals['float32']['bytes'], 4 * 10_695_562)
    self.assertEqual(totals['bfloat16']['bytes'], 2 * 10_695_562)
    self.assertAlmostEqual(totals['float32']['megabytes'], 42.782248)
    for module in result['modules']:
      self.assertEqual(module['bytes_float16'], 2 * module['param_count'])
    self.assertEqual(sum(m['param_count'] for m in result['modules']),
                     10_695_562)
    self.assertEqual(result['note'], 'MB = 1e6 bytes: 10,695,562 float32 '
                     'params are 42.78 MB (40.80 MiB).')

  def test_matmul_every_dtype_really_computed(self):
    result = matmul.run(16, 64, repeats=2)
    self.assertEqual([r['dtype'] for r in result['results']],
                     list(matmul.DTYPES))
    for r in result['results']:
      self.assertEqual(r['computed_dtype'], r['dtype'])
      self.assertAlmostEqual(r['gflops_per_sec'],
                             2 * 16 * 16 * 64 / r['median_sec'] / 1e9)

  def test_ratios_to_the_base_row_of_each_group(self):
    rows = [dict(dtype='float32', batch=8, t=4.0, peak=None),
            dict(dtype='bfloat16', batch=8, t=2.0, peak=3),
            dict(dtype='bfloat16', batch=16, t=3.0, peak=1),
            dict(dtype='float32', batch=16, t=12.0, peak=0)]
    compare.add_ratios(rows, 'vs', ('t', 'peak'),
                       is_base=lambda r: r['dtype'] == 'float32',
                       same_group=lambda a, b: a['batch'] == b['batch'])
    # A base of None or 0 gives no ratio for that field.
    self.assertEqual([r['vs'] for r in rows],
                     [{'t': 1.0}, {'t': 0.5}, {'t': 0.25}, {'t': 1.0}])
    compare.add_ratios(rows, 'vs', ('t',), is_base=lambda r: False)
    self.assertEqual([r['vs'] for r in rows], [None] * 4)


class FlagChecksTest(parameterized.TestCase):
  """The checks behind every bad-input line of launch.lab and launch.benchmark
  (the command-line tests run a few of them end to end)."""

  @parameterized.parameters(
      (('repeats', 0, 1), '--repeats=0 must be at least 1'),
      (('warmup_steps', -1, 0), '--warmup_steps=-1 must be at least 0'),
      (('checkpoint_step', -2, -1), '--checkpoint_step=-2 must be at least -1'))
  def test_at_least(self, flag, message):
    flag_checks.at_least([('rows', 1, 1), ('warmup_steps', 0, 0)])
    with self.assertRaisesWithLiteralMatch(errors.ConfigError, message):
      flag_checks.at_least([('rows', 1, 1), flag])

  def test_lists(self):
    self.assertEqual(flag_checks.positive_ints('batch_sizes', ['8', '16']), [8, 16])
    for values in (['8', '0'], ['x'], []):
      with self.assertRaisesRegex(errors.ConfigError,
                                  '^--batch_sizes: expected positive integers'):
        flag_checks.positive_ints('batch_sizes', values)
    self.assertEqual(flag_checks.compute_dtypes('dtypes', ['bf16', 'float32']),
                     ['bf16', 'float32'])
    with self.assertRaisesRegex(errors.ConfigError,
                                r"^--dtypes \(float12\): invalid policy"):
      flag_checks.compute_dtypes('dtypes', ['float32', 'float12'])
    with self.assertRaisesRegex(errors.ConfigError,
                                '^--dtypes: expected at least one'):
      flag_checks.compute_dtypes('dtypes', [])

  def test_pure_bf16_is_a_variant_beside_the_dtypes(self):
    self.assertEqual(flag_checks.compute_dtypes('dtypes', ['float32', 'pure_bf16']),
                     ['float32', 'pure_bf16'])
    config = variants.in_compute_dtype(settings_lib.parse(base.get_config()),
                                       variants.PURE_BF16)
    self.assertEqual(config.precision.policy,
                     'params=bfloat16,compute=bfloat16,output=float32')
    self.assertEqual((config.precision.param_update,
                      config.precision.mu_dtype, config.precision.nu_dtype),
                     ('stochastic', 'bfloat16', 'bfloat16'))
    self.assertEqual(variants.variant_name(config), variants.PURE_BF16)
    self.assertEqual(
        variants.variant_name(settings_lib.parse(
            configs_pure_bf16.get_config())), variants.PURE_BF16)
    self.assertEqual(
        variants.variant_name(
            variants.in_compute_dtype(settings_lib.parse(base.get_config()),
                                      'bfloat16')), 'bfloat16')

  def test_4_bit_formats_are_variants_beside_the_dtypes(self):
    self.assertEqual(flag_checks.compute_dtypes('dtypes', ['bfloat16',
                                                           'nvfp4', 'mxfp4']),
                     ['bfloat16', 'nvfp4', 'mxfp4'])
    for fmt in variants.FP4_VARIANTS:
      config = variants.in_compute_dtype(settings_lib.parse(base.get_config()),
                                         fmt)
      fp8_config = config.precision.low_bit
      self.assertEqual((fp8_config.format, fp8_config.scaling,
                        fp8_config.modules),
                       (fmt, 'current', '*/encoder_block_*'))
      self.assertEqual(variants.variant_name(config), fmt)
      # Back to fp8 or none in the other variants of the same config.
      other = variants.in_compute_dtype(config, 'fp8_delayed')
      self.assertEqual(other.precision.low_bit.format, 'fp8')
      self.assertEqual(variants.variant_name(other), 'fp8_delayed')
      self.assertEqual(variants.variant_name(
          variants.in_compute_dtype(config, 'bfloat16')), 'bfloat16')

  def test_out_dir(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    flag_checks.out_dir('out', tmp)
    flag_checks.out_dir('out', os.path.join(tmp, 'new'))
    path = os.path.join(tmp, 'results.json')
    with open(path, 'w') as f:
      f.write('{}')
    with self.assertRaisesWithLiteralMatch(
        errors.ConfigError, f'--out={path} is a file, not a directory'):
      flag_checks.out_dir('out', path)
    under = os.path.join(path, 'run')
    with self.assertRaisesWithLiteralMatch(
        errors.ConfigError,
        f'--out={under} is not writable (Not a directory: {path})'):
      flag_checks.out_dir('out', under)
    with self.assertRaisesRegex(errors.ConfigError, '^--out is empty'):
      flag_checks.out_dir('out', '')


@helpers.long_running
class SweepTest(parameterized.TestCase):

  def test_sweep_fields_and_arithmetic(self):
    config = helpers.tiny_config(num_layers=1)
    result = sweep.run(settings_lib.parse(config), ('float32', 'bfloat16'),
                       (8, 16), ['pjit:8x1'],
                       num_steps=2,
                       isolate=False,
                       log=lambda _: None)
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
    # Each row is compared with the float32 row of its own batch size.
    self.assertEqual([r['vs_float32']['argument_size_in_bytes'] for r in rows],
                     [1.0, 1.0, 1.0, 1.0])
    # The batch is split over 8 devices: 8 more examples are one more
    # float32 8x8x3 image and int32 label on each device.
    self.assertEqual(rows[2]['argument_size_in_bytes'] -
                     rows[0]['argument_size_in_bytes'], 8 * 8 * 3 * 4 + 4)
    assert_writes_its_files(self, result, sweep.plot, 'sweep')


# The dtype names `jax.ad_checkpoint.print_saved_residuals` writes.
_SHORT_DTYPES = {'f32': 'float32', 'bf16': 'bfloat16', 'f16': 'float16',
                 'i32': 'int32', 'u32': 'uint32', 'bool': 'bool'}


def _printed_residuals(fn, *args) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, shape) of every residual of `fn`'s vjp, as JAX's public
  `print_saved_residuals` lists them (one line each, e.g. `bf16[8,16] ...`)."""
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  residuals = []
  for line in printed.getvalue().splitlines():
    short, dims = re.match(r'^(\w+)\[([\d,]*)\]', line).groups()
    residuals.append((_SHORT_DTYPES[short],
                      tuple(int(d) for d in dims.split(',') if d)))
  return residuals


@helpers.long_running
class MemoryTest(parameterized.TestCase):

  def test_residuals_match_jax_and_are_attributed_to_modules(self):
    config = variants.variant_settings(
        settings_lib.parse(helpers.tiny_config()), 'bfloat16', 8, 'single:1x1')
    exp = experiment.build(config)
    summary = memory.residual_summary(exp, 8)
    forward, loss_fn = exp.forward, exp.loss_fn
    batch = helpers.random_batch(config, 8)
    params = forward.init(jax.random.key(0), batch['image'], True)
    reference = _printed_residuals(
        lambda p: loss_fn(p, jax.random.key(0), batch)[0], params)
    self.assertEqual(summary['count'], len(reference))
    self.assertEqual(summary['bytes'], sum(
        math.prod(shape) * np.dtype(dtype).itemsize
        for dtype, shape in reference))
    for grouping in ('by_dtype', 'by_module_class', 'by_module'):
      self.assertEqual(sum(summary[grouping].values()), summary['kept_bytes'])
    self.assertEqual(summary['kept_bytes'],
                     summary['bytes'] - summary['param_bytes'])
    self.assertIn('vit/encoder_block_*/attention', summary['by_module'])
    self.assertGreater(summary['by_dtype']['bfloat16'],
                       summary['by_dtype']['float32'])
    rows = memory.saved_residuals(exp, 8)
    # LayerNorm computes in float32, so what it keeps is float32, except its
    # output, cast to bfloat16 for the next matmul.
    layer_norm = [r for r in rows if '/ln_' in r['module'] and
                  r['dtype'].startswith(('float', 'bfloat'))]
    self.assertEqual({(r['dtype'], r['primitive'] == 'convert_element_type')
                      for r in layer_norm},
                     {('float32', False), ('bfloat16', True)})

  def test_a_memory_progress_line_is_short_and_in_mib(self):
    result = dict(dtype='bfloat16', batch_size=128, breakdown=dict(
        params_bytes=2**21, gradient_bytes=2**21,
        float32_gradient_bytes=2**22, opt_state_bytes=2**22 + 8,
        kept_activation_bytes=3 * 2**20, temp_size_in_bytes=10 * 2**20,
        compiled_total_bytes=12 * 2**20, argument_size_in_bytes=5,
        compile_sec=3.21))
    self.assertEqual(
        memory.progress_line(result),
        'memory bfloat16 batch 128: params 2.0, gradients 2.0, optimizer '
        '4.0, activations kept 3.0, compiled temp 10.0, compiled total 12.0 '
        'MiB; compiled in 3.2s')

  def test_memory_breakdown_arithmetic(self):
    config = helpers.tiny_config(num_layers=2)
    result = memory.run(settings_lib.parse(config), ('float32', 'bfloat16'),
                        (4, 8, 16),
                        compile_step=False,
                        log=lambda _: None)
    rows = {(r['dtype'], r['batch_size']): r['breakdown']
            for r in result['results']}
    count = state_layout.param_count(experiment.build_without_data(
        settings_lib.parse(config)).abstract_state)
    for (dtype, batch_size), row in rows.items():
      self.assertEqual(row['params_bytes'], 4 * count)
      self.assertEqual(row['float32_gradient_bytes'], 4 * count)
      # Adam's mu and nu, and two int32 step counts (Adam's, the schedule's).
      self.assertEqual(row['opt_state_bytes'], 2 * 4 * count + 2 * 4)
      self.assertNotIn('temp_size_in_bytes', row)  # Not compiled.
    for dtype in ('float32', 'bfloat16'):
      kept = [rows[dtype, b]['kept_activation_bytes'] for b in (4, 8, 16)]
      # Saved activations grow linearly with the batch.
      self.assertEqual(kept[2] - kept[1], 2 * (kept[1] - kept[0]))
    by_key = {(r['dtype'], r['batch_size']): r for r in result['results']}
    for batch_size in (4, 8, 16):
      self.assertLess(
          by_key['bfloat16', batch_size]['vs_float32']['kept_activation_bytes'],
          0.8)
      self.assertEqual(by_key['float32', batch_size]['vs_float32'],
                       {'kept_activation_bytes': 1.0})

  def test_a_compiled_breakdown_holds_the_state_it_reads(self):
    config = variants.variant_settings(
        settings_lib.parse(helpers.tiny_config()), 'bfloat16', 4, 'single:1x1')
    row = memory.breakdown(config, compile_step=True)['breakdown']
    # The state is an argument of the step, donated: its bytes are an
    # output's too, aliased; what it needs at once adds the temp.
    state_bytes = row['params_bytes'] + row['opt_state_bytes']
    self.assertGreater(row['argument_size_in_bytes'], state_bytes)
    self.assertGreaterEqual(row['alias_size_in_bytes'], state_bytes)
    self.assertGreater(row['temp_size_in_bytes'], 0)
    self.assertEqual(row['compiled_total_bytes'],
                     row['argument_size_in_bytes'] +
                     row['output_size_in_bytes'] -
                     row['alias_size_in_bytes'] + row['temp_size_in_bytes'])


def _moment_bytes(config, kind: str, count: int) -> int:
  """A moment's bytes: `count` values of its dtype, or for 8-bit moments a
  byte per value and 4 per block of each param's rows."""
  if kind != 'float8_blocks':
    return count * np.dtype(kind).itemsize
  exp = experiment.build_without_data(settings_lib.parse(config))
  _, trained = meta_params.split_meta(exp.abstract_state.params)
  block = config.precision.moment_block_size
  scales = sum(math.prod(p.shape[:-1]) * -(-p.shape[-1] // block) if p.shape
               else 1 for p in jax.tree.leaves(trained))
  return count + 4 * scales


class LadderTest(absltest.TestCase):

  def test_close_labels_are_spread_apart_and_far_ones_stay(self):
    """Labels of close points (the same bytes, or within a tick's ratio)
    end at least a gap apart, in the points' order, centred on them; a
    point alone keeps its height."""
    xs = [2.0, 2.0, 2.0, 0.5625, 0.53125, 4.0]
    ys = [65.00, 64.88, 64.86, 63.73, 63.70, 65.07]
    heights = ladder.label_heights(xs, ys, gap=0.12)
    np.testing.assert_allclose(heights[3:5], [63.775, 63.655])
    self.assertEqual(heights[5], 65.07)
    near = [heights[2], heights[1], heights[0]]  # Ascending accuracy.
    np.testing.assert_array_less(0.12 - 1e-9, np.diff(near))
    self.assertAlmostEqual(np.mean(near), np.mean(ys[:3]))
    # Points already a gap apart are not moved.
    self.assertEqual(ladder.label_heights([1.0, 1.0], [60.0, 61.0], 0.5),
                     [60.0, 61.0])
    # A long label reaches a point further along: their labels are spread.
    apart = [1.0, 1.5]
    self.assertEqual(ladder.label_heights(apart, [60.0, 60.1], 0.5),
                     [60.0, 60.1])
    np.testing.assert_allclose(
        ladder.label_heights(apart, [60.0, 60.1], 0.5, ends=[2.0, 1.6]),
        [59.8, 60.3])

  def test_runs_become_points_of_accuracy_and_bytes(self):
    """Finished runs (their config.json and summary.json): two seeds of
    bfloat16 make one point, their mean; 4 bits and 8-bit moments are placed
    by what they keep, a 4-bit run with Linears kept in fp8 by the mean of
    its Linears' bytes."""
    base = helpers.tiny_config('params=float32,compute=bfloat16,'
                               'output=float32')
    runs = (('bf16_s0', 0, {}, 0.60), ('bf16_s1', 1, {}, 0.62),
            ('nvfp4', 0, {'precision.low_bit.modules': '*/encoder_block_*',
                          'precision.low_bit.format': 'nvfp4'}, 0.58),
            ('nvfp4_ablation', 0,
             {'precision.low_bit.modules': '*/encoder_block_*',
              'precision.low_bit.format': 'nvfp4', 'precision.low_bit.hadamard': False,
              'precision.low_bit.keep_fp8': '*/mlp_block/*'}, 0.57),
            # As many Linears kept in fp8, other ones: not the same variant.
            ('nvfp4_other_kept', 0,
             {'precision.low_bit.modules': '*/encoder_block_*',
              'precision.low_bit.format': 'nvfp4', 'precision.low_bit.hadamard': False,
              'precision.low_bit.keep_fp8': '*/query;*/key'}, 0.56),
            ('state8', 0, {'precision.policy': 'p=bf16,c=bf16,o=f32',
                           'precision.param_update': 'stochastic',
                           'precision.mu_dtype': 'float8_blocks',
                           'precision.nu_dtype': 'float8_blocks'}, 0.61))
    workdirs = []
    with tempfile.TemporaryDirectory() as root:
      for name, seed, changes, accuracy in runs:
        config = copy.deepcopy(base)
        config.seed = seed
        for key, value in changes.items():
          *parents, field = key.split('.')
          holder = config
          for part in parents:
            holder = holder[part]
          holder[field] = value
        workdir = os.path.join(root, name)
        # The ladder reads a run's two files; its checkpoints may be gone.
        os.makedirs(workdir)
        with open(os.path.join(workdir, 'config.json'), 'w') as f:
          f.write(config.to_json_best_effort())
        with open(os.path.join(workdir, 'summary.json'), 'w') as f:
          json.dump(dict(test_accuracy=accuracy, ema_test_accuracy=accuracy),
                    f)
        workdirs.append(workdir)
      result = ladder.run(settings_lib.parse(base),
                          workdirs,
                          log=lambda _: None)
      paths = ladder.plot(result, root)
      self.assertTrue(os.path.getsize(paths[0]))
    # A run off the 4-bit recipe is a variant of its own, not a seed.
    ablation = 'nvfp4 (no Hadamard, 2 of 6 Linears in fp8) [A]'
    other = 'nvfp4 (no Hadamard, 2 of 6 Linears in fp8) [B]'
    self.assertEqual([r['variant'] for r in result['runs']],
                     ['bfloat16', 'bfloat16', 'nvfp4', ablation, other,
                      'pure_bf16_8bit'])
    means = {m['variant']: m for m in result['variants']}
    self.assertEqual(means['bfloat16']['seeds'], 2)
    self.assertEqual((means['nvfp4']['seeds'], means[ablation]['seeds']),
                     (1, 1))
    self.assertAlmostEqual(means[ablation]['test_accuracy'], 0.57)
    self.assertAlmostEqual(means['bfloat16']['test_accuracy'], 0.61)
    self.assertEqual(means['nvfp4']['matmul_bytes'], 0.5625)
    # The tiny block's MLP holds half its Linears' weights (16x32 and 32x16
    # of 2,048), two of its attention's four 16x16 a quarter.
    self.assertEqual(means[ablation]['matmul_bytes'], (0.5625 + 1.0) / 2)
    self.assertEqual(means[other]['matmul_bytes'], 0.75 * 0.5625 + 0.25)
    self.assertEqual(means[other]['fp8_kept'],
                     ['vit/encoder_block_0/attention/query',
                      'vit/encoder_block_0/attention/key'])
    self.assertEqual(means['nvfp4']['state_bytes'],
                     means['bfloat16']['state_bytes'])
    # float32 params and moments: 12 bytes (the tiny model's LayerNorm and
    # biases change nothing); 8-bit moments with bfloat16 params: under 6.
    self.assertAlmostEqual(means['bfloat16']['state_bytes'], 12.0, places=3)
    self.assertLess(means['pure_bf16_8bit']['state_bytes'], 6.0)
    with self.assertRaisesRegex(errors.ConfigError,
                                'summary.json cannot be read'):
      ladder.run(settings_lib.parse(base), ['/nonexistent'], log=lambda _: None)
    # Without its config.json a run is never counted as --config's variant.
    with tempfile.TemporaryDirectory() as workdir:
      os.makedirs(os.path.join(workdir, 'checkpoints'))
      with open(os.path.join(workdir, 'summary.json'), 'w') as f:
        json.dump(dict(test_accuracy=0.5), f)
      with self.assertRaisesRegex(
          errors.ConfigError, r'^--workdirs: no .*config\.json; the ladder '
          r"reads each run's precision from it$"):
        ladder.run(settings_lib.parse(base), [workdir], log=lambda _: None)
      with open(os.path.join(workdir, 'config.json'), 'w') as f:
        f.write('{')
      with self.assertRaisesRegex(
          errors.ConfigError, r'^--workdirs: .*config\.json cannot be read '):
        ladder.run(settings_lib.parse(base), [workdir], log=lambda _: None)


@helpers.long_running
class StateLayoutsTest(parameterized.TestCase):

  def test_every_layout_compiled_holds_what_its_parts_add_up_to(self):
    """The compiled step's state bytes (its arguments less the batch) are
    the parts read from the state; each part is its dtype's size per
    parameter; the least is half of float32's."""
    config = helpers.tiny_config('params=float32,compute=bfloat16,'
                                 'output=float32')
    config.precision.low_bit.update(modules='*/encoder_block_*', scaling='delayed')
    lines = []
    rows = {r['layout']: r for r in state_layouts.rows(
        settings_lib.parse(config), compile_step=False, log=lines.append)}
    self.assertEqual(list(rows), list(state_layouts.LAYOUTS))
    self.assertLen(lines, len(rows))
    # Compiled: the layouts whose states differ most in kind.
    for name in ('bf16+master', 'bf16 kahan, bf16 moments',
                 'bf16 stochastic, 8-bit moments'):
      compiled = state_layouts.row(settings_lib.parse(config),
                                   name,
                                   compile_step=True)
      self.assertEqual(compiled['compiled_state_bytes'],
                       rows[name]['state_bytes'], name)
    for name, row in rows.items():
      dtype, update, mu, nu = state_layouts.LAYOUTS[name]
      sizes, count = row['bytes'], row['param_count']
      self.assertEqual(row['state_bytes'], sum(sizes.values()), name)
      self.assertEqual((row['param_update'], row['mu_dtype'], row['nu_dtype']),
                       (update, mu, nu))
      self.assertEqual(sizes['mu'], _moment_bytes(config, mu, count))
      self.assertEqual(sizes['nu'], _moment_bytes(config, nu, count))
      self.assertEqual(sizes['master'], 4 * count if (
          dtype == 'bfloat16' and update == 'master') else 0)
      self.assertEqual(sizes['compensation'],
                       sizes['params'] if update == 'kahan' else 0)
      self.assertGreater(sizes['fp8'], 0)  # Delayed scaling's histories.
      self.assertIn(f'state {name}: {row["per_parameter"]["total"]:.2f} '
                    'bytes per parameter (params ', lines[list(rows).index(name)])
    # LayerNorm's params stay float32: a little above 2 bytes.
    bf16 = rows['bf16 stochastic, bf16 moments']['per_parameter']
    self.assertBetween(bf16['params'], 2.0, 2.2)
    # 8-bit moments: a byte per value and a float32 scale per block (on the
    # tiny model's short rows, most blocks are partly padding).
    eight = rows['bf16 stochastic, 8-bit moments']['per_parameter']
    self.assertBetween(eight['mu'], 1.0, 1.5)
    self.assertLess(eight['total'] - eight['ema'], bf16['total'] - bf16['ema'])
    self.assertLess(bf16['total'] / rows['float32']['per_parameter']['total'],
                    0.55)

  def test_the_params_experiment_draws_the_state_per_layout(self):
    result = params.run(settings_lib.parse(helpers.tiny_config()),
                        log=lambda _: None)
    # Its note is the measured model's.
    count = result['totals']['float32']['count']
    self.assertLess(count, 10**5)
    self.assertEqual(result['note'], f'MB = 1e6 bytes: {count:,} float32 params'
                     f' are {4 * count / 1e6:.2f} MB ({4 * count / 2**20:.2f} '
                     'MiB).')
    self.assertEqual([r['layout'] for r in result['state_layouts']],
                     list(state_layouts.LAYOUTS))
    with tempfile.TemporaryDirectory() as out:
      paths = params.plot(result, out)
      self.assertEqual([os.path.basename(p) for p in paths],
                       ['params.png', 'params_state_layouts.png'])
      self.assertTrue(all(os.path.getsize(p) > 0 for p in paths))


@helpers.long_running
class RoundingTest(absltest.TestCase):

  def test_nearest_drops_the_small_updates_stochastic_keeps_them(self):
    """Three steps from init at a learning rate of 1e-4: Adam's steps are
    ~1e-4 per weight, below half the bfloat16 spacing of most weights (2**-9 of
    them), so rounding to nearest loses most of the weights' update;
    stochastic rounding loses none on average. Zero biases take every
    update."""
    config = helpers.tiny_config(
        'params=bfloat16,compute=bfloat16,output=float32')
    config.learning_rate = 1e-4
    config.batch_size = 8
    config.data.source = 'synthetic'
    config.num_train_steps = 10
    config.precision.param_update = 'nearest'
    config.advisor.init_steps = 3
    lines = []
    result = lost_updates.run(settings_lib.parse(config),
                              num_batches=2,
                              log=lines.append)
    groups = {r['name']: r for r in result['groups']}
    count = state_layout.param_count(
        experiment.build_without_data(
            settings_lib.parse(config)).abstract_state)
    self.assertEqual(sum(r['elements'] for r in result['groups']), 2 * count)
    self.assertEqual(result['total']['elements'], 2 * count)
    for name in ('attention weights', 'MLP weights'):
      self.assertGreater(groups[name]['lost_nearest'], 0.5, name)
      self.assertGreater(groups[name]['below_half_ulp'], 0.5, name)
    self.assertLess(abs(groups['biases']['lost_nearest']), 0.01)
    self.assertLess(abs(result['total']['lost_stochastic']),
                    0.5 * result['total']['lost_nearest'])
    self.assertLen(lines, 1 + len(groups))
    self.assertIn('| all params |', lost_updates.table(result))
    assert_writes_its_files(self, result, lost_updates.plot, 'rounding')


@helpers.long_running
class PrecisionExperimentTest(parameterized.TestCase):

  def test_precision_aliases_errors_and_residual_stream(self):
    # No dropout: five train steps to compile, each smaller without its
    # random bits (the errors are measured without it either way).
    config = helpers.tiny_config(num_layers=1, dropout_rate=0.0)
    config.batch_size = 8
    result = precision_lab.run(settings_lib.parse(config),
                               ('float32', 'bfloat16'),
                               ('', 'highest', 'float32', 'bfloat16'),
                               num_steps=1,
                               numerics_batch_size=8,
                               isolate=False,
                               log=lambda _: None)
    rows = {(r['dtype'], r['matmul_precision']): r for r in result['matmul']}
    self.assertLen(rows, 8)
    for dtype in ('float32', 'bfloat16'):
      self.assertIsNone(rows[dtype, '(jax default)']['same_program_as'])
      self.assertIsNone(rows[dtype, 'highest']['same_program_as'])
      # Aliases lower to the very same program, so they are measured once.
      self.assertEqual(rows[dtype, 'bfloat16']['same_program_as'],
                       '(jax default)')
      self.assertEqual(rows[dtype, 'float32']['same_program_as'], 'highest')
      self.assertNotEqual(rows[dtype, 'highest']['program_sha256'],
                          rows[dtype, '(jax default)']['program_sha256'])
    full = rows['float32', '(jax default)']
    half = rows['bfloat16', '(jax default)']
    self.assertLess(full['grads_relative_error'], 1e-5)
    self.assertGreater(half['grads_relative_error'], 1e-3)
    self.assertLess(half['grads_relative_error'], 0.1)
    self.assertGreater(full['logits_max_abs_error'], 0)  # Not the reference.
    # XLA:CPU ignores matmul precision: both are one program's arithmetic,
    # on any CPU kind.
    if jax.default_backend() == 'cpu':
      self.assertEqual(full['grads_relative_error'],
                       rows['float32', 'highest']['grads_relative_error'])
    self.assertEqual(result['loss_scale'], [])  # No float16 asked for.
    residual = {(r['dtype'], r['residual_stream']): r
                for r in result['residual']}
    self.assertEqual(set(residual), {('float32', 'compute'),
                                     ('bfloat16', 'compute'),
                                     ('bfloat16', 'float32')})
    f32_stream = residual['bfloat16', 'float32']
    self.assertNotEqual(f32_stream['program_sha256'],
                        residual['bfloat16', 'compute']['program_sha256'])
    # Grouped by dtype: bfloat16's rows against bfloat16's compute stream (the
    # first compute row of the list is float32's).
    self.assertEqual(residual['bfloat16', 'compute']['vs_compute_stream'],
                     {'kept_activation_bytes': 1.0, 'temp_size_in_bytes': 1.0,
                      'median_step_sec': 1.0})
    self.assertIsNotNone(f32_stream['vs_compute_stream'])

  def test_float16_gradients_are_computed_under_the_loss_scale(self):
    config = helpers.tiny_config(num_layers=1)
    ref = precision_lab.reference(settings_lib.parse(config), 8)
    errors = {}
    for kind, initial in (('none', 1), ('dynamic', 2**15), ('static', 2**24)):
      variant = settings_lib.replace(
          variants.variant_settings(settings_lib.parse(config), 'float16', 8,
                                    'single:1x1'),
          loss_scale=dict(kind=kind, initial=initial))
      errors[kind] = precision_lab.error_vs(variant, ref, 8)['grads_relative_error']
    self.assertLess(errors['none'], 1e-2)
    self.assertLess(errors['dynamic'], 1e-2)
    # 2**24 x the logits' cotangent is past float16's 65504: the scale really
    # multiplies the float16 backward pass.
    self.assertFalse(np.isfinite(errors['static']))


class ProfileTest(parameterized.TestCase):

  def test_profile_traces_each_step(self):
    """What the profile promises, whichever op happens to be slowest."""
    out = self.enter_context(tempfile.TemporaryDirectory())
    config = helpers.tiny_config()
    config.batch_size = 8
    num_steps = 3
    result = profile.run(settings_lib.parse(config), out, num_steps=num_steps)
    self.assertEqual(result['traced_steps'], num_steps)
    self.assertLen(result['step_ms'], num_steps)
    self.assertTrue(any(f.endswith('.xplane.pb') for f in result['files']))
    for f in result['files']:
      self.assertGreater(os.path.getsize(os.path.join(out, f)), 100)
    self.assertIn(result['log_dir'], result['open_with'][0])
    top = result['top_ops']
    self.assertBetween(len(top), 1, profile.TOP_OPS)
    times = [op['self_ms'] for op in top]
    self.assertEqual(times, sorted(times, reverse=True))
    for op in top:
      self.assertEqual(set(op), {'hlo_op', 'self_ms', 'calls', 'op_name',
                                 'inside', 'module'})
      self.assertEqual(op['calls'] % num_steps, 0, op)  # The same every step.
      if op['op_name']:  # Fused ops join their names with ';'.
        for name in op['op_name'].split(';'):
          self.assertStartsWith(name, 'jit(train_step)/')
        self.assertNotEqual(op['module'], profile.NO_OP_NAME)
      elif not op['inside']:
        self.assertEqual(op['module'], profile.NO_OP_NAME)
    by_module = result['ms_per_step_by_module']
    self.assertContainsSubset({'vit/encoder_block_*/attention',
                               'vit/encoder_block_*/mlp_block/fc1'}, by_module)
    # Every op is counted once, in one module (values are rounded to 1 us).
    self.assertAlmostEqual(sum(by_module.values()), result['op_ms_per_step'],
                           delta=1e-3 * len(by_module))
    # The ops ran inside the traced steps, and a loop's body is not counted
    # twice (then the self times would add up to less than the busy time).
    self.assertLessEqual(result['busy_ms_per_step'] * num_steps,
                         sum(result['step_ms']) + 1e-6)
    self.assertLessEqual(result['busy_ms_per_step'],
                         result['op_ms_per_step'] + 1e-6)
    self.assertNotEmpty(profile.plot(result, out))
    assert_writes_its_files(self, result, profile.plot, 'profile')

  def test_profile_self_time_of_nested_ops(self):
    def op(name, ts, dur, tid=1):
      return dict(ph='X', name=name, ts=ts, dur=dur, pid=7, tid=tid,
                  args=dict(hlo_op=name))

    # A loop [0, 10) runs body ops [2, 5) and [5, 8); another thread runs a
    # fusion [1, 4) at the same time and a copy [20, 21) later.
    ops = [op('while.1', 0, 10), op('copy.2', 2, 3), op('copy.3', 5, 3),
           op('fusion.4', 1, 3, tid=2), op('copy.5', 20, 1, tid=2)]
    self.assertEqual(profile.nesting(ops), [(4, ''), (3, 'while.1'),
                                             (3, 'while.1'), (3, ''), (1, '')])
    self.assertEqual(profile.busy_us(ops), 11)
    modules = {'vit', 'vit/encoder_block_0/mlp_block'}
    names = {'while.1': 'jit(train_step)/jvp(vit)/encoder_block_0/mlp_block/'
                        'jit(_bernoulli)/while',
             'fusion.4': 'jit(train_step)/add', 'copy.2': '', 'copy.3': '',
             'copy.5': ''}
    rows = {r['hlo_op']: r for r in profile.ops_by_self_time(ops, names,
                                                              modules)}
    self.assertEqual(rows['copy.2']['module'], 'vit/encoder_block_*/mlp_block')
    self.assertEqual(rows['fusion.4']['module'], profile.OUTSIDE_MODEL)
    self.assertEqual(rows['copy.5']['module'], profile.NO_OP_NAME)
    self.assertEqual(profile.ms_per_step_by_module(rows.values(), num_steps=1), {
        'vit/encoder_block_*/mlp_block': 10.0 / 1e3,
        profile.OUTSIDE_MODEL: 3 / 1e3, profile.NO_OP_NAME: 1 / 1e3})

  def test_profile_reads_gpu_kernels(self):
    """A GPU trace: kernels on a device stream, fusions inside a CUDA graph
    named after their HLO op, a cuBLAS kernel in the graph that names none, a
    cuDNN kernel outside it; host events are not ops."""
    hlo = '\n'.join([
        '  %loop_add_fusion.9 = f32[8] fusion(%p), kind=kLoop, '
        'metadata={op_name="jit(train_step)/jvp(vit)/encoder_block_0/add"}',
        '  %wrapped_transpose = f32[8] fusion(%q), kind=kLoop',
        '  ROOT %cudnn-conv.3 = (bf16[8], u8[0]) custom-call(%r), '
        'metadata={op_name="jit(train_step)/jvp(vit)/patch_embed/conv/x"}'])
    names = profile.hlo_op_names(hlo)
    self.assertEqual(names, {
        'loop_add_fusion.9': 'jit(train_step)/jvp(vit)/encoder_block_0/add',
        'wrapped_transpose': '',
        'cudnn-conv.3': 'jit(train_step)/jvp(vit)/patch_embed/conv/x'})

    def event(name, ts, dur, hlo_op, pid=1, tid=14):
      return dict(ph='X', pid=pid, tid=tid, ts=ts, dur=dur, name=name,
                  args=dict(hlo_op=hlo_op, hlo_module='jit_train_step'))

    events = [
        dict(ph='M', pid=1, name='process_name',
             args=dict(name='/device:GPU:0')),
        dict(ph='M', pid=7, name='process_name', args=dict(name='/host:CPU')),
        # Two graph kernels that overlap on one stream: neither is inside
        # the other.
        event('loop_add_fusion_9', 0, 4, 'command_buffer_1'),
        event('nvjet_sm90_tst_96x128', 1, 2, 'command_buffer_1'),
        event('wrapped_transpose', 5, 1, 'command_buffer_1'),
        event('void convolve_common_engine<bf16>', 10, 3, 'cudnn-conv.3'),
        event('Wait for donation holds', 0, 20, 'x', pid=7),
        event('fusion.1', 0, 20, 'fusion.1', pid=7),
    ]
    ops = profile.op_events(events, names)
    self.assertEqual([op['name'] for op in ops],
                     ['loop_add_fusion.9', 'nvjet_sm90_tst_96x128',
                      'wrapped_transpose', 'cudnn-conv.3'])
    modules = {'vit', 'vit/encoder_block_0', 'vit/patch_embed/conv'}
    rows = {r['hlo_op']: r for r in profile.ops_by_self_time(ops, names,
                                                              modules)}
    self.assertEqual({op: (r['self_ms'], r['module'])
                      for op, r in rows.items()}, {
        'loop_add_fusion.9': (4e-3, 'vit/encoder_block_*'),
        'nvjet_sm90_tst_96x128': (2e-3, profile.LIBRARY_KERNEL),
        'wrapped_transpose': (1e-3, profile.NO_OP_NAME),
        'cudnn-conv.3': (3e-3, 'vit/patch_embed/conv')})
    self.assertEqual(profile.busy_us(ops), 8)


@helpers.long_running
class CommandLineTest(parameterized.TestCase):

  def test_command_line_writes_json_and_png(self):
    out = self.enter_context(tempfile.TemporaryDirectory())
    results = {}
    for args in (['params', '--config=configs/vit_fp32.py',
                  '--config.model.num_layers=1'],
                 ['matmul', '--rows=8', '--cols=32', '--repeats=1'],
                 ['dot_algorithms', '--size=8', '--repeats=1'],
                 # Compiled variants and layouts, the sweep, the profile and
                 # the rounding: their study's result, JSON and plots
                 # in-process (SweepTest, ProfileTest, RoundingTest,
                 # assert_writes_its_files); every command shares this main.
                 ['memory', *TINY_FLAGS, '--batch_sizes=2', '--dtypes=bfloat16',
                  '--nocompile']):
      done = helpers.run_module('launch.lab', *args, f'--out={out}',
                                check=True)
      with open(os.path.join(out, f'{args[0]}.json')) as f:
        result = json.load(f)
      results[args[0]] = result
      self.assertEqual(result['experiment'], args[0])
      written = result['plots'] + result.get('files', [])
      self.assertNotEmpty(written)
      for path in written:
        self.assertGreater(os.path.getsize(os.path.join(out, path)), 100)
      self.assertNotIn('truncated', done.stderr)
    # The note counts the one-block model measured.
    count = results['params']['totals']['float32']['count']
    self.assertIn(f' {count:,} float32 params', results['params']['note'])
    # float64 really measured: x64 on, in a process of its own.
    f64 = next(r for r in results['dot_algorithms']['results']
               if r['algorithm'] == 'F64_F64_F64')
    self.assertEqual((f64['operand_dtype'], f64['result_dtype'], f64['x64']),
                     ('float64', 'float64', True))
    self.assertLess(f64['relative_error'], 1e-12)
    for row in results['dot_algorithms']['results']:
      self.assertEqual(row['x64'], row is f64)

  def test_advise_from_init_and_from_a_run_leaves_the_run_as_it_was(self):
    out = self.enter_context(tempfile.TemporaryDirectory())
    # bfloat16 with a dynamic loss scale (from 2**15) and fp8 on one Linear:
    # the low-bit advice judges the config's low-bit Linears, one here, not
    # the six of a config that runs none (as float16 must), whose fp8 and
    # 4-bit statistics programs were most of what the commands compiled.
    # No dropout: smaller programs, and nothing here reads its noise. The
    # run's 2 steps are every command's schedule: the advice from the run
    # then loads the config's train step (its cost) the first compiled.
    flags = ('--config=configs/vit_bf16.py', *TINY_FLAGS,
             '--config.model.dropout_rate=0', '--config.data.source=synthetic',
             '--config.batch_size=4', '--config.loss_scale.kind=dynamic',
             '--config.precision.low_bit.modules=*/mlp_block/fc1',
             '--config.num_train_steps=2')
    done = helpers.run_module('launch.lab', 'advise', *flags, '--batches=2',
                              '--level=knockout', '--steps=1',
                              '--config.advisor.init_steps=3',
                              f'--out={out}/init', check=True)
    with open(os.path.join(out, 'init', 'advise.json')) as f:
      result = json.load(f)
    self.assertEqual(result['params_from'], 'init + 3 float32 steps')
    self.assertEqual(result['loss_scales_seen'], [2.0**15, 2.0**15])
    lo, hi = result['float16_window']['exponents']
    self.assertLessEqual(lo, hi)
    paths = {row['path'] for row in result['modules']}
    self.assertIn('vit/encoder_block_0/mlp_block/fc1', paths)
    judged = [r['path'] for r in result['knockout']['bfloat16']]
    self.assertCountEqual(judged, [r['path'] for r in result['modules']
                                   if not r['same_as']])
    self.assertGreater(result['cost']['ratio'], 0)
    for name in ('advise.md', 'advise_histograms.png'):
      self.assertGreater(os.path.getsize(os.path.join(out, 'init', name)), 500)
    pasted = result['suggestions']['float16']['flags']
    self.assertIn('float16: ' + ' '.join(pasted), done.stdout)
    # One table and one line of flags per low-bit format, from one pipeline.
    self.assertEqual((result['fp8']['choice'], result['fp4']['choice']),
                     ('current', 'nvfp4'))
    for name in ('fp8', 'fp4'):
      self.assertEqual([r['path'] for r in result[name]['modules']],
                       ['vit/encoder_block_0/mlp_block/fc1'])
    for name, title in (('fp8', 'fp8'), ('fp4', '4 bits')):
      flags_line = ' '.join(result[name]['suggestion']['flags'])
      self.assertIn(f"{title} ({result[name]['choice']}): {flags_line}",
                    done.stdout)
    with open(os.path.join(out, 'init', 'advise.md')) as f:
      page = f.read()
    self.assertIn('| Linear | current | delayed | mx |', page)
    self.assertIn('| Linear | nvfp4 | mxfp4 |', page)
    # From a run's checkpoint: its params and loss scale, its files untouched;
    # its config.json gives the model, data, batch, loss scale and low-bit
    # Linears (no flag repeated), a flag on the command line wins (a
    # threshold, which changes no program).
    workdir = os.path.join(out, 'run')
    helpers.run_module('launch.train', *flags, f'--workdir={workdir}',
                       '--config.loss_scale.initial=1024', check=True)
    before = {p: os.path.getmtime(os.path.join(root, p))
              for root, _, files in os.walk(workdir) for p in files}
    done = helpers.run_module('launch.lab', 'advise', '--batches=1',
                              '--steps=1', f'--checkpoint={workdir}',
                              '--config.advisor.max_relative_error=0.02',
                              f'--out={out}/run_advice', check=True)
    self.assertIn(f'the config of {workdir}/config.json; from the command '
                  'line: --config.advisor.max_relative_error', done.stdout)
    with open(os.path.join(out, 'run_advice', 'advise.json')) as f:
      result = json.load(f)
    self.assertEqual(result['params_from'], f'checkpoint {workdir} step 2')
    self.assertEqual(result['start_step'], 2)
    self.assertEqual(result['loss_scales_seen'], [1024.0])
    self.assertEqual((result['config']['model']['embed_dim'],
                      result['config']['data']['source'],
                      result['config']['policy'],
                      result['config']['batch_size']),
                     (16, 'synthetic',
                      'params=float32,compute=bfloat16,output=float32', 4))
    self.assertEqual([r['path'] for r in result['fp4']['modules']],
                     ['vit/encoder_block_0/mlp_block/fc1'])
    self.assertEqual(result['thresholds']['max_relative_error'], 0.02)
    after = {p: os.path.getmtime(os.path.join(root, p))
             for root, _, files in os.walk(workdir) for p in files}
    self.assertEqual(after, before)

  @parameterized.parameters(
      (['sweepp'], "expected one command of ('params', 'sweep', 'memory', "
       "'precision', 'profile', 'fp8', 'rounding', 'ladder', 'communication', "
       "'speed', 'gemm', 'matmul', 'dot_algorithms', 'step_compile', 'report', "
       "'advise')"),
      (['advise', '--batches=0'], '--batches=0 must be at least 1'),
      (['advise', '--level=deep'],
       "--level: unknown value 'deep'; expected one of"),
      (['advise', '--checkpoint=/nonexistent'],
       '--checkpoint=/nonexistent: no checkpoints directory in it'),
      (['advise', '--config.advisor.max_relative_error=2'],
       'advisor.max_relative_error=2 must be in [0, 1]'),
      (['advise', '--config.advisor.fp8_max_underflow_share=2'],
       'advisor.fp8_max_underflow_share=2 must be in [0, 1]'),
      (['ladder'], '--workdirs: the ladder takes finished launch.train '
       'workdirs'),
      (['advise', '--config.advisor.fp4_max_flushed_share=-0.5'],
       'advisor.fp4_max_flushed_share=-0.5 must be in [0, 1]'),
      (['advise', '--config.advisor.loss_scale_headroom=0.5'],
       'advisor.loss_scale_headroom=0.5 must be >= 1'),
      (['advise', '--config.advisor.init_steps=-1'],
       'advisor.init_steps=-1 must be >= 0'),
      (['report', '--parts=matmul,fastest'],
         "--parts: unknown part 'fastest'"),
      (['report', '--seeds=0,one'], "--seeds: expected integers, got '0,one'"),
      (['dot_algorithms', '--size=0'], '--size=0 must be at least 1'),
      (['matmul', '--repeats=0'], '--repeats=0 must be at least 1'),
      (['sweep', '--dtypes=float32,float12'],
       '--dtypes (float12): invalid policy string'),
      (['sweep', '--batch_sizes=128,0'], '--batch_sizes'),
      (['sweep', '--layouts=pjit:3x1'], 'parallel.mesh_shape=(3, 1)'),
      (['sweep', '--layouts=pjit'], "bad layout 'pjit'"),
      (['precision', '--matmul_precisions=fast'],
       "precision.matmul_precision: unknown value 'fast'"))
  def test_bad_input_one_line_error(self, args, message):
    out = self.enter_context(tempfile.TemporaryDirectory())
    bad = helpers.run_module('launch.lab', *args, f'--out={out}/lab')
    self.assertNotEqual(bad.returncode, 0, bad.stderr[-2000:])
    self.assertNotIn('Traceback', bad.stderr)
    self.assertIn(message, bad.stderr.strip().splitlines()[-1])
    self.assertFalse(os.path.exists(f'{out}/lab'))


if __name__ == '__main__':
  absltest.main()
