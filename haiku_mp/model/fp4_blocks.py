"""4-bit floats, emulated: NVFP4 and MXFP4 blocks quantized and dequantized.

Both formats hold E2M1 values (sign, 2 exponent bits, 1 mantissa bit: 0,
0.5, 1, 1.5, 2, 3, 4, 6; no inf or NaN) in blocks that share a scale:

- ``nvfp4`` (NVIDIA, "Pretraining LLMs with NVFP4", arXiv 2509.25149): blocks
  of 16 values with an E4M3 scale, under a float32 scale per tensor that
  maps the tensor's amax to E4M3's largest scale times E2M1's largest value
  (6 x 448), as Transformer Engine computes it. A block's E4M3 scale is its
  amax / 6 in those units, rounded to nearest, so the block's largest value
  may exceed 6 after it and saturate. A tensor whose amax is below 1 is
  quantized as its copy scaled up by a power of two (`nvfp4_tensor_scale`),
  which is exact and keeps every scale a normal float32 however tiny the
  tensor.
- ``mxfp4`` (OCP MX v1.0): blocks of 32 values with an E8M0 (power-of-two)
  scale. The spec's scale, 2**(floor(log2(amax)) - 2), lets a block's
  largest values reach 8 and saturate at 6; here, as for MXFP8
  (`fp8_scales.mx_block_exponents`) and in Transformer Engine's MX recipes, the
  exponent is rounded up so that no value of a block saturates. A finite
  value that rounds up to 2**128 (4 under E8M0's 2**126), past float32's
  largest, saturates there.

Rounding to E2M1 is the cast to `float4_e2m1fn` (ml_dtypes' dtype): XLA:CPU
(jaxlib 0.10.2) converts float32 to it round-to-nearest-even and saturating
at 6, the same bit for bit as ml_dtypes (tests/library/fp4_test.py checks it on this
machine), but it turns NaN into -0; `round_e2m1` keeps non-finite values
as they are, so that a step's finite check still sees them. Stochastic
rounding (`stochastic_round_e2m1`) picks one of the two grid points around a
value with the probability that makes it unbiased, for values within +-6:
those an NVFP4 block holds above 6 (its E4M3 scale rounded down) saturate.

The 4-bit matmul of a Linear (`fp4`) quantizes with these; so does the
advisor (`advisor.fp4_numerics`).
"""

import math
from typing import Optional

import jax
import jax.numpy as jnp

from haiku_mp.model import blocks as blocks_lib
from haiku_mp.model import random_bits
from haiku_mp.model.fp8_scales import exponent_of
from haiku_mp.model.fp8_scales import MX_MAX_EXPONENT  # E8M0's, as MXFP8's.
from haiku_mp.model.fp8_scales import MX_MIN_EXPONENT
from haiku_mp.model.fp8_scales import times_exp2

E2M1 = jnp.float4_e2m1fn
E2M1_MAX = 6.0  # The largest E2M1 value.
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448: NVFP4's block scales.
NVFP4_BLOCK = 16  # Values per E4M3 scale (NVIDIA's NVFP4).
MXFP4_BLOCK = 32  # Values per E8M0 scale (the OCP MX spec's).
# E2M1's largest exponent: 6 = 1.5 * 2**2.
_E2M1_EMAX = 2
_TINY = float(jnp.finfo(jnp.float32).tiny)
_F32_MAX = float(jnp.finfo(jnp.float32).max)
# The largest power of two that scales an NVFP4 tensor up (as an exponent):
# float32's largest whose reciprocal is normal too.
_MAX_SHIFT = 126


def round_e2m1(x: jax.Array) -> jax.Array:
  """`x` (float32) rounded to the nearest E2M1 value, ties to even,
  saturated at +-6; NaN and inf stay as they are (the cast alone makes NaN
  -0 and inf 6)."""
  x = x.astype(jnp.float32)
  rounded = x.astype(E2M1).astype(jnp.float32)
  return jnp.where(jnp.isfinite(x), rounded, x)


