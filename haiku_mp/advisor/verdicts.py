"""Verdicts from numbers: which precision each module can run in, the float16
loss-scale window, and the config that follows.

Input: each module's statistics (`numerics`) of its output, of the gradient
flowing into it and of its params' gradients, measured in float32. Per half
format a module gets one verdict:

- bfloat16: `bf16-ok`, or `keep-f32` when rounding its output or gradient
  to bfloat16 errs by more than `max_relative_error` (bfloat16 has float32's
  range, so only precision can rule it out);
- float16: `keep-f32` when its output overflows (more than
  `max_overflow_share` of it) or errs by more than `max_relative_error`
  (tiny values flushing), when a float16 forward pass makes inf or NaN
  inside it (where one was run: what float32 statistics cannot see, such
  as a mask value that is -inf in float16), or when no loss scale keeps its
  gradients in range;
  otherwise `f16-ok` if it trains at scale 1, else `f16-needs-loss-scale`.

A module's loss-scale window is `[2^lo, 2^hi]`: `lo` the smallest power of
two that lifts its gradients above float16's subnormal range but for values
carrying at most `max_relative_error` of their norm (what flushing them
would cost at worst), `hi` the largest that keeps its largest gradient value
at most 65504 / `loss_scale_headroom`. Norms, not counts: at the scale a
float16 run of the CPU-sized ViT settled at (and matched float32's accuracy
with) 0.1-5% of most modules' gradient values were still subnormal, carrying
less than 1e-12 of their squared norm; at scale 1 the same values carried up
to a quarter of it. The model's window is their intersection; when it is
empty the modules that close it are kept in float32, one at a time, the one
whose removal widens the window most first.

A container whose output and gradient are those of one of its modules
(`Attention` returns its `out` projection's output) is not judged twice: it
is `same_as` that module; only its own params' gradients (the ViT's cls
token and position embedding) are judged, for the loss-scale window.
"""

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from haiku_mp.advisor import numerics
from haiku_mp.model import policy_strings

KEEP = 'keep-f32'
BF16_OK = 'bf16-ok'
F16_OK = 'f16-ok'
F16_SCALED = 'f16-needs-loss-scale'
F32_POLICY = 'params=float32,compute=float32,output=float32'
# The loss-scale exponents searched: far beyond any useful float16 scale.
_EXPONENTS = range(-64, 65)


@dataclasses.dataclass(frozen=True)
class Thresholds:
  """How much of a tensor a 16-bit format may lose: the advisor's limits.

  Example:
    limits = advisor.Thresholds(max_relative_error=0.01,
                                max_overflow_share=0.0, loss_scale_headroom=1.0)
  """
  max_relative_error: float
  max_overflow_share: float
  loss_scale_headroom: float


@dataclasses.dataclass
class Module:
  """One module call's statistics (numerics vectors, summed over batches)."""
  path: str
  class_name: str
  output: np.ndarray
  gradient: np.ndarray
  param_gradients: dict[str, np.ndarray]
  same_as: Optional[str] = None
  # Whether a float16 forward pass made inf or NaN inside it
  # (`measurement.nonfinite_sources`); None: no such pass was run.
  float16_nonfinite: Optional[bool] = None
  # Whether the Haiku state it writes was not finite after a float16
  # forward pass (`measurement.nonfinite_state_sources`); None: not run.
  float16_state_nonfinite: Optional[bool] = None


def lowest_scale_exponent(stats: np.ndarray, error: float) -> Optional[int]:
  """The smallest k such that at scale 2^k the values left below float16's
  smallest normal carry at most `error` of the tensor's norm (at most
  `error`^2 of its squared norm); None if all are zero."""
  if not numerics.histogram_of(stats).sum():
    return None
  normal = int(math.log2(numerics.FLOAT16.smallest_normal))
  return next(k for k in _EXPONENTS
              if numerics.norm_share_below(stats, normal - k) <= error**2)


def highest_scale_exponent(stats: np.ndarray, headroom: float
                           ) -> Optional[int]:
  """The largest k such that the largest magnitude times 2^k times
  `headroom` stays at most float16's largest value; None if all are zero."""
  amax = numerics.as_dict(stats)['amax']
  if not amax:
    return None
  return math.floor(math.log2(numerics.FLOAT16.max / (amax * headroom)))


