"""Will fp8 make my model faster: the speed model (`haiku_mp.advisor.speed`,
`gpus`, `placement`), the step's program as a GPU would run it
(`lab.studies.step_program`), `launch.lab speed` and `gemm`, fp8 placed
where it pays (`precision.low_bit.modules=auto`), and the model held to
every GPU figure measured (docs/speed.md)."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json
import math
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from configs import vit_bf16
from configs import vit_fp16
from configs import vit_fp32
from configs import vit_fp8
from configs import vit_recipe
from haiku_mp import errors
from haiku_mp.advisor import gpus
from haiku_mp.advisor import placement
from haiku_mp.advisor import speed
from haiku_mp.lab.advisor import low_bit_advice
from haiku_mp.lab.studies import gemm as gemm_study
from haiku_mp.lab.studies import one_linear
from haiku_mp.lab.studies import step_program
from haiku_mp.lab.studies import step_time
from haiku_mp.lab.studies import step_time_report
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

A = gpus.Assumptions()
H100, H200, B200, A100 = (gpus.gpu(n) for n in ('h100', 'h200', 'b200',
                                                'a100'))
# Every figure measured on a GPU that the model is held to
# (docs/benchmarks/gpu.md): the H100 sweep's median step, ms.
H100_SWEEP_MS = {
    ('fp32', 128): 9.99, ('bf16', 128): 6.22, ('fp16', 128): 6.14,
    ('fp32', 1024): 62.57, ('bf16', 1024): 33.43, ('fp16', 1024): 33.49,
    ('fp32', 4096): 236.15, ('bf16', 4096): 126.83, ('fp16', 4096): 126.68}
# The H100 profile of one bf16 step at batch 128: wall and kernels busy, ms.
H100_PROFILE_MS = dict(wall=8.3, busy=5.0)
# The seeds' `jnp.dot(A, A.T)`, A 1024 x 65536 in bfloat16 on the H100.
SEEDS_DOT_TFLOPS = 377.1
# The H200 recipe (`vit_recipe.py:bf16`, batch 128, the whole loop).
H200_RECIPE_IMAGES_PER_SEC = 15386
# The band every measured time is held to.
TIME_BAND = 0.25
_CONFIGS = dict(fp32=vit_fp32, bf16=vit_bf16, fp16=vit_fp16)


def _tiny(**changes):
  config = helpers.tiny_config('p=f32,c=bf16,o=f32')
  config.data.source = 'synthetic'
  config.batch_size = 8
  config.eval_batch_size = 8
  for key, value in changes.items():
    node = config
    *path, leaf = key.split('.')
    for part in path:
      node = node[part]
    node[leaf] = value
  return settings_lib.parse(config)


def _lowered(fn, *args) -> str:
  return step_program.lower_for_gpu(jax.jit(fn), *args)


class GpusTest(parameterized.TestCase):

  def test_a_gpu_by_name_and_an_unknown_one_in_one_line(self):
    self.assertEqual(gpus.gpu('h200').memory_bandwidth, 4.8e12)
    self.assertEqual(gpus.gpu('h100').peaks, gpus.gpu('h200').peaks)
    with self.assertRaisesRegex(errors.ConfigError,
                                r"^gpu: unknown value 'h300'; expected one "
                                r"of \('a100', 'h100', 'h200', 'b200'\)$"):
      gpus.gpu('h300')
    self.assertEqual(gpus.detect('NVIDIA H100 80GB HBM3'), 'h100')
    self.assertEqual(gpus.detect('NVIDIA H200'), 'h200')
    self.assertEqual(gpus.detect('cpu'), '')

  @parameterized.parameters(
      ('a100', ('bf16',)),
      ('h100', ('bf16', 'fp8_current', 'fp8_delayed')),
      ('b200', ('bf16', 'fp8_current', 'fp8_delayed', 'mxfp8', 'nvfp4',
                'mxfp4')))
  def test_the_formats_each_gpu_has_tensor_cores_for(self, name, formats):
    gpu = gpus.gpu(name)
    self.assertEqual(speed.formats_on(gpu), formats)
    seconds = speed.linear_seconds(8192, 4096, 4096, gpu)
    for fmt in speed.FORMATS:
      self.assertEqual(seconds['fprop'][fmt] is None, fmt not in formats)


class GemmModelTest(absltest.TestCase):

  def test_a_large_gemm_runs_at_the_achieved_peak(self):
    g = speed.gemm(8192, 8192, 8192, 'bf16', H100, A, 2, 2)
    self.assertEqual(g.bound, 'compute')
    tiles = (8192 // A.tile) ** 2
    busy = tiles / (math.ceil(tiles / H100.sms) * H100.sms)
    self.assertAlmostEqual(
        g.seconds, g.flops / (H100.peaks['bf16'] * A.gemm_efficiency * busy)
        + A.kernel_seconds, delta=1e-12)
    fp8 = speed.gemm(8192, 8192, 8192, 'fp8', H100, A, 1, 2)
    self.assertAlmostEqual((g.seconds - A.kernel_seconds) /
                           (fp8.seconds - A.kernel_seconds),
                           H100.peaks['fp8'] / H100.peaks['bf16'], places=9)

  def test_a_weight_gradients_few_tiles_split_k_and_a_quarter_full_do_not(self):
    # 3 x 3 tiles, K of 266,240 tokens: split over the idle SMs.
    split = speed.wave_efficiency(384, 266240, 384, 1, H100, A)
    self.assertGreater(split, 0.9)
    # The seeds' dot: 8 x 8 tiles fill half the SMs, one wave, no split.
    self.assertAlmostEqual(speed.wave_efficiency(1024, 65536, 1024, 1, H100,
                                                 A), 64 / 132)

  def test_small_k_with_a_float32_output_is_memory_bound(self):
    g = speed.gemm(266240, 48, 384, 'bf16', H100, A, 2, 4)
    self.assertEqual(g.bound, 'memory')
    moved = (266240 * 48 + 48 * 384) * 2 + 266240 * 384 * 4
    self.assertEqual(g.bytes, moved)
    self.assertAlmostEqual(g.seconds, moved / (H100.memory_bandwidth *
                                               A.memory_efficiency) +
                           A.kernel_seconds)
    self.assertEqual(speed.gemm(8, 8, 8, 'bf16', H100, A, 2, 2).bound,
                     'overhead')

  def test_delayed_scaling_saves_one_amax_read_per_tensor(self):
    m, k, n = 4096, 1024, 2048
    current = [speed.adds('fp8_current', p, m, k, n) for p in speed.PASSES]
    delayed = [speed.adds('fp8_delayed', p, m, k, n) for p in speed.PASSES]
    self.assertEqual(sum(a.bytes for a in current) -
                     sum(a.bytes for a in delayed), 2 * (m * k + k * n + m * n))
    self.assertEqual(sum(a.kernels for a in current) -
                     sum(a.kernels for a in delayed), 3)
    # The project's path: three amaxes, three casts, three transposes, three
    # scale kernels.
    self.assertEqual(sum(a.kernels for a in current), 12)

  def test_fp8_pays_on_large_linears_and_loses_on_the_reference_vits(self):
    self.assertGreater(speed.gain(16384, 8192, 16384, 'fp8_current', H100), 1)
    for k, n in ((384, 384), (384, 1536), (1536, 384)):
      self.assertLess(speed.gain(8320, k, n, 'fp8_current', H100), 1)
    self.assertIsNone(speed.gain(16384, 8192, 16384, 'fp8_current', A100))


class PlacementTest(absltest.TestCase):

  def test_torchaos_rule_as_its_code_reads_a_torch_weight(self):
    # K inputs, N outputs: torchao's `K, N = weight.shape` is (out, in).
    self.assertTrue(placement.torchao_pays(1536, 384))
    self.assertFalse(placement.torchao_pays(384, 1536))
    self.assertFalse(placement.torchao_pays(1024, 4096))
    self.assertTrue(placement.torchao_pays(1024, 4112))
    self.assertFalse(placement.torchao_pays(2056, 9000))  # Not % 16.

  def test_the_model_chooses_each_linear_by_its_predicted_gain(self):
    layers = [placement.LinearShape('big', 16384, 8192, 16384),
              placement.LinearShape('small', 8320, 384, 384)]
    big, small = placement.choose(layers, 'fp8_current', 'h100')
    self.assertTrue(big.low_bit)
    self.assertFalse(small.low_bit)
    self.assertEqual(big.gain, speed.gain(16384, 8192, 16384, 'fp8_current',
                                          H100))
    self.assertIn('0.', small.why('fp8_current'))
    self.assertIn('predicted in fp8_current on the h100',
                  small.why('fp8_current'))
    # No MX tensor cores on an H100, no fp8 on an A100: nothing runs them.
    self.assertFalse(any(c.low_bit for c in placement.choose(layers, 'mxfp8',
                                                             'h100')))
    self.assertFalse(any(c.low_bit for c in placement.choose(
        layers, 'fp8_current', 'a100')))
    rule = placement.choose(layers, 'fp8_current')
    self.assertEqual([c.low_bit for c in rule], [True, False])
    self.assertIsNone(rule[0].gain)
    with self.assertRaisesRegex(errors.ConfigError, r"^fmt: unknown value"):
      placement.choose(layers, 'fp16')


class StepProgramTest(absltest.TestCase):

  def test_an_elementwise_chain_is_one_kernel_reading_each_input_once(self):
    a = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    program = step_program.read(_lowered(
        lambda a, b, c: jnp.exp(a) * b + c * a, a, a, a))
    self.assertEmpty(program.matmuls)
    size = 1024 * 256 * 4
    self.assertEqual(program.traffic.kernels, 1)
    self.assertEqual(program.traffic.bytes, 4 * size)  # 3 reads, 1 write.

  def test_a_reduction_fuses_the_work_before_it(self):
    a = jax.ShapeDtypeStruct((1024, 256), jnp.float32)
    program = step_program.read(_lowered(lambda a: jnp.sum(jnp.exp(a) * a),
                                         a))
    self.assertEqual(program.traffic.by_kind['reduction'],
                     {'bytes': 1024 * 256 * 4 + 4, 'kernels': 1})
    self.assertNotIn('loop', program.traffic.by_kind)

  def test_a_linears_three_matmuls_and_its_epilogue(self):
    x = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((128,), jnp.float32)

    def loss(x, w, b):
      y = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
      return jnp.sum(jax.nn.gelu((y + b).astype(jnp.bfloat16)))

    program = step_program.read(_lowered(jax.grad(loss, (0, 1)), x, w, b))
    shapes = sorted((m.m, m.k, m.n) for m in program.matmuls)
    # fprop 512x64x128, dgrad 512x128x64, wgrad 64x512x128 (in some order of
    # operands, which may transpose M and N).
    self.assertLen(shapes, 3)
    self.assertEqual(sorted(m.flops for m in program.matmuls),
                     [2.0 * 512 * 64 * 128] * 3)
    fprop = next(m for m in program.matmuls if m.lhs_shape == (512, 64))
    # float32 sums, the bias and the cast folded: the GEMM writes bfloat16.
    self.assertEqual(fprop.out, 'bf16')


class SpeedStudyTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.settings = _tiny()
    # One lowering for every GPU: the program is the same on each.
    cls.lowered = step_time.lower_step(cls.settings, log=lambda _: None)
    cls.result = step_time.run(cls.settings, 'h100', log=lambda _: None,
                               lowered=cls.lowered)

  def test_each_linear_has_its_three_passes_in_every_format(self):
    result = self.result
    self.assertEqual(result['formats'], ['bf16', 'fp8_current',
                                         'fp8_delayed'])
    linears = [r for r in result['matmuls'] if r['linear']]
    by_name = {}
    for row in linears:
      by_name.setdefault(row['name'], []).append(row['pass'])
      self.assertEqual(set(row['seconds']), set(result['formats']))
      for key in ('name', 'pass', 'm', 'k', 'n'):
        self.assertIn(key, row)
    self.assertNotEmpty(by_name)
    for name, passes in by_name.items():
      self.assertCountEqual(passes, ['fprop', 'dgrad', 'wgrad'], name)
    # The low-bit Linears: the encoder blocks' (fp8's default), not the head.
    self.assertEqual(result['low_bit_linears'],
                     sorted(n for n in by_name if 'encoder_block' in n))
    for row in linears:
      if not row['low_bit']:
        self.assertLen(set(row['seconds'].values()), 1)

  def test_the_step_is_its_matmuls_and_the_rest(self):
    result = self.result
    rest = result['rest']
    self.assertGreater(rest['kernels'], 0)
    self.assertAlmostEqual(rest['seconds'], speed.streamed(
        rest['bytes'], rest['kernels'], H100, A))
    for fmt in result['formats']:
      total = sum(r['seconds'][fmt] for r in result['matmuls'])
      self.assertAlmostEqual(result['step']['seconds'][fmt],
                             total + rest['seconds'], delta=1e-12)
      self.assertAlmostEqual(result['step']['images_per_second'][fmt],
                             8 / result['step']['seconds'][fmt])
    self.assertEqual(result['step']['speedup']['bf16'], 1.0)
    # Every FLOP of the forward pass three times over.
    forward = sum(r['flops'] for r in result['matmuls'] if r['pass'] == 'fprop'
                  and r['name'] != 'vit/patch_embed/conv')
    backward = sum(r['flops'] for r in result['matmuls']
                   if r['pass'] != 'fprop' and r['name'] !=
                   'vit/patch_embed/conv')
    self.assertAlmostEqual(backward, 2 * forward)
    json.dumps(result)

  def test_where_it_pays_is_the_runs_choice(self):
    result = self.result
    for fmt, placed in result['where_it_pays'].items():
      paying = [g['name'] for g in result['linears'] if g['gain'][fmt] > 1]
      self.assertEqual(placed['linears'], sorted(paying))
      if not paying:
        self.assertEqual(placed['seconds'], result['step']['seconds']['bf16'])
    layers = [placement.LinearShape(g['name'], g['m'], g['k'], g['n'])
              for g in result['linears']]
    for choice, g in zip(placement.choose(layers, 'fp8_current', 'h100'),
                         result['linears']):
      self.assertEqual(choice.gain, g['gain']['fp8_current'])

  def test_blackwell_adds_its_block_formats_and_an_a100_only_bf16(self):
    b200 = step_time.run(self.settings, 'b200', log=lambda _: None,
                         lowered=self.lowered)
    self.assertEqual(b200['formats'], list(speed.formats_on(B200)))
    a100 = step_time.run(self.settings, 'a100', log=lambda _: None,
                         lowered=self.lowered)
    self.assertEqual(a100['formats'], ['bf16'])
    self.assertEqual(a100['where_it_pays'], {})
    # A lowering is only read for the settings and batch it was made of.
    with self.assertRaisesRegex(ValueError, '^lowered: not the step'):
      step_time.run(self.settings, 'a100', 64, log=lambda _: None,
                    lowered=self.lowered)

  def test_one_linear_alone_and_the_table_and_plot(self):
    one = one_linear.one_gemm((4096, 8192, 16384), 'h100')
    [row] = one['matmuls']
    self.assertEqual((row['pass'], row['m'], row['k'], row['n']),
                     ('fprop', 4096, 8192, 16384))
    for fmt in one['formats']:
      self.assertAlmostEqual(
          one['linear']['seconds'][fmt],
          sum(one['linear']['passes'][p][fmt] for p in speed.PASSES))
    self.assertGreater(one['linear']['speedup']['fp8_current'], 1)
    out = self.enter_context(tempfile.TemporaryDirectory())
    for result in (self.result, one):
      self.assertIn('speedup', step_time_report.table(result))
      [path] = step_time_report.plot(result, out)
      self.assertGreater(os.path.getsize(path), 1000)
    with self.assertRaisesRegex(errors.ConfigError, r'^--shape=8,8: expected'):
      one_linear.parse_shape('8,8')

  def test_the_wire_joins_the_step(self):
    link = step_time.WIRE_LINKS[0]
    communication = dict(variants=[dict(
        layout='fsdp:8x1', wire='compute/float32', batch_size=64,
        paper={link: dict(comm_seconds=1e-3)})])
    path = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                        'c.json')
    with open(path, 'w') as f:
      json.dump(communication, f)
    [joined] = step_time.with_wire(self.result, path)
    self.assertEqual((joined['devices'], joined['batch_per_device']), (8, 8))
    step = self.result['step']['seconds']['bf16']
    self.assertEqual(joined['serial']['bf16'], step + 1e-3)
    self.assertEqual(joined['overlapped']['bf16'], max(step, 1e-3))
    with self.assertRaisesRegex(errors.ConfigError,
                                r'^--communication=/no/such: cannot read'):
      step_time.with_wire(self.result, '/no/such')


class AutoPlacementTest(absltest.TestCase):

  def test_a_run_puts_fp8_only_where_it_pays_and_says_why(self):
    # One block wide enough for its MLP to pay at this batch, narrow
    # attention that does not.
    settings = _tiny(**{'precision.low_bit.modules': 'auto',
                        'precision.low_bit.gpu': 'h100',
                        'batch_size': 4096, 'eval_batch_size': 8,
                        'model.embed_dim': 1024, 'model.mlp_dim': 16384,
                        'model.num_heads': 2})
    exp = experiment.build_without_data(settings)
    choices = {c.linear.path: c for c in exp.low_bit_choices}
    self.assertNotEmpty(choices)
    for path, choice in choices.items():
      self.assertEqual(exp.precision.runs_low_bit('Linear', path),
                       choice.low_bit, path)
      self.assertEqual(choice.gain, speed.gain(
          choice.linear.m, choice.linear.k, choice.linear.n, 'fp8_current',
          H100))
    paying = sorted(p for p, c in choices.items() if c.low_bit)
    self.assertEqual(paying, ['vit/encoder_block_0/mlp_block/fc1',
                              'vit/encoder_block_0/mlp_block/fc2'])
    lines = exp.low_bit_lines()
    self.assertIn('modules=auto, fp8_current, predicted on the h100): 2 of '
                  f'{len(choices)} Linears', lines[0])
    self.assertTrue(any(l.strip().startswith(
        'vit/encoder_block_0/mlp_block/fc1: fp8_current; 20480x1024x16384')
                        for l in lines), lines)
    self.assertTrue(any('stays bfloat16' in l for l in lines))

  def test_the_reference_vit_runs_no_fp8_and_says_so(self):
    exp = experiment.build_without_data(settings_lib.parse(
        vit_fp8.get_config()))
    self.assertFalse(any(c.low_bit for c in exp.low_bit_choices))
    self.assertIsNone(exp.precision.low_bit)
    self.assertIn('No Linear pays', exp.low_bit_lines()[-1])
    blocks = experiment.build_without_data(settings_lib.parse(
        vit_fp8.get_config('blocks')))
    self.assertEqual(blocks.low_bit_choices, ())
    self.assertTrue(blocks.precision.runs_low_bit(
        'Linear', 'vit/encoder_block_0/mlp_block/fc1'))

  def test_without_a_gpu_torchaos_rule_chooses(self):
    exp = experiment.build_without_data(_tiny(**{
        'precision.low_bit.modules': 'auto', 'model.embed_dim': 64,
        'model.mlp_dim': 2048}))
    chosen = {c.linear.path for c in exp.low_bit_choices if c.low_bit}
    self.assertEqual(chosen, {'vit/encoder_block_0/mlp_block/fc2'})
    self.assertIn("torchao's shape rule, no precision.low_bit.gpu named",
                  exp.low_bit_lines()[0])

  def test_the_advisor_keeps_fp8_where_it_is_safe_and_faster(self):
    settings = _tiny(**{'precision.low_bit.modules': '*/encoder_block_*',
                        'batch_size': 4096, 'eval_batch_size': 8,
                        'model.embed_dim': 1024, 'model.mlp_dim': 16384,
                        'model.num_heads': 2})
    exp = experiment.build_without_data(settings)
    paths = sorted({c.path for c in exp.module_calls
                    if exp.precision.runs_low_bit(c.class_name, c.path)})
    unsafe = 'vit/encoder_block_0/mlp_block/fc2'
    judged = dict(format='fp8', choice='current', keep_bf16=[unsafe],
                  modules=[dict(path=p, verdicts=dict(
                      current='keep-bf16' if p == unsafe else 'fp8-ok'))
                           for p in paths])
    timed = low_bit_advice.with_predicted_time(judged, settings, exp, 'h100')
    faster = {r['path'] for r in timed['modules'] if r['speed']['faster']}
    self.assertIn('vit/encoder_block_0/mlp_block/fc1', faster)
    self.assertEqual(set(timed['low_bit_modules'].split(';')),
                     faster - {unsafe})
    self.assertEqual(set(timed['slower']), set(paths) - faster - {unsafe})


_TINY_FLAGS = ('--config=configs/vit_bf16.py', *helpers.TINY_MODEL_FLAGS,
               '--config.batch_size=8', '--config.eval_batch_size=8')


@helpers.long_running
class CommandLineTest(parameterized.TestCase):

  def test_speed_prints_its_json_or_its_table_and_writes_both(self):
    out = self.enter_context(tempfile.TemporaryDirectory())
    done = helpers.run_module('launch.lab', 'speed', *_TINY_FLAGS,
                              '--gpu=h100', '--json', f'--out={out}',
                              check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ('gpu', 'assumptions', 'matmuls', 'step'):
      self.assertIn(key, result)
    self.assertEqual(result['gpu'], 'h100')
    self.assertEqual(set(result['step']['seconds']),
                     {'bf16', 'fp8_current', 'fp8_delayed'})
    self.assertEqual(result['assumptions']['gemm_efficiency'],
                     A.gemm_efficiency)
    with open(os.path.join(out, 'speed.json')) as f:
      self.assertEqual(json.load(f)['step'], result['step'])
    self.assertGreater(os.path.getsize(os.path.join(out, 'speed.png')), 1000)
    shape = helpers.run_module('launch.lab', 'speed', '--shape=4096,8192,16384',
                               '--gpu=b200', f'--out={out}', check=True)
    self.assertIn('One Linear, 4096 tokens x 8192 in -> 16384 out, on paper '
                  'for the b200:', shape.stdout)
    self.assertIn('| speedup | 1.00x |', shape.stdout)
    self.assertIn(f'wrote {out}/speed.png', shape.stdout)

  @parameterized.named_parameters(
      ('no_gpu', ['speed'], 'error: --gpu: speed predicts for a named GPU; '
       "give one of ('a100', 'h100', 'h200', 'b200'), e.g. --gpu=h100"),
      ('unknown_gpu', ['speed', '--gpu=h300'],
       "error: --gpu: unknown value 'h300'; expected one of ('a100', 'h100', "
       "'h200', 'b200')"),
      ('bad_shape', ['speed', '--gpu=h100', '--shape=1,2'],
       'error: --shape=1,2: expected M,K,N, three positive integers'),
      ('negative_batch', ['speed', '--gpu=h100', '--batch=-1'],
       'error: --batch=-1 must be at least 0'),
      ('gemm_on_a_cpu_without_a_gpu', ['gemm'],
       'error: --gpu: gemm runs on cpu, which the speed model does not know; '
       'name the GPU its predictions are for'),
      ('unreadable_communication', ['speed', '--gpu=h100',
                                    '--communication=/no/such.json'],
       'error: --communication=/no/such.json: cannot read a `launch.lab '
       'communication` JSON'))
  def test_bad_flags_are_one_line(self, args, message):
    out = self.enter_context(tempfile.TemporaryDirectory())
    done = helpers.run_module('launch.lab', *args, *_TINY_FLAGS,
                              f'--out={out}/lab')
    self.assertEqual(done.returncode, 2, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    self.assertIn(message, lines[-1])
    self.assertNotIn('Traceback', done.stderr)
    if args[0] == 'speed' and 'communication' not in args[-1]:
      self.assertFalse(os.path.exists(f'{out}/lab'))

  def test_gemm_times_each_linear_shape_and_says_a_cpu_emulates(self):
    out = self.enter_context(tempfile.TemporaryDirectory())
    done = helpers.run_module('launch.lab', 'gemm', *_TINY_FLAGS,
                              '--gpu=h100', '--repeats=1', '--json',
                              f'--out={out}', check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    self.assertEqual(result['note'], gemm_study.CPU_NOTE)
    shapes = {tuple(r['shape']) for r in result['rows']}
    # The tiny ViT's Linears: 16 -> 16 (q, k, v, out, fc1, fc2: mlp_dim 16),
    # 16 -> 10 (the head), at 8 images of 65 tokens (the head: 8 rows).
    self.assertEqual(shapes, {(520, 16, 16), (8, 16, 10)})
    self.assertLen(result['rows'], 3 * len(shapes))
    for row in result['rows']:
      self.assertEqual(set(row['measured']), set(gemm_study.VARIANTS))
      self.assertEqual(row['fp8_gemm'], {
          'fp8_prequantized': 'emulated (XLA:CPU)',
          'fp8_with_casts': 'emulated (XLA:CPU)'})
      self.assertIsNone(row['measured_over_predicted'])
      self.assertEqual(row['predicted']['bf16'], speed.gemm(
          *row['gemm'], 'bf16', H100, A, 2, 2).seconds)
    self.assertEqual(result['plots'], [])


@helpers.long_running
class MeasuredFiguresTest(parameterized.TestCase):
  """The model against every GPU figure there is, with one set of
  assumptions (gpus.Assumptions()); docs/speed.md has each ratio."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.predicted = {}
    for (dtype, batch) in H100_SWEEP_MS:
      settings = settings_lib.parse(_CONFIGS[dtype].get_config())
      cls.predicted[dtype, batch] = step_time.run(settings, 'h100', batch,
                                                  log=lambda _: None)
    cls.recipe = step_time.run(
        settings_lib.parse(vit_recipe.get_config('bf16')), 'h200',
        log=lambda _: None)

  def _assert_within(self, predicted, measured, what):
    self.assertBetween(predicted / measured, 1 - TIME_BAND, 1 + TIME_BAND,
                       f'{what}: predicted {predicted:.4g}, measured '
                       f'{measured:.4g}')

  def test_the_h100_sweep(self):
    for key, ms in H100_SWEEP_MS.items():
      result = self.predicted[key]
      self._assert_within(result['step']['seconds'][result['baseline']] * 1e3,
                          ms, key)

  def test_the_h100_profile(self):
    result = self.predicted['bf16', 128]
    step = result['step']['seconds']['bf16']
    self._assert_within(step * 1e3, H100_PROFILE_MS['wall'], 'wall')
    busy = step - result['rest']['kernels'] * A.kernel_seconds - sum(
        A.kernel_seconds for _ in result['matmuls'])
    self._assert_within(busy * 1e3, H100_PROFILE_MS['busy'], 'busy')

  def test_the_seeds_dot_and_the_h200_recipe(self):
    g = speed.gemm(1024, 65536, 1024, 'bf16', H100, A, 2, 2)
    self._assert_within(g.flops / g.seconds / 1e12, SEEDS_DOT_TFLOPS, 'dot')
    images = self.recipe['step']['images_per_second']['bf16']
    self._assert_within(1 / images, 1 / H200_RECIPE_IMAGES_PER_SEC, 'recipe')

  @parameterized.named_parameters(
      # torchao's tensorwise microbenchmark on an H100 (its README).
      ('torchao_small', [(1024, 2048, 1024)], 'fp8_current', 'h100',
       'torchao', 0.80),
      ('torchao_large', [(4096, 8192, 16384)], 'fp8_current', 'h100',
       'torchao', 1.39),
      # nanochat at width 1664: its MLP's two Linears, 65,536 tokens.
      ('nanochat', [(65536, 1664, 6656), (65536, 6656, 1664)], 'fp8_current',
       'h100', 'torchao', 1.38),
      # Transformer Engine's 5B layer on an H200 (speedups.rst), GEMM time.
      ('te_delayed', [(15872, 4096, 12288), (15872, 4096, 4096),
                      (15872, 4096, 16384), (15872, 16384, 4096)],
       'fp8_delayed', 'h200', 'transformer_engine', 1.69),
      ('te_current', [(15872, 4096, 12288), (15872, 4096, 4096),
                      (15872, 4096, 16384), (15872, 16384, 4096)],
       'fp8_current', 'h200', 'transformer_engine', 1.58))
  def test_published_speedups_on_the_measured_side_of_one(
      self, shapes, fmt, gpu_name, recipe, measured):
    gpu = gpus.gpu(gpu_name)
    seconds = [speed.linear_seconds(m, k, n, gpu, A, recipe=recipe)
               for m, k, n in shapes]
    bf16 = sum(s[p]['bf16'] for s in seconds for p in speed.PASSES)
    low = sum(s[p][fmt] for s in seconds for p in speed.PASSES)
    self.assertEqual(bf16 / low > 1, measured > 1, bf16 / low)


if __name__ == '__main__':
  absltest.main()
