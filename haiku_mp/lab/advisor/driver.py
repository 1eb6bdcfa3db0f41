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
   (`numerics`), the float16 shares at the step's loss scale
   (`module_statistics`).
2. Verdicts per module and format, the float16 loss-scale window, and the
   config to paste (`advice`).
2b. Low-bit matmuls (`low_bit_advice.matmul_advice`, once per format of
   `matmul_formats_of`): at the measured params, one more pass per batch
   measures each candidate Linear's input, weight and output gradient as
   the format would hold them (`matmul_formats`): fp8 as E4M3 / E5M2 under
   current, delayed and MX scaling, then 4 bits as NVFP4 and MXFP4 would
   block them; a verdict per choice (4 bits fall back on fp8, fp8 on
   bfloat16) and the `precision.low_bit.modules` and `keep_fp8` to paste.
3. `--level=knockout`: one module at a time in the half format (a path
   override on the float32 model), its loss and logits against float32's
   on the same batches, ranked (`knockout`).
4. Cost: the statistics pass against the config's own train step, timed on
   the same batch in this process (`module_statistics.cost`).
"""

import os
import time
from typing import Any, Callable

import numpy as np

from haiku_mp.advisor import numerics
from haiku_mp.advisor import verdicts
from haiku_mp import errors
from haiku_mp.lab import hardware
from haiku_mp.lab import run_inputs
from haiku_mp.lab import variants
from haiku_mp.lab.advisor import advice_flags
from haiku_mp.lab.advisor import knockout
from haiku_mp.lab.advisor import low_bit_advice
from haiku_mp.lab.advisor import module_statistics
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


def run(settings: settings_schema.Settings, checkpoint: str = '',
        checkpoint_step: int = -1, num_batches: int = 8,
        level: str = 'stats', repeats: int = 3,
        log: Callable[[str], None] = print, gpu: str = '') -> dict[str, Any]:
  """The advisor's result as a JSON-ready dict (`advisor_files.write` makes
  the files); with a `gpu` named (`gpus.NAMES`), fp8's verdicts weigh its
  predicted time too (`low_bit_advice.with_predicted_time`)."""
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
  modules, scales, stats, state = module_statistics.gather_statistics(
      exp, state, inputs, log)
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
  for fmt, choice in low_bit_advice.matmul_formats_of(settings):
    fallback = result[fmt.name] = low_bit_advice.matmul_advice(
        settings, exp, state.params, inputs, fmt, choice, limits[fmt.name],
        fallback, log, gpu)
  if level == 'knockout':
    paths = [m.path for m in modules if m.same_as is None]
    result['knockout'] = knockout.knockout(reference, state.params, inputs,
                                           paths, formats, log)
  result['cost'] = module_statistics.cost(settings, stats, state, inputs[0],
                                          repeats)
  log(f'advise: statistics pass {result["cost"]["statistics_pass_sec"]:.3f} s '
      f'= {result["cost"]["ratio"]:.2f}x the train step')
  return result