def window(module: Module, thresholds: Thresholds
           ) -> tuple[Optional[int], Optional[int]]:
  """The module's own loss-scale window `(lo, hi)` as exponents of two
  (None: no gradient bounds that side). `lo` is set by the output gradient
  and by the params' gradients taken together: a small tensor of rounding
  noise, such as the gradient of attention's key bias (which the softmax
  cancels), does not set it alone. `hi` is set by any tensor, since one
  overflow skips the step. A `same_as` module's output gradient is the
  other module's: only its own params count."""
  params = list(module.param_gradients.values())
  pooled = params[0] if params else None
  for stats in params[1:]:
    pooled = numerics.merge(pooled, stats)
  own = [] if module.same_as else [module.gradient]
  los = [lowest_scale_exponent(s, thresholds.max_relative_error)
         for s in own + ([pooled] if params else [])]
  his = [highest_scale_exponent(s, thresholds.loss_scale_headroom)
         for s in own + params]
  los = [k for k in los if k is not None]
  his = [k for k in his if k is not None]
  return (max(los) if los else None), (min(his) if his else None)


def _pct(share: float) -> str:
  return f'{100 * share:.3g}%'


def _bf16_reason(module: Module, t: Thresholds) -> Optional[str]:
  for what, stats in (('output', module.output),
                      ('output gradient', module.gradient)):
    error = numerics.as_dict(stats)['bf16_relative_error']
    if error > t.max_relative_error:
      return (f'its {what} loses {_pct(error)} rounded to bfloat16 '
              f'(> {_pct(t.max_relative_error)})')
  return None


def _f16_output_reason(module: Module, t: Thresholds) -> Optional[str]:
  if module.float16_state_nonfinite:
    return ('the Haiku state it writes is not finite after a float16 step '
            '(an epsilon that underflows to 0 in an average, a division by '
            'it)')
  if module.float16_nonfinite:
    return ('a float16 forward pass makes inf or NaN inside it from finite '
            'inputs (a mask value or an exp beyond 65504)')
  out = numerics.as_dict(module.output)
  if out['f16_overflow'] and out['f16_overflow_share'] > t.max_overflow_share:
    return (f'its output overflows float16: {_pct(out["f16_overflow_share"])} '
            f'of it above 65504 (largest {out["amax"]:.3g})')
  if out['f16_relative_error'] > t.max_relative_error:
    return (f'its output loses {_pct(out["f16_relative_error"])} in float16 '
            f'({_pct(out["f16_flush_share"])} flushes to zero, '
            f'{_pct(out["f16_subnormal_share"])} subnormal)')
  return None


@dataclasses.dataclass
class Verdict:
  bfloat16: str
  float16: str
  window: tuple[Optional[int], Optional[int]]  # The module's own (lo, hi).
  reasons: dict[str, str]  # Format name -> why it keeps float32.


@dataclasses.dataclass
class Advice:
  """`judge`'s verdicts per module path and the float16 loss-scale window.

  Example:
    advice = advisor.judge(modules, limits)
    print(advice.verdicts['mlp/~/linear_0'].float16, advice.scale_window)
  """
  # By path: every module but a `same_as` one without params of its own.
  verdicts: dict[str, Verdict]
  # The model's float16 loss-scale window (exponents of two), or None.
  scale_window: tuple[Optional[int], Optional[int]]


def judge(modules: Sequence[Module], thresholds: Thresholds) -> Advice:
  """Every module's verdicts and the model's float16 loss-scale window.

  Example:
    modules = advisor.measure_model(loss_fn, params, batches, jax.random.key(0))
    advice = advisor.judge(modules, limits)
  """
  verdicts = {}
  for m in modules:
    # What a float16 pass saw a module do is its own, whoever's values its
    # outputs repeat.
    seen_in_float16 = bool(m.float16_nonfinite or m.float16_state_nonfinite)
    if m.same_as is not None and not m.param_gradients and not seen_in_float16:
      continue
    reasons = {}
    own = m.same_as is None  # Else its outputs are judged as the other's.
    bf16 = _bf16_reason(m, thresholds) if own else None
    if bf16:
      reasons['bfloat16'] = bf16
    lo, hi = window(m, thresholds)
    f16 = (_f16_output_reason(m, thresholds) if own or seen_in_float16
           else None)
    if f16 is None and lo is not None and hi is not None and lo > hi:
      f16 = (f'no loss scale keeps its gradients in float16: they need '
             f'>= 2^{lo} and overflow above 2^{hi}')
    if f16:
      reasons['float16'] = f16
    verdicts[m.path] = Verdict(KEEP if bf16 else BF16_OK,
                               KEEP if f16 else '', (lo, hi), reasons)
  scale_window = _close_window(verdicts)
  for v in verdicts.values():
    if v.float16 != KEEP:
      lo, hi = v.window
      at_one = (lo is None or lo <= 0) and (hi is None or hi >= 0)
      v.float16 = F16_OK if at_one else F16_SCALED
  return Advice(verdicts, scale_window)


