"""fp8's entry in the advisor's matmul pipeline (`matmul_formats`): how E4M3
and E5M2 would hold a Linear's operands under each fp8 scaling, one vector
of statistics per tensor, computed on the device, and the limits a Linear
must keep to run fp8 at a scaling.

Values are rounded by `numerics.round_to`, the saturating cast
`fp8_scales.quantize` makes (E4M3 here is `float8_e4m3fn`: no inf, largest 448).

Per tensor and scaling (`fp8.SCALINGS`), at the scale that scaling would use:
the non-zero values that underflow to zero, those that saturate, and the
squared rounding error (unscaled), beside the tensor's amax, non-zero count
and squared norm. `current` scales by the tensor's own amax, `delayed` by
the amax history's maximum passed in (the pass's own earlier batches), `mx`
per block of `fp8_scales.MX_BLOCK` along the given axis.
"""

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.advisor import matmul_formats
from haiku_mp.advisor import numerics
from haiku_mp.model import fp8
from haiku_mp.model import fp8_scales

TENSOR_FIELDS = ('amax', 'nonzero', 'sum_squares')
SCALING_FIELDS = ('underflow', 'saturate', 'error_squares')
FIELDS = TENSOR_FIELDS + tuple(f'{s}_{f}' for s in fp8.SCALINGS
                               for f in SCALING_FIELDS)
SIZE = len(FIELDS)
# Each operand's format in the train step's matmuls.
OPERAND_FORMATS = {'input': numerics.E4M3, 'gradient': numerics.E5M2,
                   'weight': numerics.E4M3}


def _scaled_stats(x: jax.Array, scale: jax.Array, fmt: numerics.Format
                  ) -> list[jax.Array]:
  """[underflow, saturate, error_squares] of `x` held as `fmt` at `scale`
  (a scalar, or one per element)."""
  v = x / scale
  held = numerics.round_to(v, fmt)
  nonzero = x != 0
  underflow = jnp.sum(nonzero & (held == 0))
  saturate = jnp.sum(jnp.abs(v) > fmt.max)
  error = held * scale - x
  return [underflow.astype(jnp.float32), saturate.astype(jnp.float32),
          jnp.sum(error * error)]


def tensor_stats(x: jax.Array, fmt: numerics.Format, delayed_amax: jax.Array,
                 block_axis: int = -1, margin: float = 0.0) -> jax.Array:
  """`x`'s statistics (`FIELDS`) as one float32 vector. `delayed_amax`: the
  history's maximum delayed scaling would scale by; 0 or less (no history
  yet), this tensor's own amax."""
  x = x.astype(jnp.float32)
  x = jnp.where(jnp.isfinite(x), x, 0.0)
  amax = jnp.max(jnp.abs(x), initial=0.0)
  delayed_amax = jnp.where(delayed_amax > 0, delayed_amax, amax)
  current = fp8_scales.scale_from_amax(amax, fmt.dtype, margin)
  delayed = fp8_scales.scale_from_amax(delayed_amax, fmt.dtype, margin)
  blocks = fp8_scales.mx_element_scales(x, fmt.dtype, block_axis % x.ndim)
  fields = [amax, jnp.sum(x != 0).astype(jnp.float32), jnp.sum(x * x)]
  for scale in (current, delayed, blocks):
    fields += _scaled_stats(x, scale, fmt)
  return jnp.stack(fields)


_AMAX = FIELDS.index('amax')


def as_dict(stats: np.ndarray) -> dict:
  """Per scaling, the shares of the non-zero values that underflow and
  saturate, and the rounding error relative to the tensor's norm."""
  stats = np.asarray(stats, np.float64)
  named = dict(zip(FIELDS, stats))
  nonzero, norm = named['nonzero'], math.sqrt(named['sum_squares'])
  result = dict(amax=float(named['amax']), nonzero=int(nonzero))
  for scaling in fp8.SCALINGS:
    result[scaling] = dict(
        underflow_share=(named[f'{scaling}_underflow'] / nonzero
                         if nonzero else 0.0),
        saturate_share=(named[f'{scaling}_saturate'] / nonzero
                        if nonzero else 0.0),
        relative_error=(math.sqrt(named[f'{scaling}_error_squares']) / norm
                        if norm else 0.0))
  return result


