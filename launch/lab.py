"""The precision lab: studies that print JSON and write JSON + PNG to --out.

python -m launch.lab params --config=configs/vit_fp32.py --out=lab
python -m launch.lab sweep --config=configs/vit_cpu.py --batch_sizes=128,1024
python -m launch.lab memory --config=configs/vit_fp32.py
python -m launch.lab precision --config=configs/vit_cpu.py
python -m launch.lab profile --config=configs/vit_bf16.py --steps=5
python -m launch.lab matmul --out=lab [--rows=1024 --cols=65536 --repeats=5]
python -m launch.lab dot_algorithms --out=lab [--size=2048]
python -m launch.lab step_compile --out=lab [--repeats=3]
python -m launch.lab communication --config=configs/vit_bf16.py \
    [--layouts=pjit:8x1,fsdp:8x1] [--wires=float32/float32,compute/float32]
python -m launch.lab fp8 --config=configs/vit_fp8.py [--nocompile]
python -m launch.lab speed --config=configs/vit_bf16.py --gpu=h100 [--batch=N] \
    [--json] [--shape=M,K,N] [--communication=COMMUNICATION_JSON]
python -m launch.lab gemm --config=configs/vit_bf16.py [--gpu=h100] [--repeats=5]
python -m launch.lab ladder --config=configs/vit_cpu_recipe.py --workdirs=runs/fp32,runs/bf16,...
python -m launch.lab report --out=report [--parts=benchmark,...] [--quick] \
    [--config.data.source=arrays --config.data.arrays_path=cifar10.npz]
python -m launch.lab rounding --checkpoint=WORKDIR [--checkpoint_step=N] [--batches=4]
python -m launch.lab advise --config=configs/vit_fp16.py [--checkpoint=WORKDIR] \
    [--batches=8] [--level=knockout] [--gpu=h100] --out=advice

`speed` predicts the train step's time on a named GPU per matmul format
(bf16, fp8 current and delayed, MXFP8 and NVFP4 where the GPU has them), per
matmul and for the whole step, and which Linears fp8 pays in, on paper
(haiku_mp/lab/studies/step_time.py, one_linear.py, docs/speed.md); `gemm` times each Linear
shape's three GEMMs in bf16, fp8 alone and fp8 with its casts beside that
prediction (haiku_mp/lab/studies/gemm.py). `fp8` lists every matmul of the train step (forward and backward) with its
operands' formats and, compiled, whether it runs as an fp8 GEMM
(haiku_mp/lab/studies/fp8_gemms.py). `communication` compiles the train step per
layout and GATHER/REDUCE dtypes and lists every collective's kind, count,
dtype and bytes per device, per-device memory, and the bytes' time on paper
for NVLink and InfiniBand links (haiku_mp/lab/studies/communication.py,
collectives.py, partitioned_step.py, wire_time.py). `report` runs several parts on whatever backend JAX finds and writes their
JSON, plots and one report.md (haiku_mp/lab/report/report.py). `advise` says which
precision each module can run in and which float16 loss scale, and prints the
flags to paste; it writes advise.json, advise.md and a plot
(haiku_mp/lab/advisor/driver.py, module_statistics.py, low_bit_advice.py,
knockout.py, advisor_files.py).

Each study prints its result as one JSON line and writes
`<study>.json` and its plots into --out.
"""

import json
import os
import shlex
import sys

from absl import flags
import jax
from ml_collections import config_flags

from haiku_mp import errors
from haiku_mp.advisor import gpus
from haiku_mp.lab.advisor import advisor_files
from haiku_mp.lab.advisor import driver as advisor
from haiku_mp.lab.report import report
from haiku_mp.lab import run_inputs
from haiku_mp.lab.studies import communication
from haiku_mp.lab.studies import dot_algorithms
from haiku_mp.lab.studies import fp8_gemms
from haiku_mp.lab.studies import gemm
from haiku_mp.lab.studies import ladder
from haiku_mp.lab.studies import lost_updates
from haiku_mp.lab.studies import matmul
from haiku_mp.lab.studies import matmul_precision as precision_lab
from haiku_mp.lab.studies import memory
from haiku_mp.lab.studies import one_linear
from haiku_mp.lab.studies import params
from haiku_mp.lab.studies import profile
from haiku_mp.lab.studies import step_compile
from haiku_mp.lab.studies import step_time
from haiku_mp.lab.studies import step_time_report
from haiku_mp.lab.studies import sweep
from haiku_mp.lab import variants
from haiku_mp.vit import settings as settings_lib
from launch import cli
from launch import flag_checks

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/vit_fp32.py',
                                          'Config file.', lock_config=True)
