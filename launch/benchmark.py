"""Benchmarks the train step: its time per compute dtype, or its compiled cost
per parallel layout.

Step time (compile and warm-up excluded, synthetic data on the device):

    python -m launch.benchmark --config=configs/vit_bf16.py --steps=5 --json
    python -m launch.benchmark --config=configs/vit_fp32.py \
        --dtypes=float32,bfloat16,float16 --steps=5 --json

prints a line per dtype and, with `--json`, one JSON object as the last line:
the figures of `haiku_mp.lab.benchmarks.step_benchmark` (step time, images/s, FLOPs, the
same-run matmul ceiling, MFU, system CPU time, compiled memory, the CPU) and,
with several dtypes, each one's ratios to the first.

The input pipeline (host gathers, augmentation on the device, and the same
train step on a batch already on the device vs fed by the pipeline):

    python -m launch.benchmark --config=configs/vit_bf16.py --pipeline \
        --config.data.source=arrays --config.data.arrays_path=cifar10.npz

The training loop against its compiled step (the trainer itself for --steps
steps, then the step alone on a batch already on the device, in alternating
rounds; `loop_over_step` per dtype, and per bound on the steps the host runs
ahead with --steps_in_flight):

    python -m launch.benchmark --config=configs/vit_bf16.py --loop \
        --dtypes=float32,bfloat16 --steps=300 --config.data.source=synthetic
    python -m launch.benchmark --config=configs/vit_cpu.py --loop \
        --steps_in_flight=16,2 --steps=100 --config.data.source=synthetic

Compiled cost per layout (compile time, memory analysis per device):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m \
        launch.benchmark --config=configs/vit_fp32.py --layouts=pjit:8x1,pjit:4x2
"""

import json

from absl import app
from absl import flags
from ml_collections import config_flags

from haiku_mp import errors
from haiku_mp.lab import compare
from haiku_mp.lab import hardware
from haiku_mp.lab import timing
from haiku_mp.lab import variants
from haiku_mp.lab.benchmarks import loop_benchmark
from haiku_mp.lab.benchmarks import pipeline_benchmark
from haiku_mp.lab.benchmarks import step_benchmark
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.train import in_flight
from launch import cli
from launch import flag_checks

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.',
                                          lock_config=True)
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps (the median is kept).')
_WARMUP = flags.DEFINE_integer('warmup_steps', 1, 'Untimed steps first.')
_DTYPES = flags.DEFINE_list(
    'dtypes', [], 'Compute dtypes to time in one run (default: the config\'s '
    'own), or fp8_current, fp8_delayed, fp8_mx (bfloat16 with fp8 matmuls); '
    'ratios are to the first.')
_JSON = flags.DEFINE_bool('json', False,
                          'End with one JSON object of every figure.')
_CEILING = flags.DEFINE_integer(
    'ceiling_size', 2048, 'Least side of the square matmul timed as the '
    'ceiling (it grows to do one step\'s FLOPs, up to '
    f'{step_benchmark.MAX_GROWN_CEILING_SIZE}).')
_LAYOUTS = flags.DEFINE_list(
    'layouts', [], 'STRATEGY:BATCHxMODEL layouts to compare compiled cost '
    '(e.g. pjit:8x1,pjit:4x2; single needs no mesh: single:1x1) instead of '
    'timing steps.')

_DP_VS_ORDINARY = flags.DEFINE_bool(
    'dp_vs_ordinary', False, 'Time each dtype\'s ordinary step and its '
    'DP-SGD step (the config\'s privacy settings) in the same run.')

_PIPELINE = flags.DEFINE_bool(
    'pipeline', False, 'Benchmark the input pipeline of the config\'s data '
    'source against its train step instead (--steps per round).')
_LOOP = flags.DEFINE_bool(
    'loop', False, 'Benchmark the training loop (the trainer itself, --steps '
    'steps a round) against its compiled step on a device batch, per dtype.')
_STEPS_IN_FLIGHT = flags.DEFINE_list(
    'steps_in_flight', [], '--loop: bounds on the steps the host runs ahead '
    'of the device to compare in one run, e.g. 16,2 (default: the config\'s '
    'steps_in_flight); ratios are to the first.')
_ROUNDS = flags.DEFINE_integer(
    'rounds', 3, '--pipeline, --loop: alternating rounds of the two '
    'measurements (the median round is kept).')

_LAYOUT_RATIO_FIELDS = ('temp_size_in_bytes', 'argument_size_in_bytes',
                        'params_bytes', 'opt_state_bytes', 'compile_sec')


def _layouts(settings):
  results = []
  for layout in _LAYOUTS.value:
    result = dict(layout=layout, **timing.compiled_step_stats(
        variants.with_layout(settings, layout)))
    results.append(result)
    print(json.dumps(result), flush=True)
  compare.add_ratios(results, 'ratios', _LAYOUT_RATIO_FIELDS,
                     is_base=lambda r: r is results[0])
  print(json.dumps(dict(ratios_vs=results[0]['layout'],
                        ratios={r['layout']: r['ratios'] for r in results[1:]})))


# Each integer flag's least meaningful value.
_LEAST = ((_STEPS, 1), (_WARMUP, 0), (_CEILING, 1), (_ROUNDS, 1))


