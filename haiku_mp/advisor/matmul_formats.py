"""The advisor's one pipeline for low-bit matmuls, driven by a format entry.

A `MatmulFormat` says how a format would hold a Linear's three operands
(its input, its output gradient and its weight): the statistics the probes
take of each on the device (`activations`, `weight`), the extra input a
layer's probe needs per batch (`extra`), how a tensor's statistics read
(`describe`) and which limits they must keep per choice (`check`). fp8
(`fp8_numerics.Fp8Matmuls`, a choice per scaling) and 4 bits
(`fp4_numerics.Fp4Matmuls`, a choice per format) are its entries; a new
format is one more. Everything else is shared: the probes
(`probes.linear_statistics_fn`), the sums over batches
(`measurement.measure_matmuls`), the verdicts and the settings to paste
(`judge`).

A Linear runs a format well at a choice when `check` finds nothing: it gets
`<name>-ok`. Otherwise it keeps the wider format judged before it (4 bits
fall back on fp8 at current scaling: `keep-fp8`) where that one passes, and
bfloat16 (`keep-bf16`, left out of the `LowBit`'s modules) elsewhere.
"""

import abc
import dataclasses
from typing import Any, ClassVar, Mapping, Optional, Sequence

import jax
import numpy as np

from haiku_mp.advisor import numerics
from haiku_mp.model import fp8

# A Linear's operands, in the order of a probe's statistics vector.
OPERANDS = ('input', 'gradient', 'weight')
KEEP_BF16 = 'keep-bf16'


def ok(name: str) -> str:
  """The verdict of a Linear that runs format family `name` well."""
  return f'{name}-ok'


def keep(name: str) -> str:
  """The verdict of a Linear that keeps format family `name`."""
  return f'keep-{name}'