_OUT = flags.DEFINE_string('out', 'lab', 'Directory for JSON and PNG files.')
_ROWS = flags.DEFINE_integer('rows', 1024, 'matmul: rows of A.')
_COLS = flags.DEFINE_integer('cols', 1024 * 64, 'matmul: columns of A.')
_REPEATS = flags.DEFINE_integer(
    'repeats', 5, 'matmul: timed repetitions; step_compile: compiles of '
    'each step (the median is kept).')
_DTYPES = flags.DEFINE_list('dtypes', list(variants.DTYPES),
                            'sweep, memory: compute dtypes.')
_BATCH_SIZES = flags.DEFINE_list('batch_sizes',
                                 [str(b) for b in variants.BATCH_SIZES],
                                 'sweep, memory: global batch sizes.')
_LAYOUTS = flags.DEFINE_list(
    'layouts', ['single:1x1'],
    'sweep, communication: STRATEGY:BATCHxMODEL layouts, e.g. '
    'pjit:8x1,pjit:4x2,pmap:8x1 (communication: pjit:8x1,fsdp:8x1).')
_WIRES = flags.DEFINE_list(
    'wires', list(communication.WIRES),
    "communication: GATHER/REDUCE dtypes ('float32', 'compute', 'fp8' / "
    "'float32', 'compute').")
_STEPS = flags.DEFINE_integer(
    'steps', 3, 'sweep, precision: timed train steps; profile: traced steps.')
_WARMUP_STEPS = flags.DEFINE_integer(
    'warmup_steps', 1, 'sweep, profile: untimed steps after compiling.')
_MATMUL_PRECISIONS = flags.DEFINE_list(
    'matmul_precisions', list(precision_lab.MATMUL_PRECISIONS),
    "precision: jax.default_matmul_precision names ('' = JAX's default).")
_NUMERICS_BATCH_SIZE = flags.DEFINE_integer(
    'numerics_batch_size', 32,
    'precision: examples compared with the float64 reference.')
_ISOLATE = flags.DEFINE_bool(
    'isolate', True,
    'sweep, precision: measure each variant in a fresh process.')
_SIZE = flags.DEFINE_integer('size', 2048, 'dot_algorithms: matmul side.')
_PARTS = flags.DEFINE_list('parts', list(report.PARTS),
                           'report: the parts to run (and add to report.md).')
_QUICK = flags.DEFINE_bool(
    'quick', False, 'report: everything shrunk (tiny model, few steps): a '
    'check that every part runs, in about a minute on a CPU.')
_SEEDS = flags.DEFINE_list('seeds', ['0'],
                           'report: seeds of the accuracy runs.')
_CHECKPOINT = flags.DEFINE_string(
    'checkpoint', '', 'advise, rounding: a launch.train workdir whose '
    'checkpoint gives the state, and whose config.json the config '
    '(default: the config\'s init).')
_CHECKPOINT_STEP = flags.DEFINE_integer(
    'checkpoint_step', -1, 'advise, rounding: the newest checkpoint at or '
    'before this step (-1: the newest).')
_BATCHES = flags.DEFINE_integer('batches', 8, 'advise, rounding: training '
                                'batches measured.')
_LEVEL = flags.DEFINE_string(
    'level', 'stats', "advise: 'stats' (statistics and verdicts) or "
    "'knockout' (also each module alone in half precision).")
_WORKDIRS = flags.DEFINE_list(
    'workdirs', [], 'ladder: finished launch.train workdirs (runs of one '
    'variant are its seeds).')
_GPU = flags.DEFINE_string(
    'gpu', '', f'speed, gemm, advise: the GPU predicted for, one of '
    f'{gpus.NAMES} (gemm on a GPU: the one it runs on by default; advise: '
    "the config's precision.low_bit.gpu by default, fp8's verdicts then "
    'weighing its predicted time).')
_BATCH = flags.DEFINE_integer(
    'batch', 0, "speed: the step's batch (0: the config's batch_size).")
_SHAPE = flags.DEFINE_string(
    'shape', '', 'speed: M,K,N: one Linear of M tokens, K inputs and N '
    'outputs alone, instead of the configured step.')
_JSON = flags.DEFINE_bool(
    'json', False, 'speed, gemm: print the result as one JSON object '
    'instead of its table.')
_COMMUNICATION = flags.DEFINE_string(
    'communication', '', 'speed: a `launch.lab communication` JSON of the '
    "same model and per-device batch, whose wire times join the step's.")
_COMPILE = flags.DEFINE_bool(
    'compile', True, "memory: also compile each variant's train step; fp8: "
    'compile the step to see which kernel runs each matmul.')


