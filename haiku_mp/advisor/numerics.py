"""How a float format would hold a float32 tensor: rounding, range and, for
float16 and bfloat16, one vector of statistics per tensor, computed on the
device. One `Format` and one `round_to` serve every format the advisor
judges: float16 and bfloat16 here, E4M3 and E5M2 in `fp8_numerics`.

16-bit formats are simulated with `jax.lax.reduce_precision`, not `astype`
round trips, which XLA may fold away under jit (it allows excess precision).
XLA's reduce-precision has no subnormals, though: on XLA:CPU (jaxlib 0.10.2)
every value in [2^-25, 2^-14) became 0 where IEEE float16 keeps it on a grid
of 2^-24, so `round_to` rounds that range on the grid itself and matches a
real float16 cast bit for bit (numerics_test). bfloat16's subnormals lie in
float32's own subnormal range, which XLA:CPU flushes anyway. fp8 formats
are rounded by the saturating cast the fp8 matmuls make (`fp8_scales.quantize`),
which `reduce_precision` cannot express (it knows neither subnormals nor
E4M3's top binade, and overflows to inf where the cast saturates).

`tensor_stats` packs what the precision advisor reads into one float32
vector, so a tensor's statistics can travel as the cotangent of a probe
(`probes.py`) and add up over batches on the host: counts (exact up to 2^24
per batch and field), the largest magnitude, sums of squares, and a histogram
of log2 magnitudes whose bins are powers of two, so the share of a tensor
below or above any power of two is read from it exactly.
"""

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.model import fp8_scales


@dataclasses.dataclass(frozen=True)
class Format:
  """A floating-point format the advisor rounds to: its name and dtype;
  `saturates` when the matmuls clip to its largest finite value (fp8)
  instead of overflowing to inf."""
  name: str
  dtype: object
  saturates: bool = False

  @property
  def max(self) -> float:
    return float(jnp.finfo(self.dtype).max)

  @property
  def smallest_normal(self) -> float:
    return float(jnp.finfo(self.dtype).smallest_normal)

  @property
  def smallest_subnormal(self) -> float:
    return float(jnp.finfo(self.dtype).smallest_subnormal)


FLOAT16 = Format('float16', jnp.float16)
BFLOAT16 = Format('bfloat16', jnp.bfloat16)
E4M3 = Format('e4m3', fp8_scales.E4M3, saturates=True)
E5M2 = Format('e5m2', fp8_scales.E5M2, saturates=True)
FORMATS = {f.name: f for f in (FLOAT16, BFLOAT16, E4M3, E5M2)}


def round_to(x: jax.Array, fmt: Format) -> jax.Array:
  """float32 `x` rounded to `fmt` as a cast would (nearest even; overflow to
  inf, or saturated for fp8; float16 subnormals kept), returned in
  float32."""
  x = x.astype(jnp.float32)
  if fmt.saturates:
    return fp8_scales.quantize(x, fmt.dtype, 1.0).astype(jnp.float32)
  finfo = jnp.finfo(fmt.dtype)
  rounded = jax.lax.reduce_precision(x, finfo.nexp, finfo.nmant)
  if fmt is not FLOAT16:
    return rounded
  # float16's subnormal range, on its fixed grid: both scalings are exact.
  grid = fmt.smallest_subnormal
  subnormal = jnp.round(x / grid) * grid
  return jnp.where(jnp.abs(x) < fmt.smallest_normal, subnormal, rounded)


# Histogram bin e counts magnitudes in [2^(e-1), 2^e) (`jnp.frexp`'s
# exponent); the first bin takes every smaller non-zero magnitude, the last
# every larger finite one.
LOWEST_EXPONENT = -64
HIGHEST_EXPONENT = 24
EXPONENTS = np.arange(LOWEST_EXPONENT, HIGHEST_EXPONENT + 1)

FIELDS = (
    'count',  # elements
    'zeros',  # exact zeros
    'nonfinite',  # inf or NaN already in float32
    'amax',  # largest finite magnitude
    'sum_squares',  # of the finite values
    # At the given scale, as float16 would hold the scaled value:
    'f16_flush',  # non-zero, rounds to 0
    'f16_subnormal',  # rounds to a non-zero subnormal
    'f16_overflow',  # finite, rounds to inf
    'f16_error_squares',  # sum of squared rounding errors (unscaled), finite
    'bf16_error_squares',  # the same for bfloat16
)
SIZE = len(FIELDS) + len(EXPONENTS)


# float16's fate of each element, counted per histogram bin in one scatter.
_ZERO, _FLUSH, _SUBNORMAL, _OVERFLOW, _NORMAL = range(5)
_CLASSES = 5
_FLOAT32_EXPONENT_BIAS = 126  # frexp's exponent of a normal float32.