# The E2M1 grid's non-negative values, ascending.
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _grid_below(magnitude: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(the largest grid value <= magnitude, the next one up), for magnitudes
  in [0, 6]; at 6 both are 6. From the grid's spacing (0.5 below 2, 1 up to
  4, 2 above), elementwise and exact in float32: a search over the grid
  (`jnp.searchsorted`) made the backward's stochastic rounding ten times
  the cost of the rest of a 4-bit matmul on XLA:CPU."""
  step = jnp.where(magnitude < 2.0, 0.5, jnp.where(magnitude < 4.0, 1.0, 2.0))
  low = jnp.floor(magnitude / step) * step
  return low, jnp.minimum(low + step, E2M1_MAX)


def stochastic_round_e2m1(x: jax.Array, key: jax.Array) -> jax.Array:
  """`x` (float32) rounded to one of the two E2M1 values around it, the
  upper one with probability (|x| - low) / (high - low) (to 16 bits):
  unbiased, E[result] = x, for |x| <= 6; saturated at +-6 beyond;
  non-finite values as they are."""
  x = x.astype(jnp.float32)
  magnitude = jnp.minimum(jnp.abs(x), E2M1_MAX)
  low, high = _grid_below(magnitude)
  gap = jnp.where(high > low, high - low, 1.0)
  # 16 random bits per value (`draws16`: four per threefry block): a draw
  # of 32 bits each was half of a 4-bit matmul's time on XLA:CPU.
  uniform = random_bits.to_uniform(random_bits.draws16(key, x.shape),
                                   random_bits.BITS16)
  up = uniform < (magnitude - low) / gap
  rounded = jnp.sign(x) * jnp.where(up, high, low)
  return jnp.where(jnp.isfinite(x), rounded, x)


def _rounded(x: jax.Array, key: Optional[jax.Array]) -> jax.Array:
  return round_e2m1(x) if key is None else stochastic_round_e2m1(x, key)


def nvfp4_tensor_scale(x: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """NVFP4's scale per tensor, amax / (6 x 448), so that a block scale of at
  most E4M3's 448 covers the tensor's largest value, as (scale, up, down):
  the float32 scale of `x` times `up`, the power of two that brings an amax
  below 1 up to [1, 2) (1 for an amax of 1 or more), and `down`, 1 / up.
  `nvfp4` quantizes `x` times `up` and scales the result back, exactly:
  amax / 2688 of an amax below 3.16e-35 is no normal float32, which XLA:CPU
  flushes to zero (the block scales would be NaN, the tensor all zeros).
  Clamping the scale at float32's smallest normal, as Transformer Engine
  clamps its reciprocal at float32's largest, would shrink such a tensor's
  block scales and round it otherwise than a larger copy; a power of two
  does not. (1, 1, 1) for a zero or non-finite amax."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  usable = jnp.isfinite(amax) & (amax > 0)
  amax = jnp.where(usable, amax, 1.0)
  scaled = times_exp2(amax, jnp.clip(-exponent_of(amax), 0, _MAX_SHIFT))
  # The factors as quotients (exact: powers of two), not from the exponent's
  # bits: XLA:CPU computed those again for every value, in the loop that
  # rounds them, and stochastic NVFP4 took 1.5 times as long.
  return (jnp.where(usable, scaled / (E2M1_MAX * E4M3_MAX), 1.0),
          scaled / amax, amax / scaled)


def _nvfp4_blocks(blocks: jax.Array,
                  tensor_scale: tuple[jax.Array, jax.Array, jax.Array],
                  key: Optional[jax.Array], axes: tuple[int, ...]
                  ) -> jax.Array:
  """Blocks (each block's values on `axes`) as NVFP4 holds them, times
  `up` and back (`nvfp4_tensor_scale`): each block's scale, amax / 6 in
  units of the tensor's scale, rounded to E4M3; its values divided by it,
  rounded to E2M1, and multiplied back."""
  tensor_scale, up, down = tensor_scale
  blocks = blocks * up
  block_amax = jnp.max(jnp.abs(blocks), axis=axes, keepdims=True)
  scale = (block_amax / E2M1_MAX / tensor_scale).astype(
      jnp.float8_e4m3fn).astype(jnp.float32)
  # A zero block (or one whose scale underflows E4M3) holds zeros.
  safe = jnp.where(scale > 0, scale, 1.0) * tensor_scale
  values = _rounded(blocks / safe, key)
  return jnp.where(scale > 0, values * safe, 0.0 * blocks) * down


def nvfp4(x: jax.Array, axis: int = -1, *, two_d: bool = False,
          key: Optional[jax.Array] = None,
          block: int = NVFP4_BLOCK) -> jax.Array:
  """`x` (float32) as NVFP4 holds it: blocks of `block` values along `axis`
  (`two_d`: 2-D `x` in `block` x `block` tiles, the recipe's weights, so
  that a matrix and its transpose quantize alike), each with an E4M3 scale
  under the tensor's float32 scale; values rounded to E2M1, to nearest or,
  with `key`, stochastically."""
  tensor_scale = nvfp4_tensor_scale(x)
  if two_d:
    if x.ndim != 2:
      raise ValueError(f'2-D block scaling takes a matrix, not shape '
                       f'{x.shape}')
    held = _nvfp4_blocks(blocks_lib.tiles(x, block), tensor_scale, key,
                         (1, 3))
    return blocks_lib.untiles(held, x.shape)
  axis = axis % x.ndim
  held = _nvfp4_blocks(blocks_lib.split(x, axis, block), tensor_scale, key,
                       (axis + 1,))
  return blocks_lib.merge(held, axis, x.shape[axis])


def mxfp4_block_exponents(blocks: jax.Array,
                          axes: tuple[int, ...] = (-1,)) -> jax.Array:
  """E8M0 exponents (int32, size 1 on `axes`) of blocks whose values lie on
  `axes`: ceil(log2(amax / 6)), so no value saturates, within E8M0's range;
  0 for a zero block."""
  amax = jnp.max(jnp.abs(blocks), axis=axes, keepdims=True)
  mantissa, exponent = jnp.frexp(jnp.maximum(amax, _TINY))
  # amax = m * 2**e, m in [0.5, 1); amax / 6 = (m / 0.75) * 2**(e - 3):
  # ceil(log2) is e - 3 where m <= 0.75, else e - 2.
  ceil = exponent - (_E2M1_EMAX + 1) + (mantissa > 0.75).astype(jnp.int32)
  ceil = jnp.clip(ceil, MX_MIN_EXPONENT, MX_MAX_EXPONENT)
  return jnp.where(amax > 0, ceil, 0)


