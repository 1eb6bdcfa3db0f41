"""Rounding a float32 result into bfloat16 state: nearest, stochastic, Kahan.

Training state kept in bfloat16 without a float32 copy (params, Adam's
moments) takes each step's float32 result rounded once. Rounded to nearest,
an update below half a bfloat16 ulp (2**-9 of the value) is lost every step,
so small learning rates stop moving the params and a slowly decaying average
(Adam's second moment at b2 = 0.999) never moves. Two remedies, as in
"Revisiting BFloat16 Training" (arXiv 2010.06192):

- stochastic rounding: up or down with probabilities that make the expected
  result the float32 value, so small updates survive on average;
- Kahan summation: a compensation buffer, in the state's own dtype, keeps what
  the last rounding dropped and adds it to the next update.

optax has neither (its `mu_dtype` casts to nearest), so they are written here.
"""

import jax
import jax.numpy as jnp

from haiku_mp.model import random_bits

# The float32 bits that bfloat16 drops: the low half of the 32.
_DROPPED_BITS = 16
_KEPT_MASK = 0xFFFF0000
# The independent draws one step's rounding key gives (fold_in data): the
# params' (param_updates.apply_updates) and Adam's moments'
# (optimizer.scale_by_adam).
PARAMS_DRAW, MU_DRAW, NU_DRAW = 0, 1, 2


def stochastic_round(key: jax.Array, x: jax.Array, dtype) -> jax.Array:
  """`x` (float32) in `dtype`: bfloat16 rounded up or down with probability
  proportional to the distance to the other neighbour (unbiased), or `x`
  itself for float32. Non-finite values round to nearest.

  Adds 16 uniform random bits below bfloat16's last mantissa bit and
  truncates: a carry, which happens with probability (dropped bits) / 2**16,
  rounds the magnitude up. The draw depends on `key` and the shape only, so
  every device and every sharding of `x` rounds the same element the same
  way (threefry's partitionable bits).
  """
  dtype = _checked(dtype)
  x = jnp.asarray(x, jnp.float32)
  if dtype == jnp.float32:
    return x
  return _round_with(jax.random.bits(key, x.shape, jnp.uint32), x, dtype)


def _checked(dtype) -> jnp.dtype:
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f'stochastic rounding to {dtype} is not supported; '
                     'expected bfloat16 or float32')
  return dtype


def _round_with(random_bits: jax.Array, x: jax.Array, dtype) -> jax.Array:
  """float32 `x` in bfloat16, rounded by 32 uniform `random_bits` per value
  (their top 16 are used)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  kept = (bits + (random_bits >> _DROPPED_BITS)) & jnp.uint32(_KEPT_MASK)
  rounded = jax.lax.bitcast_convert_type(kept, jnp.float32).astype(dtype)
  return jnp.where(jnp.isfinite(x), rounded, x.astype(dtype))


def kahan_add(value: jax.Array, update: jax.Array, compensation: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
  """(value + (update + compensation) rounded to nearest in `value`'s dtype,
  what that rounding dropped, in `compensation`'s dtype): compensated
  summation, computed in float32 in that order."""
  total = value.astype(jnp.float32) + (update.astype(jnp.float32)
                                       + compensation.astype(jnp.float32))
  rounded = total.astype(value.dtype)
  return rounded, (total - rounded.astype(jnp.float32)).astype(
      compensation.dtype)


def tree_stochastic_round(key: jax.Array, tree, dtypes):
  """`stochastic_round` of every leaf of `tree` to its dtype in `dtypes` (a
  tree of the same structure with dtypes as leaves).

  One draw of random bits for all the leaves rounded to bfloat16
  (`random_bits.tree_bits`), the same on every device and sharding.
  """
  leaves, treedef = jax.tree.flatten(tree)
  dtypes = [_checked(d) for d in treedef.flatten_up_to(dtypes)]
  leaves = [jnp.asarray(x, jnp.float32) for x in leaves]
  drawn = [x for x, d in zip(leaves, dtypes) if d == jnp.bfloat16]
  bits = iter(random_bits.tree_bits(key, drawn))
  return treedef.unflatten([
      x if dtype == jnp.float32 else _round_with(next(bits), x, dtype)
      for x, dtype in zip(leaves, dtypes)])
