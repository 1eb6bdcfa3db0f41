"""The advisor's 4-bit verdicts: per Linear layer and 4-bit format, 4 bits
are fine, or the layer keeps fp8, or bfloat16, and why.

A Linear runs a 4-bit format well when each of its GEMMs' operands, blocked
as the train step blocks them (`fp4_numerics.CASES`; the weight gradient's
inputs through the Hadamard transform when the config applies it), has at
most `fp4_max_flushed_share` of its blocks flushed by an outlier (a block
whose other values an outlier pushes under E2M1's smallest step: the norm
survives, the block's information does not) and loses at most
`fp4_max_relative_error` of its norm to rounding. A layer that fails keeps
fp8 where its fp8 verdict passes (`precision.fp8.keep_fp8`), and bfloat16
otherwise (left out of `precision.fp8.modules`).
"""

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from haiku_mp.advisor import fp4_numerics
from haiku_mp.advisor import fp8_verdicts

FP4_OK = 'fp4-ok'
KEEP_FP8 = 'keep-fp8'
KEEP_BF16 = fp8_verdicts.KEEP_BF16
_TENSORS = ('input', 'gradient', 'weight')


@dataclasses.dataclass(frozen=True)
class Fp4Thresholds:
  """How much of an operand a 4-bit format may lose (`config.advisor`'s
  fp4 limits; the module docstring says why each).

  Example:
    limits = advisor.Fp4Thresholds(max_relative_error=0.2,
                                   max_flushed_share=0.05)
  """
  max_relative_error: float
  max_flushed_share: float


def operands(parts: Sequence[np.ndarray]) -> dict[str, dict]:
  """A Linear's statistics (`fp4_numerics.split`'s parts) as
  `fp4_numerics.as_dict` per operand."""
  return {name: fp4_numerics.as_dict(stats, name)
          for name, stats in zip(_TENSORS, parts)}


def cases(hadamard: bool) -> dict[str, tuple[str, ...]]:
  """The blockings the train step uses, per operand."""
  wgrad = 'wgrad_hadamard' if hadamard else 'wgrad'
  return {'input': ('forward', wgrad), 'gradient': ('dgrad', wgrad),
          'weight': ('forward',)}


def judge(operands: Mapping[str, dict], fmt: str, hadamard: bool,
          limits: Fp4Thresholds) -> tuple[bool, list[str]]:
  """(whether `fmt` holds the Linear's operands, the reasons it does not)."""
  reasons = []
  for name, used in cases(hadamard).items():
    for case in used:
      s = operands[name][fmt][case]
      where = f'{name} ({case.replace("_", " + ")})'
      if s['flushed_share'] > limits.max_flushed_share:
        reasons.append(
            f'{100 * s["flushed_share"]:.3g}% of the {where}\'s {fmt} blocks '
            f'are flushed by an outlier (> '
            f'{100 * limits.max_flushed_share:g}%)')
      if s['relative_error'] > limits.max_relative_error:
        reasons.append(f'{where} in {fmt} errs by {s["relative_error"]:.3g} '
                       f'of its norm (> {limits.max_relative_error:g})')
  return not reasons, reasons


def verdict(fits: bool, fp8_verdict: str) -> str:
  """4 bits where they fit; else fp8 where fp8's verdict passes; else
  bfloat16."""
  if fits:
    return FP4_OK
  return KEEP_FP8 if fp8_verdict == fp8_verdicts.FP8_OK else KEEP_BF16


def settings(candidates: list[str], verdicts: Mapping[str, str],
             configured: str) -> dict[str, str]:
  """`precision.fp8.modules` and `precision.fp8.keep_fp8` for the verdicts:
  the candidates but those kept in bfloat16 (the configured setting when
  none is), and those kept in fp8."""
  bf16 = [p for p in candidates if verdicts[p] == KEEP_BF16]
  fp8_kept = [p for p in candidates if verdicts[p] == KEEP_FP8]
  return dict(modules=fp8_verdicts.modules_setting(candidates, bf16,
                                                   configured),
              keep_fp8=';'.join(fp8_kept))
