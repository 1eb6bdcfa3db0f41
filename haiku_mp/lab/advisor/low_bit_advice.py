"""The advisor's low-bit matmuls on the ViT: the Linears it judges, the
formats it judges them in (fp8, then 4 bits), each Linear's verdicts at the
measured params, the speed model's predicted gain where a GPU is named, and
the `precision.low_bit` flags to paste (`advice_flags`).
"""

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from haiku_mp.advisor import fp4_numerics
from haiku_mp.advisor import fp8_numerics
from haiku_mp.advisor import matmul_formats
from haiku_mp.advisor import measurement
from haiku_mp.advisor import placement
from haiku_mp.advisor import verdicts
from haiku_mp.lab import variants
from haiku_mp.lab.advisor import advice_flags
from haiku_mp.lab.advisor import module_statistics
from haiku_mp.model import fp4 as fp4_lib
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit import settings as settings_schema
from haiku_mp.vit.train import experiment


def low_bit_candidates(settings: settings_schema.Settings,
                       exp: experiment.Experiment) -> list[str]:
  """The Linear layers the low-bit advice judges: those the config's
  low-bit modules select, or `fp8.DEFAULT_MODULES`'s when it runs none."""
  return measurement.low_bit_linears(module_statistics.module_classes(exp),
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
  return dict(judged, thresholds=dataclasses.asdict(limits),
              suggestion=dict(modules=judged['low_bit_modules'],
                              flags=suggestion_flags(settings, judged, fmt,
                                                     choice)))


def suggestion_flags(settings: settings_schema.Settings,
                     judged: dict[str, Any],
                     fmt: matmul_formats.MatmulFormat, choice: str
                     ) -> list[str]:
  """The flags to paste that run `choice` on `judged`'s low-bit modules
  (keeping its fp8 ones, for 4 bits); a float16 config, which no low-bit
  format runs in, gets a bfloat16 policy first."""
  flags = [f"--config.precision.low_bit.modules='{judged['low_bit_modules']}'",
           *advice_flags.low_bit_flags(fmt, choice)]
  if judged['keep_fp8_setting']:
    flags.append(f"--config.precision.low_bit.keep_fp8='"
                 f"{judged['keep_fp8_setting']}'")
  if variants.compute_dtype(settings) == 'float16':
    flags.insert(0, '--config.precision.policy=' + verdicts.policy(
        settings.precision.policy, 'bfloat16', 'float32'))
  return flags


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
