"""The advisor's 8-bit verdicts: per Linear layer and fp8 scaling, fp8 is
fine, or the layer keeps bfloat16, and why.

A Linear runs fp8 well at a scaling when each of its matmul's operands, the
input and weight in E4M3 and the output gradient in E5M2, held at the scales
that scaling uses (`fp8_numerics`), loses at most
`fp8_max_relative_error` of its norm to rounding, has at most
`fp8_max_underflow_share` of its non-zero values flushed to zero (a tensor
whose values span more binades than the format: its norm may survive while
most of its values do not) and at most `fp8_max_saturate_share` clipped at
the largest finite value (a delayed scale behind a growing tensor).
"""

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from haiku_mp.advisor import fp8_numerics
from haiku_mp.model import fp8

FP8_OK = 'fp8-ok'
KEEP_BF16 = 'keep-bf16'
# The three operands of a Linear's matmuls and the format each runs in.
TENSORS = (('input', 'E4M3'), ('gradient', 'E5M2'), ('weight', 'E4M3'))


@dataclasses.dataclass(frozen=True)
class Fp8Thresholds:
  """How much of an operand E4M3 / E5M2 may lose (`config.advisor`'s fp8
  limits; the module docstring says why each).

  Example:
    limits = advisor.Fp8Thresholds(max_relative_error=0.1,
                                   max_underflow_share=0.01, max_saturate_share=0.0)
  """
  max_relative_error: float
  max_underflow_share: float
  max_saturate_share: float


def operands(parts: Sequence[np.ndarray]) -> dict[str, dict]:
  """A Linear's statistics (`fp8_probes.split`'s parts) as
  `fp8_numerics.as_dict` per operand."""
  return {name: fp8_numerics.as_dict(stats)
          for (name, _), stats in zip(TENSORS, parts)}


def judge(operands: Mapping[str, dict], scaling: str,
          limits: Fp8Thresholds) -> tuple[str, list[str]]:
  """(verdict, reasons) of one Linear at `scaling`."""
  reasons = []
  for name, fmt in TENSORS:
    s = operands[name][scaling]
    if s['relative_error'] > limits.max_relative_error:
      reasons.append(f'{name} in {fmt} errs by {s["relative_error"]:.3g} of '
                     f'its norm (> {limits.max_relative_error:g})')
    if s['underflow_share'] > limits.max_underflow_share:
      reasons.append(f'{100 * s["underflow_share"]:.3g}% of the {name}\'s '
                     f'values underflow to 0 in {fmt} (> '
                     f'{100 * limits.max_underflow_share:g}%)')
    if s['saturate_share'] > limits.max_saturate_share:
      reasons.append(f'{100 * s["saturate_share"]:.3g}% of the {name}\'s '
                     f'values saturate in {fmt} (> '
                     f'{100 * limits.max_saturate_share:g}%)')
  return (KEEP_BF16 if reasons else FP8_OK), reasons


def modules_setting(candidates: list[str], kept: list[str],
                    configured: str) -> str:
  """The `precision.fp8.modules` value that runs fp8 in `candidates` but
  `kept`: the configured one when nothing is kept, else the paths left."""
  if not kept:
    return configured
  return ';'.join(p for p in candidates if p not in kept)


def candidates_setting(config) -> str:
  """The modules the advice considers: the config's fp8 modules, or
  `fp8.DEFAULT_MODULES` when it runs none."""
  return config.precision.fp8.modules.strip() or fp8.DEFAULT_MODULES
