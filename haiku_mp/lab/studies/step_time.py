"""Study `speed` (`launch.lab speed`): will fp8 make this model faster? The train step's time on a
named GPU, on paper, per matmul format, from the step's own program.

The step is lowered for CUDA as the config's compute-dtype program (no
low-bit matmuls, `step_program`), so stock Haiku modules count as the ViT's
do. Each of its matmuls is timed by the speed model in its own dtypes
(`haiku_mp.advisor.speed`), the baseline; each Linear that low-bit matmuls
would reach (the config's `precision.low_bit.modules`, or fp8's default
encoder blocks where it names none) is timed again per low-bit format, its
casts, amaxes, transposes and scales included. The rest of the step (its
elementwise work, reductions, optimizer, augmentation) is its bytes at the
memory bandwidth plus a cost per kernel, the same in every format. The sum
per format is the step; its ratio to the baseline, the speedup.

Everything here is a prediction: `assumptions` in the result holds every
peak, share and cost it used, and docs/speed.md what each was checked
against. `--shape` times one Linear alone (`one_linear`); the table and the
chart are `step_time_report`'s.
"""

import collections
import json
import math
from typing import Any, Callable, NamedTuple, Optional

import jax

from haiku_mp import errors
from haiku_mp.advisor import gpus
from haiku_mp.advisor import placement
from haiku_mp.advisor import speed as speed_lib
from haiku_mp.lab.studies import hlo_text
from haiku_mp.lab.studies import step_program
from haiku_mp.lab.studies import wire_time
from haiku_mp.model import fp8 as fp8_lib
from haiku_mp.model import low_bit as low_bit_lib
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.settings import precision as precision_settings
from haiku_mp.vit.train import experiment

# The baseline's name by the dtype the Linears' GEMMs take.
_BASELINES = {'bf16': 'bf16', 'f16': 'fp16', 'f32': 'tf32'}
# Joined with `launch.lab communication`'s paper times for these links.
WIRE_LINKS = ('nvlink_8gpu', 'ib_16node')


def gpu_settings(settings: settings_lib.Settings,
                 batch: Optional[int] = None) -> settings_lib.Settings:
  """`settings` as the compute-dtype program a GPU runs: no low-bit matmuls
  (the model adds them), the matmul forms a GPU's (`dot_platform`), one
  device, synthetic data, at `batch` if given."""
  changes = dict(
      precision=dict(low_bit=dict(modules='', keep_fp8=''),
                     dot_platform=settings.precision.dot_platform or 'gpu'),
      parallel=dict(strategy='single'), data=dict(source='synthetic'))
  if batch is not None:
    changes['batch_size'] = batch
    changes['eval_batch_size'] = batch
  return settings_lib.replace(settings, **changes)


def low_bit_targets(settings: settings_lib.Settings) -> tuple[str, ...]:
  """The targets whose Linears low-bit matmuls would reach: the config's,
  every Linear for 'auto', fp8's default encoder blocks where it names
  none."""
  low_bit = settings.precision.low_bit
  if precision_settings.chooses_modules(low_bit):
    return (low_bit_lib.LOW_BIT_CLASS,)
  modules = low_bit.modules.strip() or fp8_lib.DEFAULT_MODULES
  return tuple(t.strip() for t in modules.split(';') if t.strip())


def element_bytes(element_type: str) -> float:
  """Bytes per element of an HLO element type ('bf16': 2), 4 for one it
  does not know."""
  return hlo_text.ELEMENT_TYPES.get(element_type, ('', 4))[1]


def _tensor_cores(matmul: step_program.Matmul) -> str:
  """The tensor cores a program's matmul runs on (`gpus.MATMUL_FORMATS`)."""
  if matmul.lhs == 'f32' or matmul.rhs == 'f32':
    return 'float32' if matmul.highest else 'tf32'
  if matmul.lhs.startswith('f8'):
    return 'fp8'
  return 'bf16'


def _passes(rows: list[dict[str, Any]]) -> None:
  """Each row's pass: 'fprop' in the forward; in the backward 'dgrad' (the
  gradient of a forward matmul's first operand, the input's for a Linear)
  or 'wgrad' (of its second, the weight's), by the shape it writes."""
  forward = collections.defaultdict(list)
  for row in rows:
    if row['direction'] == 'forward':
      forward[row['name']].append(row)
  for row in rows:
    if row['direction'] == 'forward':
      row['pass'] = 'fprop'
      continue
    out = sorted(row['_out_shape'])
    row['pass'] = 'dgrad'
    for f in forward[row['name']]:
      if out == sorted(f['_rhs_shape']) and out != sorted(f['_lhs_shape']):
        row['pass'] = 'wgrad'
        break


def _linear_shapes(rows: list[dict[str, Any]]) -> dict[str, tuple]:
  """(M tokens, K in, N out, compute dtype) of each Linear, from its forward
  GEMM."""
  return {r['name']: (r['m'], r['k'], r['n'], r['lhs']) for r in rows
          if r['pass'] == 'fprop' and r['linear'] and r['batch'] == 1}