def _bounds(verdicts, exclude=()):
  live = [v.window for p, v in verdicts.items()
          if v.float16 != KEEP and p not in exclude]
  los = [lo for lo, _ in live if lo is not None]
  his = [hi for _, hi in live if hi is not None]
  return (max(los) if los else None), (min(his) if his else None)


def _close_window(verdicts: dict[str, Verdict]):
  """The intersection of the windows of the modules not kept in float32;
  while it is empty, keeps the module that closes it most in float32."""
  while True:
    lo, hi = _bounds(verdicts)
    if lo is None or hi is None or lo <= hi:
      return lo, hi
    live = {p: v for p, v in verdicts.items() if v.float16 != KEEP}
    needs_most = max((p for p in live if live[p].window[0] is not None),
                     key=lambda p: live[p].window[0])
    allows_least = min((p for p in live if live[p].window[1] is not None),
                       key=lambda p: live[p].window[1])

    def width(path):
      new_lo, new_hi = _bounds(verdicts, exclude=(path,))
      if new_lo is None or new_hi is None:
        return math.inf
      return new_hi - new_lo

    path = max((needs_most, allows_least), key=width)
    v = verdicts[path]
    v.float16 = KEEP
    if path == needs_most:
      v.reasons['float16'] = (
          f'its gradients need a loss scale >= 2^{v.window[0]}, above the '
          f'2^{hi} at which the rest of the model overflows')
    else:
      v.reasons['float16'] = (
          f'its gradients overflow above a loss scale of 2^{v.window[1]}, '
          f'below the 2^{lo} the rest of the model needs')


def policy(main_policy: str, compute: str, output: str) -> str:
  """`main_policy`'s params with `compute` and `output` dtypes."""
  return policy_strings.with_dtypes(main_policy, '$main_policy',
                                    compute=compute, output=output)


def loss_scale(fmt: str, scale_window: tuple[Optional[int], Optional[int]]
               ) -> dict[str, Any]:
  """The `LossScaler` arguments for half format `fmt`: none for bfloat16; for
  float16 a dynamic scale that starts at the top of the window (2**hi) and
  never falls below its bottom (2**lo)."""
  if fmt != 'float16':
    return dict(kind='none')
  lo, hi = scale_window
  settings = dict(kind='dynamic')
  if hi is not None:
    settings['initial'] = 2.0**hi
  if lo is not None:
    settings['minimum'] = 2.0**lo
  return settings


def overrides(modules: Sequence[Module], advice: Advice, fmt: str,
              inherits: Optional[Mapping[str, bool]] = None, half: str = '',
              *, precision=None) -> str:
  """`make_precision`'s `overrides` that keep exactly the modules judged
  `keep-f32`
  under `fmt` in float32: a class name when every module of the class is
  kept, else their paths; a kept module's direct children that were fine in
  half precision and would inherit float32 from it (`inherits[path]`: no
  rule of their own) get `half` back. Given the `precision` the overrides
  are for (a `Precision` in `fmt`), `inherits` and `half` follow from it.

  Example:
    text = advisor.overrides(modules, advice, 'float16', precision=precision)
    precision = haiku_mp.make_precision(F16, text, model_class=hk.nets.MLP)
  """
  if precision is not None:
    if inherits is None:
      inherits = {m.path: precision.rule_for(m.class_name, m.path) is None
                  for m in modules}
    half = half or policy_strings.policy_str(precision.policy)
  inherits = inherits or {}
  kept = {p for p, v in advice.verdicts.items()
          if getattr(v, fmt) == KEEP}
  if not kept:
    return ''
  by_class: dict[str, list[str]] = {}
  for m in modules:
    if m.path in advice.verdicts:
      by_class.setdefault(m.class_name, []).append(m.path)
  targets = []
  for class_name, paths in by_class.items():
    chosen = [p for p in paths if p in kept]
    if len(chosen) == len(paths) and len(paths) > 1:
      targets.append((class_name, F32_POLICY))
    else:
      targets.extend((p, F32_POLICY) for p in chosen)
  for m in modules:
    parent = m.path.rpartition('/')[0]
    if (m.path in advice.verdicts and parent in kept and m.path not in kept
        and inherits.get(m.path, False)):
      targets.append((m.path, half))
  return ';'.join(f'{target}:{policy}' for target, policy in targets)
