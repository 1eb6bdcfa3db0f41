"""The precision advisor (`launch.lab advise`): which precision each module
can run in, and which float16 loss scale, measured on the config's model and
a few real batches.

1. Statistics: the config's model computing in float32 (its params' dtype,
   optimizer and loss scale kept, so a run's checkpoint restores into it)
   takes `batches` training steps from its params (a checkpoint, or init
   after `advisor.init_steps` steps: a zero-initialized head passes almost
   no gradient back at first, which says nothing about a run); before each,
   one extra jitted forward and backward (`probes`) measures every module's
   output, the gradient flowing into it and its params' gradients
   (`numerics`), the float16 shares at the step's loss scale.
2. Verdicts per module and format, the float16 loss-scale window, and the
   config to paste (`advice`).
2b. Low-bit matmuls (`matmul_advice`, once per format of
   `matmul_formats_of`): at the measured params, one more pass per batch
   measures each candidate Linear's input, weight and output gradient as
   the format would hold them (`matmul_formats`): fp8 as E4M3 / E5M2 under
   current, delayed and MX scaling, then 4 bits as NVFP4 and MXFP4 would
   block them; a verdict per choice (4 bits fall back on fp8, fp8 on
   bfloat16) and the `precision.low_bit.modules` and `keep_fp8` to paste
   (`advice_flags`).
3. `--level=knockout`: one module at a time in the half format
   (`knockout`).
4. Cost: the statistics pass against the config's own train step, timed on
   the same batch in this process.
"""

import dataclasses
import os
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from haiku_mp.advisor import fp4_numerics
from haiku_mp.advisor import fp8_numerics
from haiku_mp.advisor import matmul_formats
from haiku_mp.advisor import measurement
from haiku_mp.advisor import numerics
from haiku_mp.advisor import placement
from haiku_mp.advisor import probes
from haiku_mp.advisor import verdicts
from haiku_mp import errors
from haiku_mp.lab import hardware
from haiku_mp.lab import run_inputs
from haiku_mp.lab import timing
from haiku_mp.lab import variants
from haiku_mp.lab.advisor import advice_flags
from haiku_mp.lab.advisor import knockout as knockout_lib
from haiku_mp.model import fp4 as fp4_lib
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit import settings as settings_schema
from haiku_mp.vit.settings import fields as settings_fields
from haiku_mp.vit.train import experiment

LEVELS = ('stats', 'knockout')
HALF_DTYPES = ('float16', 'bfloat16')


def _check(num_batches: int, level: str, steps: int, checkpoint: str
           ) -> None:
  if checkpoint and not os.path.isdir(os.path.join(checkpoint, 'checkpoints')):
    raise errors.ConfigError(
        f'--checkpoint={checkpoint}: no checkpoints directory in it (a '
        'workdir of launch.train holds one)')
  if num_batches < 1:
    raise errors.ConfigError(f'--batches={num_batches} must be at least 1')
  errors.check_choice('--level', level, LEVELS)
  if steps < 1:
    raise errors.ConfigError(f'--steps={steps} must be at least 1')


def module_classes(exp: experiment.Experiment) -> dict[str, str]:
  """Each module path called (in call order) -> its class name."""
  return {c.path: c.class_name for c in exp.module_calls
          if c.method == '__call__'}


def gather_statistics(exp: experiment.Experiment, state, inputs,
                      log: Callable[[str], None],
                      loss_fn: Optional[probes.LossFn] = None):
  """Statistics over `inputs`, a train step between batches.

  Returns (modules, loss scales seen, the statistics function, the state
  after the steps; `state` itself is donated to them). `loss_fn`
  (default: the experiment's) is what is differentiated; a test plants
  faults through it.
  """
  classes = module_classes(exp)
  stats = probes.statistics_fn(loss_fn or exp.loss_fn, classes)
  # As the train steps leave it: every batch's statistics one program,
  # whichever way `state` was made.
  state = exp.strategy.place_state(state)
  totals = measurement.Totals()
  scales = []
  key = jax.random.key(exp.settings.seed + 1)
  for i, batch in enumerate(inputs):
    start = time.perf_counter()
    scales.append(float(state.loss_scale.scale))
    totals.add(*stats.fn(state.params, jax.random.fold_in(key, i), batch,
                         scales[-1]))
    if i + 1 < len(inputs):
      state, _ = exp.strategy.train_step(state, exp.strategy.place_batch(batch))
    log(f'advise: batch {i + 1}/{len(inputs)} measured (loss scale '
        f'{scales[-1]:g}, {time.perf_counter() - start:.1f} s)')
  return totals.modules(classes, stats.aliases), scales, stats, state


