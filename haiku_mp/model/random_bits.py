"""Random bits for the library's draws, each way of drawing written once:
dropout's 16-bit draws, the uniform floats that stochastic rounding compares
against (4-bit weights, 8-bit moments), and one draw for a whole tree
(bfloat16 state, 8-bit moments).

JAX's partitionable threefry (the default) hashes one whole 64-bit
threefry2x32 block per element that `jax.random.bits` draws, whatever the
width asked for. `draws16` takes four 16-bit draws from each block: a
quarter of the hashing (on XLA:CPU the reference step spent about 0.5 s of
its 2.5 s drawing dropout's bits one per element). jax has no narrower draw,
so this one is written here.
"""

import math

import jax
from jax import lax
import jax.extend.random as jex_random
import jax.numpy as jnp
import numpy as np

BITS16 = 16
# float32 holds (d + 1/2) / 2**bits exactly, and below 1, for every d of up
# to 23 bits (24 bits of precision in all).
MAX_UNIFORM_BITS = 23


def draws16(key: jax.Array, shape) -> jax.Array:
  """Integers uniform in [0, 2**16), shaped `shape` (as uint32). Keys of
  another PRNG implementation take `jax.random.bits`."""
  size = math.prod(shape)
  if str(jax.random.key_impl(key)) != 'threefry2x32':
    return jax.random.bits(key, shape, jnp.uint16).astype(jnp.uint32)
  blocks = -(-size // 4)
  k1, k2 = jax.random.key_data(key)
  # 2 * blocks counters hash to 2 * blocks 32-bit words: two draws each.
  words = jex_random.threefry_2x32((k1, k2), lax.iota(jnp.uint32, 2 * blocks))
  draws = jnp.stack([words & (2**BITS16 - 1), words >> BITS16], axis=-1)
  return draws.reshape(-1)[:size].reshape(shape)


def to_uniform(draws: jax.Array, bits: int) -> jax.Array:
  """float32 uniform in (0, 1) from integers uniform in [0, 2**bits): the
  middle of each of the 2**bits intervals, so the mean is exactly 1/2 and
  `u < p` is true with probability p to within 2**-(bits+1). At most
  `MAX_UNIFORM_BITS`."""
  if bits > MAX_UNIFORM_BITS:
    raise ValueError(f'to_uniform: {bits} bits, at most {MAX_UNIFORM_BITS} '
                     'fit float32 exactly')
  return ((draws.astype(jnp.float32) + np.float32(0.5))
          * np.float32(2.0**-bits))


def tree_bits(key: jax.Array, leaves) -> list[jax.Array]:
  """32 random bits (uint32) per element of each of `leaves`, shaped like
  it, from one draw for them all, each leaf taking its slice in order: a
  threefry per leaf made a train step's program several thousand
  operations longer (the tiny ViT's step with bfloat16 params and moments
  compiled in 4.9 s against 1.5 s rounded to nearest). The draw is of the
  whole tree, so it is the same on every device and sharding."""
  bits = jax.random.bits(key, (sum(x.size for x in leaves),), jnp.uint32)
  sliced, start = [], 0
  for x in leaves:
    sliced.append(bits[start:start + x.size].reshape(x.shape))
    start += x.size
  return sliced