class LoweredStep(NamedTuple):
  """The program `run` reads, which no GPU changes: the settings it was
  lowered from (`gpu_settings`), their experiment and the program."""
  settings: settings_lib.Settings
  exp: experiment.Experiment
  program: step_program.StepProgram


def lower_step(settings: settings_lib.Settings, batch: Optional[int] = None,
               log: Callable[[str], None] = print) -> LoweredStep:
  """The train step of `settings` (at `batch` if given) lowered for CUDA
  and read (`step_program`)."""
  program_settings = gpu_settings(settings, batch)
  exp = experiment.build_without_data(program_settings)
  log(f'speed: lowering the train step for CUDA (batch '
      f'{program_settings.batch_size}) ...')
  return LoweredStep(program_settings, exp, step_program.read(
      step_program.lower_for_gpu(exp.strategy.train_step,
                                 *exp.abstract_inputs())))


def run(settings: settings_lib.Settings, gpu_name: str,
        batch: Optional[int] = None,
        assumptions: gpus.Assumptions = gpus.Assumptions(),
        log: Callable[[str], None] = print,
        lowered: Optional[LoweredStep] = None) -> dict[str, Any]:
  """The step of `settings` (at `batch` if given) on GPU `gpu_name`, per
  matmul and per format (module docstring); `lowered`: its `lower_step`,
  for predictions on several GPUs from one lowering."""
  gpu = gpus.gpu(gpu_name)
  if lowered is None:
    lowered = lower_step(settings, batch, log)
  elif lowered.settings != gpu_settings(settings, batch):
    raise ValueError('lowered: not the step of these settings at this batch')
  program_settings, exp, program = lowered
  paths = sorted({c.path for c in exp.module_calls})
  linears = {c.path for c in exp.module_calls
             if c.class_name == low_bit_lib.LOW_BIT_CLASS
             and c.method == '__call__'}
  targets = low_bit_targets(settings)
  candidates = {p for p in linears
                if low_bit_lib.selects(targets, low_bit_lib.LOW_BIT_CLASS, p)}
  formats = [f for f in speed_lib.formats_on(gpu) if f != speed_lib.BASELINE]
  rows = []
  for m in program.matmuls:
    module, direction = step_program.module_of(m, paths)
    baseline = speed_lib.gemm(m.m, m.k, m.n, _tensor_cores(m), gpu,
                              assumptions, element_bytes(m.lhs),
                              element_bytes(m.out), m.batch)
    rows.append(dict(
        name=module, direction='backward' if direction == 'backward' else
        'forward', m=m.m, k=m.k, n=m.n, batch=m.batch, lhs=m.lhs, rhs=m.rhs,
        out=m.out, flops=baseline.flops, bytes=baseline.bytes,
        bound=baseline.bound, linear=module in linears,
        low_bit=module in candidates, _gemm=baseline,
        _lhs_shape=m.lhs_shape, _rhs_shape=m.rhs_shape,
        _out_shape=m.out_shape))
  _passes(rows)
  shapes = _linear_shapes(rows)
  base_name = _baseline_name(rows)
  for row in rows:
    row['seconds'] = {base_name: row['_gemm'].seconds}
    for fmt in formats:
      row['seconds'][fmt] = row['_gemm'].seconds
      if row['low_bit'] and row['name'] in shapes:
        m, k, n, compute = shapes[row['name']]
        row['seconds'][fmt] = speed_lib.linear_pass_seconds(
            row['pass'], m, k, n, fmt, gpu, assumptions,
            element_bytes(compute))
  rest = speed_lib.streamed(program.traffic.bytes, program.traffic.kernels,
                            gpu, assumptions)
  result = dict(
      experiment='speed', prediction=True, gpu=gpu.name, gpu_about=gpu.about,
      assumptions=describe_assumptions(gpu, assumptions),
      batch_size=program_settings.batch_size,
      policy=settings.precision.policy, baseline=base_name,
      formats=[base_name, *formats],
      low_bit_targets=list(targets), low_bit_linears=sorted(candidates),
      matmuls=[{k: v for k, v in r.items() if not k.startswith('_')
                and k != 'direction'} for r in rows],
      rest=dict(bytes=program.traffic.bytes, kernels=program.traffic.kernels,
                seconds=rest, by_kind=program.traffic.by_kind,
                exact=program.traffic.exact),
      jax_version=jax.__version__)
  result['step'] = step(result)
  result['linears'] = linear_gains(result, gpu, assumptions, shapes)
  result['where_it_pays'] = where_it_pays(result)
  return result


def _baseline_name(rows: list[dict[str, Any]]) -> str:
  """The baseline's format: the dtype of the Linears' forward GEMMs."""
  lhs = [r['lhs'] for r in rows if r['linear'] and r['pass'] == 'fprop']
  common = collections.Counter(lhs).most_common(1)
  return _BASELINES.get(common[0][0] if common else 'bf16', 'bf16')