def _stats_json(stats: np.ndarray) -> dict[str, Any]:
  named = numerics.as_dict(stats)
  return {k: named[k] for k in (
      'count', 'nonzero', 'zeros', 'nonfinite', 'amax', 'f16_flush_share',
      'f16_subnormal_share', 'f16_overflow_share', 'f16_relative_error',
      'bf16_relative_error', 'histogram')}


def _scale_json(window) -> dict[str, Any]:
  lo, hi = window
  return dict(exponents=[lo, hi],
              scales=[None if lo is None else 2.0**lo,
                      None if hi is None else 2.0**hi])


def inherits(exp: experiment.Experiment) -> dict[str, bool]:
  """Whether each module call has no precision rule of its own (it inherits
  its caller's policy) in the config."""
  return {c.path: exp.precision.rule_for(c.class_name, c.path) is None
          for c in exp.module_calls}


def _suggestion(settings, exp, modules, judged: verdicts.Advice, fmt: str
                ) -> dict[str, Any]:
  """The config for half format `fmt` that follows from the verdicts."""
  half = verdicts.policy(settings.precision.policy, fmt, fmt)
  policy = verdicts.policy(settings.precision.policy, fmt, 'float32')
  overrides = verdicts.overrides(modules, judged, fmt, inherits(exp), half)
  flags = [f'--config.precision.policy={policy}',
           f"--config.precision.overrides='{overrides}'"]
  loss_scale = verdicts.loss_scale(fmt, judged.scale_window)
  flags += advice_flags.loss_scale_flags(loss_scale)
  kept = [p for p, v in judged.verdicts.items() if getattr(v, fmt) ==
          verdicts.KEEP]
  return dict(policy=policy, overrides=overrides, loss_scale=loss_scale,
              keep_f32=kept, flags=flags)


def low_bit_candidates(settings: settings_schema.Settings,
                       exp: experiment.Experiment) -> list[str]:
  """The Linear layers the low-bit advice judges: those the config's
  low-bit modules select, or `fp8.DEFAULT_MODULES`'s when it runs none."""
  return measurement.low_bit_linears(module_classes(exp),
                                     _candidates_setting(settings))


def _candidates_setting(settings: settings_schema.Settings) -> str:
  return matmul_formats.candidates_setting(settings.precision.low_bit.modules)


def matmul_formats_of(settings: settings_schema.Settings
                      ) -> list[tuple[matmul_formats.MatmulFormat, str]]:
  """The formats the low-bit advice judges, widest first, each with the
  choice its flags select: fp8 at the config's scaling, then 4 bits at the
  config's 4-bit format (NVFP4 when it runs fp8)."""
  low_bit = settings.precision.low_bit
  fp4_format = (low_bit.format if low_bit.format in fp4_lib.FORMATS
                else fp4_lib.FORMATS[0])
  fp8_scaling = (low_bit.scaling if low_bit.format == 'fp8'
                 else fp8_numerics.Fp8Matmuls.choices[0])
  return [(fp8_numerics.Fp8Matmuls(low_bit.history_length,
                                   low_bit.margin), fp8_scaling),
          (fp4_numerics.Fp4Matmuls(low_bit.hadamard), fp4_format)]