@dataclasses.dataclass(frozen=True)
class Fp8Thresholds:
  """How much of an operand E4M3 / E5M2 may lose (the fp8
  limits): at most `max_relative_error` of its norm to rounding, at most
  `max_underflow_share` of its non-zero values flushed to zero (a tensor
  whose values span more binades than the format: its norm may survive
  while most of its values do not) and at most `max_saturate_share` clipped
  at the largest finite value (a delayed scale behind a growing tensor).

  Example:
    limits = advisor.Fp8Thresholds(max_relative_error=0.1,
                                   max_underflow_share=0.01, max_saturate_share=0.0)
  """
  max_relative_error: float
  max_underflow_share: float
  max_saturate_share: float


@dataclasses.dataclass(frozen=True)
class Fp8Matmuls(matmul_formats.MatmulFormat):
  """fp8 in the advisor's matmul pipeline: the input and weight in E4M3,
  the output gradient in E5M2, at the scales each scaling (`fp8.SCALINGS`)
  uses. Delayed scaling's history is the measurement's own: the amaxes of
  the batches before, up to `history_length`; scales leave
  amax * 2**`margin` in range. Inputs and gradients are blocked for MX
  along their last axis (the forward's and the input gradient's contracting
  dimension), weights along their first.

  Example:
    totals = advisor.measure_matmuls(loss_fn, params, batches, paths,
                                     advisor.Fp8Matmuls())
  """
  history_length: int = 16
  margin: float = 0.0

  name = 'fp8'
  title = 'fp8'
  choices = fp8.SCALINGS
  part_sizes = (SIZE, SIZE, SIZE)
  max_at = (_AMAX,)
  columns = ('input E4M3 error / underflow', 'weight E4M3 error / underflow',
             'gradient E5M2 error / underflow / saturate')

  def extra(self, path: str, history: Sequence[Sequence[np.ndarray]]
            ) -> np.ndarray:
    """The delayed amaxes of x and g: the largest of the last
    `history_length` batches' (0: none yet, each tensor its own)."""
    del path
    amaxes = [[parts[0][_AMAX], parts[1][_AMAX]]
              for parts in history[-self.history_length:]]
    return np.max(amaxes, axis=0) if amaxes else np.zeros(2)

  def activations(self, x: jax.Array, g: jax.Array, extra: jax.Array
                  ) -> jax.Array:
    return jnp.concatenate([
        tensor_stats(x, OPERAND_FORMATS['input'], extra[0],
                     margin=self.margin),
        tensor_stats(g, OPERAND_FORMATS['gradient'], extra[1],
                     margin=self.margin)])

  def weight(self, w: jax.Array, extra: jax.Array) -> jax.Array:
    del extra
    return tensor_stats(w, OPERAND_FORMATS['weight'], jnp.float32(0.0),
                        block_axis=0, margin=self.margin)

  def describe(self, stats: np.ndarray, operand: str) -> dict[str, Any]:
    del operand
    return as_dict(stats)

  def check(self, operands: Mapping[str, dict], choice: str,
            limits: Fp8Thresholds) -> list[str]:
    reasons = []
    for name, fmt in OPERAND_FORMATS.items():
      s, fmt = operands[name][choice], fmt.name.upper()
      if s['relative_error'] > limits.max_relative_error:
        reasons.append(f'{name} in {fmt} errs by {s["relative_error"]:.3g} '
                       f'of its norm (> {limits.max_relative_error:g})')
      if s['underflow_share'] > limits.max_underflow_share:
        reasons.append(f'{100 * s["underflow_share"]:.3g}% of the {name}\'s '
                       f'values underflow to 0 in {fmt} (> '
                       f'{100 * limits.max_underflow_share:g}%)')
      if s['saturate_share'] > limits.max_saturate_share:
        reasons.append(f'{100 * s["saturate_share"]:.3g}% of the {name}\'s '
                       f'values saturate in {fmt} (> '
                       f'{100 * limits.max_saturate_share:g}%)')
    return reasons

  def cells(self, row: Mapping[str, Any], choice: str) -> list[str]:
    cell = lambda name: (f'{row[name][choice]["relative_error"]:.3g} / '
                         f'{row[name][choice]["underflow_share"]:.2g}')
    saturate = row['gradient'][choice]['saturate_share']
    return [cell('input'), cell('weight'),
            f'{cell("gradient")} / {saturate:.2g}']