class MatmulFormat(abc.ABC):
  """A low-bit format family the advisor measures and judges (subclasses
  are frozen dataclasses of the measurement's options).

  Example:
    fmt = advisor.Fp4Matmuls(hadamard=False)
    totals = advisor.measure_matmuls(loss_fn, params, batches, paths, fmt)
  """
  name: ClassVar[str]  # The verdicts' word: 'fp8' gives 'fp8-ok'.
  title: ClassVar[str]  # A heading's word: 'fp8', '4 bits'.
  choices: ClassVar[tuple[str, ...]]  # A verdict per choice.
  # The statistics' sizes of `OPERANDS`, and the indices in each merged by
  # max rather than summed (a largest magnitude).
  part_sizes: ClassVar[tuple[int, int, int]]
  max_at: ClassVar[tuple[int, ...]] = ()
  columns: ClassVar[tuple[str, ...]]  # `cells`' headings.
  # The wider format's choice a Linear that fails here would run (4 bits'
  # fp8 layers: current scaling); None: it falls back on bfloat16 only.
  fallback_choice: ClassVar[Optional[str]] = None

  @abc.abstractmethod
  def extra(self, path: str, history: Sequence[Sequence[np.ndarray]]
            ) -> np.ndarray:
    """The probe's extra input of the Linear at `path` for the next batch,
    given its earlier batches' statistics (`split` parts), oldest first."""

  @abc.abstractmethod
  def activations(self, x: jax.Array, g: jax.Array, extra: jax.Array
                  ) -> jax.Array:
    """The statistics of a Linear's input and output gradient, one vector
    of `part_sizes[0] + part_sizes[1]` (traced, in the probe's backward)."""

  @abc.abstractmethod
  def weight(self, w: jax.Array, extra: jax.Array) -> jax.Array:
    """The statistics of a Linear's weight, `part_sizes[2]` long."""

  @abc.abstractmethod
  def describe(self, stats: np.ndarray, operand: str) -> dict[str, Any]:
    """One operand's statistics as the shares and errors people read."""

  @abc.abstractmethod
  def check(self, operands: Mapping[str, dict], choice: str, limits
            ) -> list[str]:
    """Why the Linear whose `describe`d operands these are cannot run
    `choice` within `limits`; empty when it can."""

  @abc.abstractmethod
  def cells(self, row: Mapping[str, Any], choice: str) -> list[str]:
    """A judged row's `columns`, for the advice's table."""

  @property
  def size(self) -> int:
    return sum(self.part_sizes)

  def options(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def split(self, vector) -> list[np.ndarray]:
    """A Linear's statistics vector as its operands' parts."""
    vector = np.asarray(vector, np.float64)
    ends = np.cumsum(self.part_sizes)
    return [vector[end - n:end] for n, end in zip(self.part_sizes, ends)]

  def merge(self, a: Sequence[np.ndarray], b: Sequence[np.ndarray]
            ) -> list[np.ndarray]:
    """Two batches' parts of a Linear as one."""
    return [numerics.merge(x, y, self.max_at) for x, y in zip(a, b)]


def modules_setting(candidates: Sequence[str], kept: Sequence[str],
                    configured: str) -> str:
  """The `LowBit` modules (``'TARGET;...'``) that run low-bit matmuls in
  `candidates` but `kept`: `configured` when nothing is kept, else the
  paths left."""
  if not kept:
    return configured
  return ';'.join(p for p in candidates if p not in kept)


def candidates_setting(modules: str) -> str:
  """The modules the advice considers: a model's low-bit `modules`, or
  `fp8.DEFAULT_MODULES` when it runs none or lets the speed model choose
  ('auto')."""
  modules = modules.strip()
  return fp8.DEFAULT_MODULES if modules in ('', 'auto') else modules


def judge(totals: Mapping[str, Sequence[np.ndarray]], fmt: MatmulFormat,
          choice: str, limits, targets: str,
          fallback: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
  """The verdicts of `measurement.measure_matmuls`' Linears under `fmt`:
  per path a verdict and its reasons per choice; at `choice`, the paths
  that keep bfloat16 and those that keep `fallback`'s format (an earlier
  `judge`'s result: a Linear keeps it where its verdict at
  `fmt.fallback_choice` passes), and
  the `LowBit` `modules` (`low_bit_modules`, from `targets`, the
  candidates') and `keep_fp8` (`keep_fp8_setting`) that run exactly that.

  Example:
    totals = advisor.measure_matmuls(loss_fn, params, batches, paths,
                                     advisor.Fp8Matmuls())
    judged = advisor.judge_matmuls(totals, advisor.Fp8Matmuls(), 'current',
                                   fp8_limits, 'Linear')
    precision = haiku_mp.make_precision(
        BF16, model_class=hk.nets.MLP,
        low_bit=haiku_mp.LowBit(judged['low_bit_modules']))
  """
  wider = {}
  if fallback is not None:
    passed = ok(fallback['format'])
    wider = {r['path']: r['verdicts'][fmt.fallback_choice] == passed
             for r in fallback['modules']}
  fallback_verdict = keep(fallback['format']) if fallback else KEEP_BF16
  rows, chosen = [], {}
  for path, parts in totals.items():
    operands = {name: fmt.describe(stats, name)
                for name, stats in zip(OPERANDS, parts)}
    reasons = {c: fmt.check(operands, c, limits) for c in fmt.choices}
    verdicts = {c: ok(fmt.name) if not r else
                fallback_verdict if wider.get(path) else KEEP_BF16
                for c, r in reasons.items()}
    chosen[path] = verdicts[choice]
    rows.append(dict(path=path, verdicts=verdicts,
                     reasons={c: r for c, r in reasons.items() if r},
                     **operands))
  keep_bf16 = [p for p, v in chosen.items() if v == KEEP_BF16]
  keep_wider = [p for p, v in chosen.items()
                if fallback and v == fallback_verdict]
  return dict(format=fmt.name, choice=choice, options=fmt.options(),
              fallback=fallback['format'] if fallback else None,
              modules=rows, keep_bf16=keep_bf16, keep_fp8=keep_wider,
              low_bit_modules=modules_setting(list(totals), keep_bf16,
                                              targets),
              keep_fp8_setting=';'.join(keep_wider))