def matmul_advice(settings: settings_schema.Settings,
                  exp: experiment.Experiment, params, inputs,
                  fmt: matmul_formats.MatmulFormat, choice: str, limits,
                  fallback: Optional[dict[str, Any]],
                  log: Callable[[str], None], gpu: str = '') -> dict[str, Any]:
  """The verdicts of the config's candidate Linears under `fmt` over
  `inputs` at `params` (`measurement.measure_matmuls`,
  `matmul_formats.judge`; `fallback`: the wider format's advice), and the
  flags that run `choice` where it fits, the wider format or bfloat16
  elsewhere. With a `gpu` named, fp8's verdicts gain the speed model's
  predicted time, and the flags keep fp8 only where it is safe and
  faster."""
  totals = measurement.measure_matmuls(
      exp.loss_fn, params, inputs, low_bit_candidates(settings, exp), fmt,
      log)
  judged = matmul_formats.judge(totals, fmt, choice, limits,
                                _candidates_setting(settings), fallback)
  if gpu and fmt.name == fp8_numerics.Fp8Matmuls.name:
    judged = with_predicted_time(judged, settings, exp, gpu)
  modules = judged['low_bit_modules']
  flags = [f"--config.precision.low_bit.modules='{modules}'",
           *advice_flags.low_bit_flags(fmt, choice)]
  if judged['keep_fp8_setting']:
    flags.append(f"--config.precision.low_bit.keep_fp8='"
                 f"{judged['keep_fp8_setting']}'")
  if variants.compute_dtype(settings) == 'float16':
    flags.insert(0, '--config.precision.policy=' + verdicts.policy(
        settings.precision.policy, 'bfloat16', 'float32'))
  return dict(judged, thresholds=dataclasses.asdict(limits),
              suggestion=dict(modules=modules, flags=flags))


def with_predicted_time(judged: dict[str, Any],
                        settings: settings_schema.Settings,
                        exp: experiment.Experiment, gpu: str
                        ) -> dict[str, Any]:
  """fp8's verdicts (`matmul_formats.judge`) with each Linear's predicted
  gain on `gpu` at the config's batch and compute dtype
  (`placement.choose`): a Linear safe in fp8 but slower keeps bfloat16
  (`slower`), and `low_bit_modules` runs fp8 where it is both."""
  fmt = placement.low_bit_format(judged['choice'])
  compute = np.dtype(variants.compute_dtype(settings)).itemsize
  linears = {l.path: dataclasses.replace(l, compute_bytes=compute)
             for l in forward_lib.linear_shapes(exp.module_calls,
                                          settings.batch_size)}
  paths = [r['path'] for r in judged['modules']]
  choices = {c.linear.path: c for c in placement.choose(
      [linears[p] for p in paths], fmt, gpu)}
  rows = []
  for row in judged['modules']:
    c = choices[row['path']]
    rows.append(dict(row, speed=dict(gpu=gpu, format=fmt, gain=c.gain,
                                     faster=c.low_bit, why=c.why(fmt))))
  passed = matmul_formats.ok(judged['format'])
  safe = [r['path'] for r in judged['modules']
          if r['verdicts'][judged['choice']] == passed]
  slower = [p for p in safe if not choices[p].low_bit]
  return dict(judged, modules=rows, speed_gpu=gpu, speed_format=fmt,
              slower=slower, low_bit_modules=matmul_formats.modules_setting(
                  paths, judged['keep_bf16'] + slower,
                  _candidates_setting(settings)))


def _time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # Compiles, or warms up.
  return timing.median_seconds(fn, (), repeats)


def cost(settings: settings_schema.Settings, stats: probes.StatisticsFn,
         state, batch, repeats: int) -> dict[str, Any]:
  """The statistics pass against the config's own train step (its
  precision, one device), on the same batch, in this process."""
  settings = variants.on_one_device(settings)
  step = timing.compile_experiment(
      experiment.build_without_data(settings))
  step_state = step.experiment.strategy.init_state()
  placed = step.experiment.strategy.place_batch(batch)

  def train():
    nonlocal step_state
    step_state, metrics = step.compiled(step_state, placed)
    return metrics['loss']

  key = jax.random.key(0)
  # The scale as `measure` passed it (a Python float): the same program, not
  # a second compile for a strongly typed float32.
  scale = float(state.loss_scale.scale)
  stats_sec = _time(lambda: stats.fn(state.params, key, batch, scale), repeats)
  train_sec = _time(train, repeats)
  return dict(statistics_pass_sec=stats_sec, train_step_sec=train_sec,
              ratio=stats_sec / train_sec, batch_size=settings.batch_size,
              train_step_policy=settings.precision.policy)


