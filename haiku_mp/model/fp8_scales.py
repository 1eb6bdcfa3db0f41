"""How a tensor is scaled and cast into fp8: the formats, power-of-two scales
from an amax (one per tensor) or per block of `MX_BLOCK` values (MX's E8M0
scales), the saturating cast, and the amax histories of delayed scaling.
The fp8 matmuls (`fp8`) and the advisor's statistics (`advisor.fp8_numerics`)
both quantize with these.

Every scale is a power of two (`scale_from_amax`, `mx_block_exponents`), as
MX's are by definition: then `t / s` is exact, so `quantize` rounds `t / s`
once, ties to even, also where XLA rewrites the division as a product with
`1 / s` (exact too); and a matmul's output scaling is exact. A product of
scales is applied as one factor where it is a normal float32 number and split
in two where it is not (`times_exp2`): XLA:CPU flushes a subnormal factor to
zero.
"""

import math
from typing import Optional

import jax
import jax.numpy as jnp

from haiku_mp.model import blocks as blocks_lib

E4M3 = jnp.float8_e4m3fn  # Weights and activations: more precision.
E5M2 = jnp.float8_e5m2  # Output gradients: more range.
MX_BLOCK = 32  # Values per MX scale (the OCP MX spec's block size).
# The exponent range of scales, as powers of two. Current and delayed: float32's
# normal numbers whose reciprocal is one too (a subnormal scale, or its
# reciprocal, XLA:CPU flushes to zero). MX: E8M0's, 2**-127 to 2**127.
_F32 = jnp.finfo(jnp.float32)
_MIN_EXPONENT, _MAX_EXPONENT = int(_F32.minexp), -int(_F32.minexp)
MX_MIN_EXPONENT, MX_MAX_EXPONENT = -127, 127
_TINY = float(_F32.tiny)  # A subnormal amax counts as this.


def max_finite(dtype) -> float:
  return float(jnp.finfo(dtype).max)


def _exp2(exponent: jax.Array) -> jax.Array:
  """2**exponent (int32, a normal float32's exponent) from its bits: exact,
  where XLA's exp2 (and `jnp.ldexp`, which uses it) may not be."""
  return jax.lax.bitcast_convert_type(
      (exponent.astype(jnp.int32) + 127) << 23, jnp.float32)


def exponent_of(scale: jax.Array) -> jax.Array:
  """e of a power-of-two float32 `scale` = 2**e (a normal number)."""
  bits = jax.lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32)
  return ((bits >> 23) & 0xff) - 127


def times_exp2(x: jax.Array, exponent: jax.Array) -> jax.Array:
  """x * 2**exponent (|exponent| <= 252), exact wherever the result is a
  normal float32: as x * 2**e1 * 2**e2 with e1 the exponent clipped to
  float32's normal range, so that each factor and the product in between
  stay normal (XLA:CPU flushes subnormals to zero). In range, as for any
  amaxes not near float32's bottom, e2 = 0: the whole scale is the first
  factor. (XLA folds two compile-time constant factors into one; scales
  computed from the data are not.)"""
  first = jnp.clip(exponent, _MIN_EXPONENT, _MAX_EXPONENT)
  second = jnp.clip(exponent - first, _MIN_EXPONENT, _MAX_EXPONENT)
  return x * _exp2(first) * _exp2(second)


def _ceil_log2_ratio(amax: jax.Array, dtype, margin: float) -> jax.Array:
  """ceil(log2(amax * 2**margin / max_finite(dtype))) (int32), exact for a
  positive finite amax and an integer margin, from the amax's own mantissa
  and exponent: no division, which would flush to zero below
  max_finite * 2**-126, and no log2 (XLA's is an approximation). A subnormal
  amax counts as float32's smallest normal number."""
  whole = math.floor(margin)
  # amax * 2**margin / max = (m / c) * 2**(e + whole - max_exponent), where
  # m in [0.5, 1) is amax's mantissa and c = max's mantissa / 2**(margin's
  # fraction), in (0.25, 1): m / c lies in (0.5, 4), and its ceil(log2) is
  # 0, 1 or 2.
  max_mantissa, max_exponent = math.frexp(max_finite(dtype))
  c = max_mantissa / 2.0 ** (margin - whole)
  mantissa, exponent = jnp.frexp(jnp.maximum(amax.astype(jnp.float32), _TINY))
  up = (mantissa > c).astype(jnp.int32) + (mantissa > 2 * c).astype(jnp.int32)
  return exponent + (whole - max_exponent) + up


def _exponent_from_amax(amax: jax.Array, dtype, margin: float, low: int,
                        high: int) -> jax.Array:
  """The scale's exponent: `_ceil_log2_ratio` clipped to [low, high]; 0
  (a scale of 1) for a zero or non-finite amax."""
  amax = jnp.asarray(amax, jnp.float32)
  exponent = jnp.clip(_ceil_log2_ratio(amax, dtype, margin), low, high)
  # Non-zero from the bits: XLA:CPU reads a subnormal as zero in `amax > 0`.
  bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
  usable = jnp.isfinite(amax) & ((bits & 0x7fffffff) != 0)
  return jnp.where(usable, exponent, 0)