def _check_flags(settings) -> None:
  """Every flag's range, before anything is compiled."""
  flag_checks.at_least((f.name, f.value, least) for f, least in _LEAST)
  if _DTYPES.value:
    flag_checks.compute_dtypes('dtypes', _DTYPES.value)
  modes = [name for name, on in (('layouts', bool(_LAYOUTS.value)),
                                 ('pipeline', _PIPELINE.value),
                                 ('loop', _LOOP.value)) if on]
  if len(modes) > 1:
    raise errors.ConfigError(f'--{modes[0]} and --{modes[1]} are different '
                             'benchmarks: run one at a time')
  if _STEPS_IN_FLIGHT.value and not _LOOP.value:
    raise errors.ConfigError('--steps_in_flight compares training loops: '
                             'add --loop')
  flag_checks.ints_in('steps_in_flight', _STEPS_IN_FLIGHT.value, 1,
                 in_flight.MAX_LIMIT)
  if _LOOP.value and _STEPS.value < 2 * settings.log_every_steps:
    raise errors.ConfigError(
        f'--steps={_STEPS.value} is less than two log windows '
        f'(log_every_steps={settings.log_every_steps}): a --loop round is '
        'timed over its windows after the first; use at least '
        f'{2 * settings.log_every_steps} steps')
  for layout in _LAYOUTS.value:
    sharding.mesh_for(variants.with_layout(settings, layout).parallel)


def _pipeline(settings):
  result = pipeline_benchmark.run(settings, _STEPS.value, _ROUNDS.value)
  step = result['step_time_s']
  print(f'{result["source"]} data, batch {result["batch_size"]}: host '
        f'{result["host_images_per_sec"]:.0f} img/s, augmentation '
        f'{result["augment_images_per_sec"]:.0f} img/s, pipeline '
        f'{result["pipeline_images_per_sec"]:.0f} img/s = '
        f'{result["pipeline_over_step"]:.1f}x the step\'s '
        f'{result["step_images_per_sec"]:.1f} img/s', flush=True)
  print(f'step on a device batch {step["device_batch"] * 1e3:.1f} ms, fed by '
        f'the pipeline {step["pipeline_fed"] * 1e3:.1f} ms '
        f'({100 * result["fed_slowdown"]:+.1f}%); augmentation alone '
        f'{100 * result["augment_share_of_step"]:.1f}% of the step', flush=True)
  if _JSON.value:
    print(json.dumps(result))


def _loop(settings, dtypes):
  limits = [int(v) for v in _STEPS_IN_FLIGHT.value]
  rows = loop_benchmark.run_dtypes(settings, dtypes, _STEPS.value,
                                   _ROUNDS.value,
                                   log=lambda line: print(line, flush=True),
                                   steps_in_flight=limits)
  name = lambda row: row['dtype'] + (
      f' steps_in_flight={row["steps_in_flight"]}' if limits else '')
  for row in rows:
    host = row['host_ms_per_step']
    print(f'{name(row):>8} batch {row["batch_size"]}: loop '
          f'{row["loop_images_per_sec"]:.0f} img/s = '
          f'{row["loop_over_step"]:.2f}x the step\'s '
          f'{row["step_images_per_sec"]:.0f} img/s ({row["step_ms"]:.2f} '
          f'ms/step; the loop\'s host: {host["waiting_for_batch"]:.2f} ms '
          f'waiting for a batch, {host["in_step_call"]:.2f} ms in the step '
          'call)', flush=True)
  for row in rows[1:]:
    ratios = row['vs_first']
    print(f'{name(row)} vs {name(rows[0])}: the loop '
          f'{ratios["loop_images_per_sec"]:.2f}x the images/s, the step '
          f'{ratios["step_images_per_sec"]:.2f}x')
  if _JSON.value:
    print(json.dumps(dict(device=rows[0]['device'], cpu=rows[0]['cpu'],
                          allocator=rows[0]['allocator'],
                          ratios_vs=name(rows[0]), results=rows)))


def _line(row) -> str:
  mfu = f'{row["mfu"]:.2f}' if row['mfu'] is not None else 'n/a'
  dp = (f' DP-SGD (padded to {row["train_batch_size"]})' if row['privacy']
        else '')
  note = f' (MFU n/a: {row["mfu_note"]})' if row['mfu_note'] else ''
  return (f'{row["dtype"]:>8} ({row["dot_form"]}){dp} batch '
          f'{row["batch_size"]}: '
          f'{row["step_time_s"] * 1e3:.1f} ms/step, '
          f'{row["images_per_sec"]:.1f} img/s, MFU {mfu} of '
          f'{row["matmul_ceiling_flops"] / 1e9:.0f} GFLOP/s '
          f'({row["matmul_ceiling_size"]}^3 matmul), '
          f'sys {row["sys_cpu_s_per_step"]:.2f} s/step, temp '
          f'{row["temp_bytes"] / 2**20:.0f} MiB{note}')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  settings = settings_lib.parse(_CONFIG.value)
  _check_flags(settings)
  print(hardware.host_line(), flush=True)
  if _LAYOUTS.value:
    _layouts(settings)
    return
  if _PIPELINE.value:
    _pipeline(settings)
    return
  dtypes = _DTYPES.value or [variants.variant_name(settings)]
  if _LOOP.value:
    # Each round is a run (which uses the config's compilation cache): from
    # its second on, it loads its compiled steps.
    _loop(settings, dtypes)
    return
  rows = step_benchmark.run_dtypes(
      settings, dtypes, _STEPS.value, log=lambda row: print(_line(row),
                                                          flush=True),
      warmup_steps=_WARMUP.value, ceiling_size=_CEILING.value,
      dp_vs_ordinary=_DP_VS_ORDINARY.value)
  for line in step_benchmark.ratio_lines(rows):
    print(line)
  if _JSON.value:
    if len(rows) == 1:
      print(json.dumps(rows[0]))
    else:
      print(json.dumps(dict(device=rows[0]['device'], cpu=rows[0]['cpu'],
                            allocator=rows[0]['allocator'],
                            ratios_vs=rows[0]['dtype'], results=rows)))


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  cli.run(main)