def run(settings: settings_schema.Settings, checkpoint: str = '',
        checkpoint_step: int = -1, num_batches: int = 8,
        level: str = 'stats', repeats: int = 3,
        log: Callable[[str], None] = print, gpu: str = '') -> dict[str, Any]:
  """The advisor's result as a JSON-ready dict (`advisor_files.write` makes
  the files); with a `gpu` named (`gpus.NAMES`), fp8's verdicts weigh its
  predicted time too (`with_predicted_time`)."""
  advisor_settings = settings.advisor
  _check(num_batches, level, repeats, checkpoint)
  thresholds = advisor_settings.thresholds
  target = variants.compute_dtype(settings)
  formats = [target] if target in HALF_DTYPES else list(HALF_DTYPES)
  reference = variants.float32_reference(settings)
  exp = experiment.build(reference)
  state, step, source = run_inputs.initial_state(exp, checkpoint,
                                                 checkpoint_step)
  init_steps = 0 if checkpoint else advisor_settings.init_steps
  start = time.perf_counter()
  batches = run_inputs.training_batches(reference, init_steps + num_batches,
                                        step)
  log(f'advise: {init_steps + num_batches} batches of {settings.batch_size} '
      f'from step {step} ({time.perf_counter() - start:.1f} s to load)')
  if init_steps:
    state = run_inputs.train_steps(exp, state, batches[:init_steps], log)
    source += f' + {init_steps} float32 steps'
  inputs = run_inputs.model_inputs(exp, batches[init_steps:], reference.seed)
  modules, scales, stats, state = gather_statistics(exp, state, inputs, log)
  judged = verdicts.judge(modules, thresholds)
  rows = []
  for m in modules:
    verdict = judged.verdicts.get(m.path) or judged.verdicts[m.same_as]
    rows.append(dict(
        path=m.path, class_name=m.class_name, same_as=m.same_as,
        verdicts=dict(bfloat16=verdict.bfloat16, float16=verdict.float16),
        reasons=verdict.reasons if m.path in judged.verdicts else {},
        window=_scale_json(verdict.window),
        output=_stats_json(m.output), gradient=_stats_json(m.gradient),
        param_gradients={n: _stats_json(s)
                         for n, s in sorted(m.param_gradients.items())}))
  result = dict(
      config=dict(policy=settings.precision.policy,
                  overrides=settings.precision.overrides,
                  compute_dtype=target,
                  loss_scale=settings_fields.to_dict(settings.loss_scale),
                  model=settings_fields.to_dict(settings.model),
                  batch_size=settings.batch_size,
                  data={k: getattr(settings.data, k) for k in (
                      'source', 'arrays_path', 'data_dir', 'train_split')}),
      params_from=source, start_step=step, batches=num_batches,
      loss_scales_seen=scales,
      thresholds=settings_fields.to_dict(settings.advisor),
      exponents=[int(e) for e in numerics.EXPONENTS],
      float16_window=_scale_json(judged.scale_window),
      suggestions={fmt: _suggestion(settings, exp, modules, judged, fmt)
                   for fmt in HALF_DTYPES},
      target=target, modules=rows, **hardware.describe())
  limits = {'fp8': advisor_settings.fp8, 'fp4': advisor_settings.fp4}
  fallback = None
  for fmt, choice in matmul_formats_of(settings):
    fallback = result[fmt.name] = matmul_advice(
        settings, exp, state.params, inputs, fmt, choice, limits[fmt.name],
        fallback, log, gpu)
  if level == 'knockout':
    paths = [m.path for m in modules if m.same_as is None]
    result['knockout'] = knockout_lib.knockout(
        reference, state.params, inputs, paths, formats, log)
  result['cost'] = cost(settings, stats, state, inputs[0], repeats)
  log(f'advise: statistics pass {result["cost"]["statistics_pass_sec"]:.3f} s '
      f'= {result["cost"]["ratio"]:.2f}x the train step')
  return result