def describe_assumptions(gpu: gpus.Gpu,
                         assumptions: gpus.Assumptions) -> dict[str, Any]:
  """Every figure the prediction rests on, for the JSON."""
  return dict(peaks_flops=dict(gpu.peaks),
              memory_bandwidth=gpu.memory_bandwidth, sms=gpu.sms,
              gemm_efficiency=assumptions.gemm_efficiency,
              memory_efficiency=assumptions.memory_efficiency,
              kernel_seconds=assumptions.kernel_seconds,
              tile=assumptions.tile,
              split_k='K split over idle SMs where the output tiles fill '
                      'under a quarter of them',
              fusion='haiku_mp/lab/studies/gpu_traffic.py (module '
                     'docstring)')


def step(result: dict[str, Any], selected: Optional[set[str]] = None
         ) -> dict[str, Any]:
  """The step per format: every matmul (the low-bit ones' Linears in the
  format where `selected` holds them, all candidates by default) and the
  rest; its speedup over the baseline and its images/s."""
  base = result['baseline']
  seconds, parts = {}, {}
  for fmt in result['formats']:
    gemms = low = 0.0
    for row in result['matmuls']:
      in_fmt = row['low_bit'] and (selected is None or row['name'] in selected)
      value = row['seconds'][fmt if in_fmt else base]
      if value is None:
        value = row['seconds'][base]
      if in_fmt and fmt != base:
        low += value
      else:
        gemms += value
    total = gemms + low + result['rest']['seconds']
    seconds[fmt] = total
    parts[fmt] = dict(matmuls=gemms, low_bit_linears=low,
                      rest=result['rest']['seconds'])
  return dict(seconds=seconds,
              speedup={f: seconds[base] / s for f, s in seconds.items()},
              images_per_second={f: result['batch_size'] / s
                                 for f, s in seconds.items()},
              parts=parts)


def linear_gains(result: dict[str, Any], gpu: gpus.Gpu,
                 assumptions: gpus.Assumptions,
                 shapes: dict[str, tuple]) -> list[dict[str, Any]]:
  """Each candidate Linear's shape, its three GEMMs' seconds per format in
  the step, and per low-bit format the gain `placement.choose` predicts
  (the one a run with `modules='auto'` chooses by)."""
  by_linear = collections.defaultdict(lambda: collections.defaultdict(float))
  for row in result['matmuls']:
    if row['low_bit']:
      for fmt, s in row['seconds'].items():
        by_linear[row['name']][fmt] += s or 0.0
  layers = [placement.LinearShape(name, *shapes[name][:3],
                                  element_bytes(shapes[name][3]))
            for name in sorted(by_linear) if name in shapes]
  gains = {l.path: {} for l in layers}
  for fmt in result['formats'][1:]:
    for choice in placement.choose(layers, fmt, gpu.name, assumptions):
      gains[choice.linear.path][fmt] = choice.gain
  return [dict(name=l.path, m=l.m, k=l.k, n=l.n,
               seconds=dict(by_linear[l.path]), gain=gains[l.path])
          for l in layers]


def where_it_pays(result: dict[str, Any]) -> dict[str, Any]:
  """Per low-bit format, the Linears predicted to gain in it (the rest stay
  in the baseline), and the step with only those in the format."""
  placed = {}
  for fmt in result['formats'][1:]:
    paying = {g['name'] for g in result['linears']
              if (g['gain'].get(fmt) or 0) > 1}
    timed = step(result, paying)
    placed[fmt] = dict(linears=sorted(paying),
                       seconds=timed['seconds'][fmt],
                       speedup=timed['speedup'][fmt])
  return placed


def with_wire(result: dict[str, Any], path: str) -> dict[str, Any]:
  """`result`'s step per format joined with `launch.lab communication`'s
  paper times from its JSON at `path` (the same model and per-device batch):
  per variant and link, the wire's seconds, and the step as the longer of
  the two (full overlap) and as their sum (none)."""
  try:
    with open(path) as f:
      communication = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.ConfigError(f'--communication={path}: cannot read a '
                             f'`launch.lab communication` JSON ({e})')
  variants = communication.get('variants')
  if not isinstance(variants, list) or not variants:
    raise errors.ConfigError(f'--communication={path}: holds no variants of '
                             '`launch.lab communication`')
  joined = []
  for v in variants:
    per_device = v['batch_size'] // (math.prod(
        int(d) for d in v['layout'].split(':')[1].split('x')))
    for link in WIRE_LINKS:
      paper = v['paper'].get(link)
      if paper is None:
        continue
      wire = paper['comm_seconds']
      joined.append(dict(
          layout=v['layout'], wire=v['wire'], link=link,
          devices=wire_time.LINKS[link]['devices'],
          batch_per_device=per_device, wire_seconds=wire,
          overlapped={f: max(s, wire)
                      for f, s in result['step']['seconds'].items()},
          serial={f: s + wire for f, s in result['step']['seconds'].items()}))
  return joined
