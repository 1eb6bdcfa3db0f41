"""Dropout that draws 16 random bits per element instead of a 64-bit block.

`hk.dropout` draws a uniform float per element, one whole threefry2x32 block
each; here each block gives four 16-bit draws (`random_bits.draws16`), a
quarter of the hashing. The rate is quantized to 2**-16 (0.1 -> 0.100006)
and the kept values are divided by the quantized keep probability, so the
expectation is still `x` (to one rounding).
"""

import jax
import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.model import random_bits

_LEVELS = 2**random_bits.BITS16


class DropoutError(errors.ArgumentError):
  """A dropout rate out of [0, 1); the message names the argument."""


def check_rate(rate: float) -> float:
  """`rate`, or a DropoutError naming it (`$rate`)."""
  if not 0.0 <= rate < 1.0:
    raise DropoutError(f'$rate={rate:g} must be in [0, 1)')
  return rate


def dropout(key: jax.Array, rate: float, x: jax.Array,
            per_example: bool = False) -> jax.Array:
  """`x` with each element zeroed with probability `rate` (to 2**-16) and
  the rest scaled so the expectation is `x` (to one rounding). With
  `per_example`, one draw per index of the leading axis zeroes or keeps the
  whole example (stochastic depth's drop path)."""
  threshold = round(check_rate(rate) * _LEVELS)
  if threshold == 0:
    return x
  shape = (x.shape[0],) + (1,) * (x.ndim - 1) if per_example else x.shape
  keep = random_bits.draws16(key, shape) >= threshold
  # Scaled in float32 and rounded once: a half-precision keep probability
  # (0.9 is 0.8984 in bf16) would bias every kept value the same way.
  wide = jnp.promote_types(x.dtype, jnp.float32)
  scaled = (x.astype(wide) / ((_LEVELS - threshold) / _LEVELS)).astype(x.dtype)
  return jnp.where(keep, scaled, jnp.zeros_like(x))