def _mxfp4_blocks(blocks: jax.Array, key: Optional[jax.Array],
                  axes: tuple[int, ...]) -> jax.Array:
  """Blocks (values on `axes`) as MXFP4 holds them: exact powers of two, in
  two factors where E8M0 leaves float32's normals; a finite value that
  rounds up to 2**128 saturates at float32's largest, the float32 nearest
  it, as no float32 holds it (non-finite values stay as they are)."""
  exponents = mxfp4_block_exponents(blocks, axes)
  held = times_exp2(_rounded(times_exp2(blocks, -exponents), key), exponents)
  return jnp.where(jnp.isfinite(blocks), jnp.clip(held, -_F32_MAX, _F32_MAX),
                   held)


def mxfp4(x: jax.Array, axis: int = -1, *, key: Optional[jax.Array] = None,
          block: int = MXFP4_BLOCK, two_d: bool = False) -> jax.Array:
  """`x` (float32) as MXFP4 holds it: blocks of `block` values along `axis`
  (`two_d`: 2-D `x` in `block` x `block` tiles), each with a power-of-two
  (E8M0) scale; values rounded to E2M1, to nearest or, with `key`,
  stochastically."""
  if two_d:
    if x.ndim != 2:
      raise ValueError(f'2-D block scaling takes a matrix, not shape '
                       f'{x.shape}')
    held = _mxfp4_blocks(blocks_lib.tiles(x, block), key, (1, 3))
    return blocks_lib.untiles(held, x.shape)
  axis = axis % x.ndim
  held = _mxfp4_blocks(blocks_lib.split(x, axis, block), key, (axis + 1,))
  return blocks_lib.merge(held, axis, x.shape[axis])


def hadamard(size: int = NVFP4_BLOCK) -> jax.Array:
  """The `size` x `size` Hadamard matrix (Sylvester's; `size` a power of
  two) divided by sqrt(size): orthogonal, H @ H.T = I."""
  if size < 1 or size & (size - 1):
    raise ValueError(f'a Hadamard size must be a power of two, not {size}')
  h = jnp.ones((1, 1), jnp.float32)
  while h.shape[0] < size:
    h = jnp.block([[h, h], [h, -h]])
  return h / math.sqrt(size)


def signed_hadamard(signs: jax.Array) -> jax.Array:
  """H @ diag(signs): the random Hadamard transform with the signs applied
  to the block's values before H mixes them, still orthogonal. In this
  order a block of near-equal values (a channel's offset shared by 16
  tokens) comes out spread; with the signs after H (diag(s) @ H) it would
  come out as one spike beside 15 small values, which a 4-bit block
  flushes (the advisor found 10-42% of attention/out's input blocks so)."""
  return hadamard(signs.shape[0]) * signs[None, :]


def random_hadamard(key: jax.Array, size: int = NVFP4_BLOCK) -> jax.Array:
  """The recipe's random Hadamard transform: `signed_hadamard` with the
  signs drawn from `key`."""
  return signed_hadamard(
      jnp.where(jax.random.bernoulli(key, 0.5, (size,)), 1.0, -1.0))


def hadamard_transform(x: jax.Array, signs: jax.Array, axis: int) -> jax.Array:
  """Each block of 16 values along `axis` times `signed_hadamard(signs)`,
  as butterflies:
  Sylvester's H is a Kronecker product of 2 x 2 factors, so each block is
  mixed by log2(size) rounds of sums and differences. Each output is the
  same sums in the same order however the tokens are sharded (a GEMM's
  order is not, and a last-bit difference flips a rounding to E2M1), and on
  XLA:CPU it takes a fraction of the GEMM's time."""
  size = signs.shape[0]
  axis = axis % x.ndim
  if size < 1 or size & (size - 1) or x.shape[axis] % size:
    raise ValueError(f'the Hadamard transform of {size} (a power of two) '
                     f'takes an axis that {size} divides, not '
                     f'{x.shape[axis]}')
  split = blocks_lib.split(x, axis, size)
  shape = split.shape
  split = split * signs.astype(jnp.float32).reshape(
      size, *[1] * (split.ndim - axis - 2))
  rounds = size.bit_length() - 1
  mixed = split.reshape(*shape[:axis + 1], *[2] * rounds, *shape[axis + 2:])
  for bit in range(axis + 1, axis + 1 + rounds):
    low, high = (jax.lax.index_in_dim(mixed, i, bit) for i in (0, 1))
    mixed = jnp.concatenate([low + high, low - high], axis=bit)
  return blocks_lib.merge(mixed.reshape(shape) / math.sqrt(size), axis,
                          x.shape[axis])
