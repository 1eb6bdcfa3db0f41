"""Blocks of values along one axis, the unit a block-scaled format (MXFP8,
NVFP4, MXFP4, 8-bit optimizer moments) gives one scale.

`split` keeps the blocks in place, which the quantizers use: blocks along
the tokens (the weight gradient's GEMM) took twice as long on XLA:CPU
through a transpose. `along_last` moves them last, for code that reduces
over a block whatever its axis was.
"""

import jax
import jax.numpy as jnp


def split(x: jax.Array, axis: int, block: int) -> jax.Array:
  """float32 `x` with `axis` split in place into (blocks, `block`),
  zero-padded to a multiple of `block`: a block's values lie on axis
  `axis + 1`."""
  axis = axis % x.ndim
  x = x.astype(jnp.float32)
  padded = -x.shape[axis] % block
  if padded:
    x = jnp.pad(x, [(0, padded if a == axis else 0) for a in range(x.ndim)])
  return x.reshape(*x.shape[:axis], x.shape[axis] // block, block,
                   *x.shape[axis + 1:])


def merge(blocked: jax.Array, axis: int, size: int) -> jax.Array:
  """`split` undone: the first `size` values of `axis` (of the unsplit
  array's axes)."""
  axis = axis % (blocked.ndim - 1)
  x = blocked.reshape(*blocked.shape[:axis], -1, *blocked.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, size, axis=axis)


def along_last(x: jax.Array, axis: int, block: int) -> jax.Array:
  """`split`, its two block axes moved last: [..., blocks, `block`]."""
  axis = axis % x.ndim
  return jnp.moveaxis(split(x, axis, block), (axis, axis + 1), (-2, -1))


def from_last(blocked: jax.Array, axis: int, size: int) -> jax.Array:
  """`along_last` undone: the first `size` values, back on `axis`."""
  axis = axis % (blocked.ndim - 1)
  return merge(jnp.moveaxis(blocked, (-2, -1), (axis, axis + 1)), axis, size)


def tiles(x: jax.Array, block: int) -> jax.Array:
  """2-D `x` as [rows / block, block, cols / block, block]: a tile's values
  on axes 1 and 3 (both axes zero-padded to multiples of `block`)."""
  return split(split(x, 0, block), 2, block)


def untiles(tiled: jax.Array, shape: tuple[int, int]) -> jax.Array:
  """`tiles` undone, back to `shape`."""
  return merge(merge(tiled, 2, shape[1]), 0, shape[0])