def tensor_stats(x: jax.Array, scale=1.0) -> jax.Array:
  """`x`'s statistics (`FIELDS`, then the histogram) as one float32 vector;
  float16 and bfloat16 as they would hold `x * scale` (a loss-scaled
  gradient).

  Written for XLA:CPU's memory traffic (half the time of one reduction per
  field): every count comes from one scatter of a code per element (its
  histogram bin and what float16 makes of it), the three sums of squares
  from one reduction, and the exponent from the float32 bits.
  """
  x = x.astype(jnp.float32).ravel()
  scale = jnp.asarray(scale, jnp.float32)
  finite = jnp.isfinite(x)
  x = jnp.where(finite, x, 0.0)
  scaled = x * scale
  f16 = round_to(scaled, FLOAT16)
  overflow = jnp.isinf(f16)
  fate = jnp.where(
      x == 0, _ZERO, jnp.where(
          overflow, _OVERFLOW, jnp.where(
              f16 == 0, _FLUSH, jnp.where(
                  jnp.abs(f16) < FLOAT16.smallest_normal, _SUBNORMAL,
                  _NORMAL))))
  biased = (jax.lax.bitcast_convert_type(x, jnp.int32) >> 23) & 0xff
  bins = jnp.clip(biased - _FLOAT32_EXPONENT_BIAS, LOWEST_EXPONENT,
                  HIGHEST_EXPONENT) - LOWEST_EXPONENT
  nonfinite_code = len(EXPONENTS) * _CLASSES
  code = jnp.where(finite, bins * _CLASSES + fate, nonfinite_code)
  table = jnp.zeros(nonfinite_code + 1, jnp.float32).at[code].add(1.0)
  by_fate = table[:-1].reshape(len(EXPONENTS), _CLASSES)
  f16_error = jnp.where(overflow, 0.0, f16 / scale - x)
  bf16_error = round_to(scaled, BFLOAT16) / scale - x
  squares = jnp.sum(jnp.stack([x * x, f16_error * f16_error,
                               bf16_error * bf16_error]), axis=1)
  per_fate = by_fate.sum(axis=0)
  fields = jnp.stack([
      jnp.float32(x.size),
      per_fate[_ZERO],
      table[-1],
      jnp.max(jnp.abs(x), initial=0.0),
      squares[0],
      per_fate[_FLUSH],
      per_fate[_SUBNORMAL],
      per_fate[_OVERFLOW],
      squares[1],
      squares[2],
  ])
  return jnp.concatenate([fields, by_fate[:, _FLUSH:].sum(axis=1)])


AMAX = FIELDS.index('amax')


def merge(a: np.ndarray, b: np.ndarray,
          max_at: Sequence[int] = (AMAX,)) -> np.ndarray:
  """Two tensors' (or batches') statistics as one: sums, but the larger value
  at `max_at` (a largest magnitude); by default this file's vectors."""
  merged = np.asarray(a, np.float64) + np.asarray(b, np.float64)
  for i in max_at:
    merged[i] = max(a[i], b[i])
  return merged


def as_dict(stats: np.ndarray) -> dict:
  """A statistics vector as named numbers, with the shares and relative
  errors people read: `f16_*_share` of the non-zero values, rounding errors
  relative to the tensor's norm."""
  stats = np.asarray(stats, np.float64)
  named = {f: float(v) for f, v in zip(FIELDS, stats)}
  nonzero = named['count'] - named['zeros'] - named['nonfinite']
  share = lambda n: n / nonzero if nonzero else 0.0
  norm = math.sqrt(named['sum_squares'])
  relative = lambda e: math.sqrt(e) / norm if norm else 0.0
  named.update(
      nonzero=nonzero,
      f16_flush_share=share(named['f16_flush']),
      f16_subnormal_share=share(named['f16_subnormal']),
      f16_overflow_share=share(named['f16_overflow']),
      f16_relative_error=relative(named['f16_error_squares']),
      bf16_relative_error=relative(named['bf16_error_squares']),
      histogram=[int(c) for c in stats[len(FIELDS):]])
  return named


def histogram_of(stats: np.ndarray) -> np.ndarray:
  return np.asarray(stats, np.float64)[len(FIELDS):]


def norm_share_below(stats: np.ndarray, exponent: int) -> float:
  """An upper bound on the share of the tensor's squared norm carried by
  values of magnitude below 2^`exponent`: each value of bin e counts as
  4^e, the most it can be."""
  stats = np.asarray(stats, np.float64)
  total = stats[FIELDS.index('sum_squares')]
  if not total:
    return 0.0
  end = max(0, min(len(EXPONENTS), exponent - LOWEST_EXPONENT + 1))
  bound = np.sum(histogram_of(stats)[:end] * 4.0**EXPONENTS[:end])
  return float(min(1.0, bound / total))