# Each integer flag's least meaningful value (--checkpoint_step: -1 is the
# newest checkpoint; --batch: 0 is the config's).
_LEAST = ((_ROWS, 1), (_COLS, 1), (_REPEATS, 1), (_STEPS, 1),
          (_WARMUP_STEPS, 0), (_NUMERICS_BATCH_SIZE, 1), (_SIZE, 1),
          (_BATCHES, 1), (_CHECKPOINT_STEP, -1), (_BATCH, 0))


def _check_flags(command: str) -> None:
  """Every flag's range, before any study compiles or writes."""
  flag_checks.at_least((f.name, f.value, least) for f, least in _LEAST)
  flag_checks.positive_ints('batch_sizes', _BATCH_SIZES.value)
  flag_checks.compute_dtypes('dtypes', _DTYPES.value)
  flag_checks.out_dir('out', _OUT.value)
  if _GPU.value:
    errors.check_choice('--gpu', _GPU.value, gpus.NAMES)
  if _SHAPE.value:
    one_linear.parse_shape(_SHAPE.value)
  if command == 'speed' and not _GPU.value:
    raise errors.ConfigError(f'--gpu: speed predicts for a named GPU; give '
                             f'one of {gpus.NAMES}, e.g. --gpu=h100')
  if command == 'gemm' and not _GPU.value and not gpus.detect(
      str(jax.devices()[0].device_kind)):
    raise errors.ConfigError(
        f'--gpu: gemm runs on {jax.devices()[0].device_kind}, which the '
        f'speed model does not know; name the GPU its predictions are for, '
        f'one of {gpus.NAMES}, e.g. --gpu=h100')


def _log(line: str) -> None:
  print(line, flush=True)


def _params(settings):
  return params.run(settings, log=_log), params.plot


def _sweep(settings):
  result = sweep.run(
      settings, _DTYPES.value,
      flag_checks.positive_ints('batch_sizes', _BATCH_SIZES.value),
      _LAYOUTS.value, _STEPS.value, _WARMUP_STEPS.value, _ISOLATE.value,
      log=_log)
  return result, sweep.plot


def _memory(settings):
  result = memory.run(
      settings, _DTYPES.value,
      flag_checks.positive_ints('batch_sizes', _BATCH_SIZES.value),
      _COMPILE.value, log=_log)
  return result, memory.plot


def _precision(settings):
  dtypes = _DTYPES.value if _DTYPES.present else list(precision_lab.DTYPES)
  result = precision_lab.run(
      settings, dtypes, _MATMUL_PRECISIONS.value, _STEPS.value,
      _NUMERICS_BATCH_SIZE.value, _ISOLATE.value, log=_log)
  return result, precision_lab.plot


def _profile(settings):
  result = profile.run(settings, _OUT.value, _STEPS.value, _WARMUP_STEPS.value)
  for line in result['open_with']:
    print(f'open the trace: {line}', flush=True)
  return result, profile.plot


def _matmul():
  """A bare matmul, not the configured run."""
  return (matmul.run(_ROWS.value, _COLS.value, _REPEATS.value, log=_log),
          matmul.plot)


def _fp8(settings):
  result = fp8_gemms.run(settings, _COMPILE.value, log=_log)
  print(fp8_gemms.table(result), flush=True)
  print(fp8_gemms.summary(result), flush=True)
  return result, fp8_gemms.write_table


def _speed(settings):
  """The step (or with --shape, one Linear) on paper for --gpu."""
  if _SHAPE.value:
    result = one_linear.one_gemm(one_linear.parse_shape(_SHAPE.value),
                                 _GPU.value)
  else:
    result = step_time.run(settings, _GPU.value, _BATCH.value or None, log=_log)
    if _COMMUNICATION.value:
      result['with_wire'] = step_time.with_wire(result, _COMMUNICATION.value)
  return result, step_time_report.plot


def _gemm(settings):
  return gemm.run(settings, _GPU.value, _REPEATS.value, log=_log), gemm.plot


def _rounding(settings):
  """At a run's checkpoint (its own config), which params' updates bfloat16
  rounding drops."""
  if _CHECKPOINT.value:
    given = config_flags.get_override_values(flags.FLAGS['config'])
    settings = run_inputs.with_run_config(settings, _CHECKPOINT.value, given,
                                          log=_log, command='rounding')
  result = lost_updates.run(settings, _CHECKPOINT.value, _CHECKPOINT_STEP.value,
                        _BATCHES.value, log=_log)
  print(lost_updates.table(result), flush=True)
  return result, lost_updates.plot