def scale_from_amax(amax: jax.Array, dtype, margin: float = 0.0) -> jax.Array:
  """The float32 divisor of a tensor with this amax: the smallest power of
  two that leaves `amax * 2**margin` within the largest finite value of
  `dtype`, 2**ceil(log2(amax * 2**margin / max)), so that quantizing
  divides exactly. 1 for a zero or non-finite amax; never below float32's
  smallest normal number (a tiny or subnormal amax gives a finite scale)."""
  return _exp2(_exponent_from_amax(amax, dtype, margin, _MIN_EXPONENT,
                                   _MAX_EXPONENT))


def quantize(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
  """`x / scale` in `dtype`: saturated at its largest finite value (never inf
  or NaN from a finite x), rounded to nearest even by the cast. Exact before
  the cast for a power-of-two scale (`scale_from_amax`), so ties round to
  even; with another scale, XLA may compute `x * (1 / scale)` instead and
  round a tie either way."""
  limit = max_finite(dtype)
  return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(dtype)


def amax(x: jax.Array, axis_name: Optional[str] = None) -> jax.Array:
  """max |x| in float32; with `axis_name` (pmap), over every replica's `x`,
  so that replicas quantize with the scales one device would use."""
  result = jnp.max(jnp.abs(x)).astype(jnp.float32)
  return result if axis_name is None else jax.lax.pmax(result, axis_name)


def roll_history(history: jax.Array, new_amax: jax.Array) -> jax.Array:
  """`history` with `new_amax` first and its oldest entry dropped. A
  non-finite amax (a step that overflowed) is recorded as the history's
  maximum, so that it never poisons a scale."""
  new_amax = jnp.where(jnp.isfinite(new_amax), new_amax, jnp.max(history))
  return jnp.concatenate([new_amax[None], history[:-1]]).astype(jnp.float32)


# ---- MX: one power-of-two scale per block of 32 -----------------------------


def mx_block_exponents(x: jax.Array, dtype, axis: int,
                       block: int = MX_BLOCK) -> jax.Array:
  """E8M0 exponents (int32) of `x`'s blocks of `block` values along `axis`
  (zero-padded to a multiple of `block`): ceil(log2(amax / max_finite)), so
  no block saturates, from -127 to 127 (E8M0's range); 0 for a zero block.
  Shape: `x`'s with `axis` holding one per block."""
  axis = axis % x.ndim
  block_amax = jnp.max(jnp.abs(blocks_lib.split(x, axis, block)),
                       axis=axis + 1)
  return _exponent_from_amax(block_amax, dtype, 0.0, MX_MIN_EXPONENT,
                             MX_MAX_EXPONENT)


def mx_block_scales(x: jax.Array, dtype, axis: int,
                    block: int = MX_BLOCK) -> jax.Array:
  """2**`mx_block_exponents` as normal float32 numbers, for arithmetic on a
  backend that flushes subnormals (XLA:CPU): E8M0's 2**-127, a float32
  subnormal, is given as 2**-126. The quantization here scales with the
  exponents themselves."""
  return _exp2(jnp.maximum(mx_block_exponents(x, dtype, axis, block),
                           _MIN_EXPONENT))


def mx_element_exponents(x: jax.Array, dtype, axis: int,
                         block: int = MX_BLOCK) -> jax.Array:
  """Per element of `x`, its MX block's exponent (`mx_block_exponents`)."""
  size = x.shape[axis]
  exponents = jnp.repeat(mx_block_exponents(x, dtype, axis, block), block,
                         axis=axis)
  return jax.lax.slice_in_dim(exponents, 0, size, axis=axis)


def mx_element_scales(x: jax.Array, dtype, axis: int,
                      block: int = MX_BLOCK) -> jax.Array:
  """Per element of `x`, its MX block's scale as `mx_block_scales` gives it
  (a normal float32)."""
  return _exp2(jnp.maximum(mx_element_exponents(x, dtype, axis, block),
                           _MIN_EXPONENT))


def mx_quantize(x: jax.Array, dtype, axis: int,
                 block: int) -> tuple[jax.Array, jax.Array]:
  """(q, e): `x`'s MX blocks of `dtype` along `axis`, each value as the
  format holds it (in float32) and its block's exponent. Times 2**-e
  (2**120 at most for a finite amax: exact), then cast."""
  exponents = mx_element_exponents(x, dtype, axis, block)
  limit = max_finite(dtype)
  q = jnp.clip(x.astype(jnp.float32) * _exp2(-exponents), -limit,
               limit).astype(dtype).astype(jnp.float32)
  return q, exponents


def mx_quantize_dequantize(x: jax.Array, dtype, axis: int,
                           block: int = MX_BLOCK) -> jax.Array:
  """`x` (float32) as MX blocks of `dtype` along `axis` hold it: quantized
  (`mx_quantize`) and times 2**e as `times_exp2` multiplies (2**-127 is
  no normal float32). A value that rounds up to 2**128 (E4M3's 256 under
  2**120, E5M2's 32768 under 2**113: from 3.30e38 and 3.19e38) is no
  float32 either: it saturates at float32's largest, the float32 nearest
  it, as `quantize` saturates (never inf from a finite x)."""
  return jnp.clip(times_exp2(*mx_quantize(x, dtype, axis, block)),
                  -_F32.max, _F32.max)
