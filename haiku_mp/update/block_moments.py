"""Adam's moments in 8 bits: float8 codes with a float32 scale per block.

What the 8-bit optimizers do:

- bitsandbytes (Dettmers et al., "8-bit Optimizers via Block-wise
  Quantization", arXiv 2110.02861): blocks of 2048, an absmax scale per
  block, codes through a "dynamic tree" map (a sign, a run of exponent bits,
  a linear fraction), signed for the first moment and unsigned for the
  second; rounded to nearest.
- torchao's `AdamW8bit`: the same dynamic maps, blocks of 256. Its 4-bit
  state (Li et al., arXiv 2309.01507) found that a code of zero for the
  second moment wrecks the update (m / sqrt(0)) and keeps zero out of that
  map.

What is kept here, per param (`FLOAT8_BLOCKS`):

- codes in float8 E4M3 (`jnp.float8_e4m3fn`), in the param's shape:
  a map with exponent bits, like the dynamic map, but one XLA converts to
  and from natively on every backend, where a 256-entry table needs a
  search per element;
- a float32 absmax scale per block of `block_size` elements along the last
  axis (256 by default, torchao's: small enough that one large value in a
  block costs its neighbours little, 4 / 256 = 0.016 bytes per parameter
  of scales); the last axis is padded to whole blocks for the
  quantization only;
- the second moment stored as its square root, which halves the range of
  binades its codes must hold (E4M3 spans 2**17.8 within a block), and never
  coded as zero where it is not zero (the smallest code instead);
- stochastic rounding onto the E4M3 grid: Adam's second moment moves by
  (1 - b2) = 0.1% a step, far below E4M3's 6% steps, so rounded to nearest
  it would never move (rounding.py says the same of bfloat16).

Codes and scales are two trees shaped like the params, so optax's
`tree_map_params` (sharding, checkpoint targets) finds them; the codes
shard exactly as their params do.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from haiku_mp.model import blocks as blocks_lib
from haiku_mp.model import random_bits

FLOAT8_BLOCKS = 'float8_blocks'
CODE_DTYPE = jnp.float8_e4m3fn
_CODE_MAX = float(jnp.finfo(CODE_DTYPE).max)  # 448
# E4M3: 3 mantissa bits; normals from 2**-6, subnormals spaced 2**-9.
_MANTISSA_BITS = 3
_MIN_NORMAL_EXPONENT = -6
_SMALLEST_CODE = float(jnp.finfo(CODE_DTYPE).smallest_subnormal)  # 2**-9
# Bits of each uniform draw: the most whose middles float32 holds exactly.
_UNIFORM_BITS = random_bits.MAX_UNIFORM_BITS


class BlockQuantized(NamedTuple):
  """One moment: `codes` (E4M3, the params' shapes) times `scales`
  (float32, the params' shapes with the last axis counted in blocks)."""
  codes: object
  scales: object


def num_blocks(shape: tuple[int, ...], block_size: int) -> int:
  """Blocks along a param's last axis (one for a scalar)."""
  last = shape[-1] if shape else 1
  return -(-last // block_size)


def _as_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """float32 `x` as [..., blocks, block_size] along its last axis, padded
  with zeros (a scalar as one value)."""
  return blocks_lib.along_last(x.reshape(x.shape or (1,)), -1, block_size)


def _from_blocks(blocked: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  last = shape[-1] if shape else 1
  return blocks_lib.from_last(blocked, -1, last).reshape(shape)


def stochastic_round_e4m3(x: jax.Array, uniform: jax.Array) -> jax.Array:
  """float32 `x` (|x| <= 448) on the E4M3 grid: the grid point below |x| or
  the one above, the upper with probability (|x| - below) / spacing, so the
  expected result is `x`. `uniform` in [0, 1), one per value. The spacing is
  a power of two read from x's exponent (2**-9 through the subnormals), so
  every step is exact in float32."""
  magnitude = jnp.abs(x)
  # frexp: magnitude = m * 2**e with m in [0.5, 1), exactly.
  _, exponent = jnp.frexp(jnp.maximum(magnitude, _SMALLEST_CODE))
  spacing = jnp.exp2(jnp.maximum(exponent - 1, _MIN_NORMAL_EXPONENT)
                     .astype(jnp.float32) - _MANTISSA_BITS)
  below = jnp.floor(magnitude / spacing) * spacing
  up = uniform < (magnitude - below) / spacing
  rounded = jnp.minimum(below + jnp.where(up, spacing, 0.0), _CODE_MAX)
  return jnp.sign(x) * rounded


def quantize(x: jax.Array, uniform: jax.Array, block_size: int,
             nonzero: bool = False) -> tuple[jax.Array, jax.Array]:
  """(codes, scales) of float32 `x`: each block divided by its absmax / 448
  and rounded stochastically by `uniform` (x's shape). With `nonzero`, a
  value that is not zero never gets the code zero."""
  blocks = _as_blocks(x.astype(jnp.float32), block_size)
  absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / _CODE_MAX, 1.0)
  coded = stochastic_round_e4m3(
      blocks / scale, _as_blocks(uniform, block_size))
  if nonzero:
    coded = jnp.where((coded == 0) & (blocks != 0),
                      jnp.sign(blocks) * _SMALLEST_CODE, coded)
  codes = _from_blocks(coded, x.shape).astype(CODE_DTYPE)
  return codes, scale[..., 0].reshape(_scales_shape(x.shape, block_size))


def dequantize(codes: jax.Array, scales: jax.Array,
               block_size: int) -> jax.Array:
  """The float32 values `quantize` coded."""
  blocks = _as_blocks(codes.astype(jnp.float32), block_size)
  scale = scales.reshape(blocks.shape[:-1])[..., None]
  return _from_blocks(blocks * scale, codes.shape)


def _scales_shape(shape: tuple[int, ...], block_size: int) -> tuple[int, ...]:
  return (*shape[:-1], num_blocks(shape, block_size)) if shape else (1,)


def zeros_like(params, block_size: int) -> BlockQuantized:
  """A moment of zeros for `params` (codes 0, scales 1)."""
  return BlockQuantized(
      codes=jax.tree.map(lambda p: jnp.zeros(p.shape, CODE_DTYPE), params),
      scales=jax.tree.map(
          lambda p: jnp.ones(_scales_shape(p.shape, block_size), jnp.float32),
          params))


def load(moment: BlockQuantized, block_size: int, square: bool = False):
  """The float32 moment a `BlockQuantized` holds (`square`: its codes hold
  the square root)."""
  values = jax.tree.map(lambda c, s: dequantize(c, s, block_size),
                        moment.codes, moment.scales)
  return jax.tree.map(jnp.square, values) if square else values


def store(key: jax.Array, moment, block_size: int,
          square_root: bool = False) -> BlockQuantized:
  """A float32 moment tree quantized (`square_root`: its square root, never
  coded as zero). One draw of random bits for the whole tree
  (`random_bits.tree_bits`), so every device and sharding rounds an element
  the same way."""
  leaves, treedef = jax.tree.flatten(moment)
  codes, scales = [], []
  for x, bits in zip(leaves, random_bits.tree_bits(key, leaves)):
    uniform = random_bits.to_uniform(bits >> (32 - _UNIFORM_BITS),
                                     _UNIFORM_BITS)
    value = jnp.sqrt(x) if square_root else x
    c, s = quantize(value, uniform, block_size, nonzero=square_root)
    codes.append(c)
    scales.append(s)
  return BlockQuantized(treedef.unflatten(codes), treedef.unflatten(scales))
