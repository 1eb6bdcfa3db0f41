"""How NVFP4 and MXFP4 would hold a Linear's operands: one vector of
statistics per tensor, computed on the device, as `fp8_numerics` does for
E4M3 and E5M2.

A 4-bit block has one scale for 16 (NVFP4) or 32 (MXFP4) values and E2M1
values, whose smallest non-zero magnitude is 1/12 of the largest: one large
value in a block flushes those under 1/24 of it to zero. So per format and
per way the train step blocks the tensor (`CASES`), beside the tensor's
non-zero count and squared norm:

- the blocks with two or more non-zero values, and the **flushed** ones
  among them: at least half of their non-zero values other than the largest
  rounded to zero (an outlier that takes its block with it);
- the non-zero values rounded to zero, and the squared rounding error.

The input x and the output gradient g are blocked along their contracting
axis for the forward and the input gradient, and along the tokens for the
weight gradient, there with and without the recipe's random Hadamard
transform (16 x 16, the layer's own signs), which spreads an outlier over
its block. The weight is blocked along its input features (the recipe's
16 x 16 tiles group the same columns 16 rows at a time). Rounding is to
nearest: stochastic rounding is unbiased but no closer.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.model import blocks as blocks_lib
from haiku_mp.model import fp4

# Per tensor, the ways the step blocks it: (name, axis, Hadamard).
CASES = {
    'input': (('forward', -1, False), ('wgrad', 0, False),
              ('wgrad_hadamard', 0, True)),
    'gradient': (('dgrad', -1, False), ('wgrad', 0, False),
                 ('wgrad_hadamard', 0, True)),
    'weight': (('forward', 0, False),),
}
TENSOR_FIELDS = ('nonzero', 'sum_squares')
CASE_FIELDS = ('blocks', 'flushed_blocks', 'underflow', 'error_squares')


def fields(tensor: str) -> tuple[str, ...]:
  """The statistics' names of one tensor ('input', 'gradient', 'weight')."""
  return TENSOR_FIELDS + tuple(
      f'{fmt}_{case}_{field}' for fmt in fp4.FORMATS
      for case, _, _ in CASES[tensor] for field in CASE_FIELDS)


def size(tensor: str) -> int:
  return len(fields(tensor))


def _case_stats(x: jax.Array, fmt: str, axis: int) -> list[jax.Array]:
  """[blocks, flushed_blocks, underflow, error_squares] of 2-D `x` held as
  `fmt` in blocks along `axis`."""
  config = fp4.Fp4(fmt)
  held = config.quantized(x, axis)
  error = held - x
  values = blocks_lib.along_last(x, axis, config.block)
  kept = blocks_lib.along_last(held, axis, config.block)
  nonzero = values != 0
  flushed = nonzero & (kept == 0)
  count = jnp.sum(nonzero, axis=-1)
  # The largest value of a block is never flushed (it sets the scale).
  flushed_blocks = (count >= 2) & (2 * jnp.sum(flushed, axis=-1) >= count - 1)
  return [jnp.sum(count >= 2).astype(jnp.float32),
          jnp.sum(flushed_blocks).astype(jnp.float32),
          jnp.sum(flushed).astype(jnp.float32), jnp.sum(error * error)]


def _hadamard_along_tokens(x: jax.Array, signs: jax.Array) -> jax.Array:
  """`x` [tokens, k] with the recipe's transform on each block of 16
  tokens (zero-padded to whole blocks; orthogonal, so the norm stays)."""
  x = jnp.pad(x, [(0, -x.shape[0] % fp4.NVFP4_BLOCK), (0, 0)])
  return fp4.hadamard_transform(x, signs, 0)


def tensor_stats(x: jax.Array, tensor: str, signs: jax.Array) -> jax.Array:
  """`x`'s statistics (`fields(tensor)`) as one float32 vector; `x` is
  flattened to [tokens, features] (a weight: [inputs, outputs])."""
  x = x.astype(jnp.float32)
  x = jnp.where(jnp.isfinite(x), x, 0.0).reshape(-1, x.shape[-1])
  out = [jnp.sum(x != 0).astype(jnp.float32), jnp.sum(x * x)]
  transformed = None
  for fmt in fp4.FORMATS:
    for _, axis, hadamard in CASES[tensor]:
      if hadamard and transformed is None:
        transformed = _hadamard_along_tokens(x, signs)
      out += _case_stats(transformed if hadamard else x, fmt, axis)
  return jnp.stack(out)


def merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Two batches' statistics of a tensor as one (all sums)."""
  return np.asarray(a, np.float64) + np.asarray(b, np.float64)


def as_dict(stats: np.ndarray, tensor: str) -> dict:
  """Per format and case: the share of blocks flushed, of non-zero values
  rounded to zero, and the rounding error relative to the tensor's norm."""
  named = dict(zip(fields(tensor), np.asarray(stats, np.float64)))
  nonzero, norm = named['nonzero'], math.sqrt(named['sum_squares'])
  result = dict(nonzero=int(nonzero))
  for fmt in fp4.FORMATS:
    result[fmt] = {}
    for case, _, _ in CASES[tensor]:
      get = lambda f: named[f'{fmt}_{case}_{f}']
      result[fmt][case] = dict(
          flushed_share=(get('flushed_blocks') / get('blocks')
                         if get('blocks') else 0.0),
          underflow_share=get('underflow') / nonzero if nonzero else 0.0,
          relative_error=(math.sqrt(get('error_squares')) / norm
                          if norm else 0.0))
  return result


def activations(x: jax.Array, g: jax.Array, signs: jax.Array) -> jax.Array:
  """A Linear's input and output gradient's statistics, one vector (a
  probe's `Operands.activations`; `signs`: the layer's Hadamard signs)."""
  return jnp.concatenate([tensor_stats(x, 'input', signs),
                          tensor_stats(g, 'gradient', signs)])


def weight(w: jax.Array, signs: jax.Array) -> jax.Array:
  """A Linear's weight's statistics (a probe's `Operands.weight`)."""
  return tensor_stats(w, 'weight', signs)


def split(vector) -> list[np.ndarray]:
  """A Linear's statistics as its three parts: x's, g's, the weight's."""
  vector = np.asarray(vector, np.float64)
  sizes = [size(t) for t in ('input', 'gradient', 'weight')]
  starts = np.cumsum([0] + sizes)
  return [vector[a:b] for a, b in zip(starts[:-1], starts[1:])]
