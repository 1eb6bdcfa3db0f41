"""How E4M3 and E5M2 would hold a float32 tensor under each fp8 scaling: one
vector of statistics per tensor, computed on the device, as `numerics` does
for float16 and bfloat16.

Values are rounded on the format's own grid (`round_to_fp8`): a power-of-two
spacing per binade, fixed below the smallest normal number, round half to
even, saturated at the largest finite value. That is the cast
`fp8.quantize` makes, bit for bit (fp8_numerics_test), written as arithmetic
XLA cannot fold away under jit (an f32 -> f8 -> f32 round trip it may), and
without `reduce_precision`, which knows neither subnormals nor E4M3's top
binade (E4M3 here is `float8_e4m3fn`: no inf, largest 448).

Per tensor and scaling (`fp8.SCALINGS`), at the scale that scaling would use:
the non-zero values that underflow to zero, those that saturate, and the
squared rounding error (unscaled), beside the tensor's amax, non-zero count
and squared norm. `current` scales by the tensor's own amax, `delayed` by
the amax history's maximum passed in (the pass's own earlier batches), `mx`
per block of `fp8.MX_BLOCK` along the given axis.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.model import fp8


@dataclasses.dataclass(frozen=True)
class Fp8Format:
  """An fp8 format: its name and dtype."""
  name: str
  dtype: object

  @property
  def max(self) -> float:
    return fp8.max_finite(self.dtype)


E4M3 = Fp8Format('e4m3', fp8.E4M3)
E5M2 = Fp8Format('e5m2', fp8.E5M2)

TENSOR_FIELDS = ('amax', 'nonzero', 'sum_squares')
SCALING_FIELDS = ('underflow', 'saturate', 'error_squares')
FIELDS = TENSOR_FIELDS + tuple(f'{s}_{f}' for s in fp8.SCALINGS
                               for f in SCALING_FIELDS)
SIZE = len(FIELDS)


def round_to_fp8(v: jax.Array, fmt: Fp8Format) -> jax.Array:
  """float32 `v` (already divided by its scale) as `fmt` holds it, in
  float32: `fp8.quantize`'s saturating cast itself."""
  return fp8.quantize(v, fmt.dtype, 1.0).astype(jnp.float32)


def _scaled_stats(x: jax.Array, scale: jax.Array, fmt: Fp8Format
                  ) -> list[jax.Array]:
  """[underflow, saturate, error_squares] of `x` held as `fmt` at `scale`
  (a scalar, or one per element)."""
  v = x / scale
  held = round_to_fp8(v, fmt)
  nonzero = x != 0
  underflow = jnp.sum(nonzero & (held == 0))
  saturate = jnp.sum(jnp.abs(v) > fmt.max)
  error = held * scale - x
  return [underflow.astype(jnp.float32), saturate.astype(jnp.float32),
          jnp.sum(error * error)]


def _block_scales(x: jax.Array, fmt: Fp8Format, axis: int) -> jax.Array:
  """Per element, the MX scale of its block along `axis`, as
  `fp8.mx_quantize_dequantize` blocks it."""
  return fp8.mx_element_scales(x, fmt.dtype, axis)


def tensor_stats(x: jax.Array, fmt: Fp8Format, delayed_amax: jax.Array,
                 block_axis: int = -1, margin: float = 0.0) -> jax.Array:
  """`x`'s statistics (`FIELDS`) as one float32 vector. `delayed_amax`: the
  history's maximum delayed scaling would scale by; 0 or less (no history
  yet), this tensor's own amax."""
  x = x.astype(jnp.float32)
  x = jnp.where(jnp.isfinite(x), x, 0.0)
  amax = jnp.max(jnp.abs(x), initial=0.0)
  delayed_amax = jnp.where(delayed_amax > 0, delayed_amax, amax)
  current = fp8.scale_from_amax(amax, fmt.dtype, margin)
  delayed = fp8.scale_from_amax(delayed_amax, fmt.dtype, margin)
  blocks = _block_scales(x, fmt, block_axis % x.ndim)
  fields = [amax, jnp.sum(x != 0).astype(jnp.float32), jnp.sum(x * x)]
  for scale in (current, delayed, blocks):
    fields += _scaled_stats(x, scale, fmt)
  return jnp.stack(fields)


_AMAX = FIELDS.index('amax')


def amax_of(stats: np.ndarray) -> float:
  return float(stats[_AMAX])


def merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Two batches' statistics of a tensor as one: sums, the larger amax."""
  merged = np.asarray(a, np.float64) + np.asarray(b, np.float64)
  merged[_AMAX] = max(a[_AMAX], b[_AMAX])
  return merged


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