def _ladder(settings):
  if not _WORKDIRS.value:
    raise errors.ConfigError('--workdirs: the ladder takes finished '
                             'launch.train workdirs, e.g. '
                             '--workdirs=runs/fp32,runs/bf16')
  return ladder.run(settings, _WORKDIRS.value, log=_log), ladder.plot


def _dot_algorithms():
  """Bare dots, not the configured run."""
  return (dot_algorithms.run(_SIZE.value, _REPEATS.value, log=_log),
          dot_algorithms.plot)


def _communication(settings):
  layouts = (_LAYOUTS.value if _LAYOUTS.present else
             list(communication.LAYOUTS))
  result = communication.run(settings, layouts, _WIRES.value, log=_log)
  print(communication.table(result), flush=True)
  print(communication.paper_table(result), flush=True)
  return result, communication.plot


def _step_compile():
  """Its own tiny step, not the configured run."""
  return (step_compile.run(repeats=_REPEATS.value, log=_log),
          step_compile.plot)


# The studies of the configured run (they take its settings), and those of
# programs of their own.
STUDIES = {'params': _params, 'sweep': _sweep, 'memory': _memory,
           'precision': _precision, 'profile': _profile, 'fp8': _fp8,
           'rounding': _rounding, 'ladder': _ladder,
           'communication': _communication, 'speed': _speed, 'gemm': _gemm}
# The studies whose result is a table unless --json asks for the JSON.
TABLES = {'speed': step_time_report.table, 'gemm': gemm.table}
BARE_STUDIES = {'matmul': _matmul, 'dot_algorithms': _dot_algorithms,
                'step_compile': _step_compile}
# Every command: the studies, the report that runs several of them, and
# the advisor.
COMMANDS = (*STUDIES, *BARE_STUDIES, 'report', 'advise')


def _report(settings):
  """The report writes its own files (one JSON per part, report.md)."""
  seeds = [int(s) for s in _SEEDS.value if s.lstrip('-').isdigit()]
  if not seeds or len(seeds) != len(_SEEDS.value):
    raise errors.ConfigError(f'--seeds: expected integers, got '
                             f'{",".join(_SEEDS.value)!r}')
  index = report.run(settings, _OUT.value, _PARTS.value, _QUICK.value,
                     seeds, command=shlex.join(['python', '-m', 'launch.lab',
                                                *sys.argv[1:]]),
                     log=_log)
  print(json.dumps(index))


def _advise(settings):
  """The advisor writes its own files and prints the flags to paste. With
  --checkpoint, the run's own config.json is the config (its model, data,
  precision, loss scale: nothing to repeat); --config.* flags on the command
  line still win."""
  if _CHECKPOINT.value:
    given = config_flags.get_override_values(flags.FLAGS['config'])
    settings = run_inputs.with_run_config(settings, _CHECKPOINT.value, given,
                                          log=_log)
  result = advisor.run(settings, _CHECKPOINT.value, _CHECKPOINT_STEP.value,
                      _BATCHES.value, _LEVEL.value, _STEPS.value, log=_log,
                      gpu=_GPU.value or settings.precision.low_bit.gpu)
  for path in advisor_files.write(result, _OUT.value):
    print(f'wrote {path}', flush=True)
  for fmt, suggestion in result['suggestions'].items():
    print(f'{fmt}: ' + ' '.join(suggestion['flags']), flush=True)
  for line in advisor_files.matmul_flag_lines(result):
    print(line, flush=True)
  print(json.dumps(dict(float16_window=result['float16_window'],
                        suggestions=result['suggestions'],
                        cost=result['cost'])))


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise errors.ConfigError(f'expected one command of {COMMANDS}, '
                             f'got {argv[1:]}')
  command = argv[1]
  _check_flags(command)
  settings = settings_lib.parse(_CONFIG.value)  # Parsed once, each checked.
  if command in ('report', 'advise'):
    {'report': _report, 'advise': _advise}[command](settings)
    return
  if command in BARE_STUDIES:
    result, plot = BARE_STUDIES[command]()
  else:
    result, plot = STUDIES[command](settings)
  os.makedirs(_OUT.value, exist_ok=True)  # Only once there is a result.
  result['plots'] = [os.path.basename(p) for p in plot(result, _OUT.value)]
  path = os.path.join(_OUT.value, f'{command}.json')
  with open(path, 'w') as f:
    json.dump(result, f, indent=1)
  if command in TABLES and not _JSON.value:
    print(TABLES[command](result), flush=True)
    for written in [os.path.basename(path), *result['plots']]:
      print(f'wrote {os.path.join(_OUT.value, written)}')
    return
  print(json.dumps(result))


if __name__ == '__main__':
  cli.run(main)
