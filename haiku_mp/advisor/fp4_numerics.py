"""4 bits' entry in the advisor's matmul pipeline (`matmul_formats`): how
NVFP4 and MXFP4 would hold a Linear's operands, one vector of statistics
per tensor, computed on the device, as `fp8_numerics` does for E4M3 and
E5M2, and the limits a Linear must keep to run a 4-bit format.

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

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.advisor import matmul_formats
from haiku_mp.model import blocks as blocks_lib
from haiku_mp.model import fp4
from haiku_mp.model import fp4_blocks

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
  x = jnp.pad(x, [(0, -x.shape[0] % fp4_blocks.NVFP4_BLOCK), (0, 0)])
  return fp4_blocks.hadamard_transform(x, signs, 0)


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


@dataclasses.dataclass(frozen=True)
class Fp4Thresholds:
  """How much of an operand a 4-bit format may lose (the 4-bit
  limits): at most `max_flushed_share` of its blocks flushed by an outlier
  (a block whose other values an outlier pushes under E2M1's smallest step:
  the norm survives, the block's information does not) and at most
  `max_relative_error` of its norm to rounding.

  Example:
    limits = advisor.Fp4Thresholds(max_relative_error=0.2,
                                   max_flushed_share=0.05)
  """
  max_relative_error: float
  max_flushed_share: float


@dataclasses.dataclass(frozen=True)
class Fp4Matmuls(matmul_formats.MatmulFormat):
  """4 bits in the advisor's matmul pipeline: a choice per format
  (`fp4.FORMATS`), each operand blocked as the train step blocks it
  (`CASES`), the weight gradient's inputs through the random Hadamard
  transform when `hadamard` (as `Fp4.hadamard` runs it), with the layer's
  own signs. A Linear that fails keeps fp8 where fp8's verdict
  at current scaling, the one a 4-bit config's fp8 Linears run, passes.

  Example:
    totals = advisor.measure_matmuls(loss_fn, params, batches, paths,
                                     advisor.Fp4Matmuls())
  """
  hadamard: bool = True

  name = 'fp4'
  title = '4 bits'
  choices = fp4.FORMATS
  part_sizes = (size('input'), size('gradient'), size('weight'))
  columns = ('input flushed / error (forward, weight gradient)',
             'gradient flushed / error (input gradient, weight gradient)',
             'weight flushed / error')
  fallback_choice = 'current'  # fp8's scaling that a layer kept in fp8 runs.

  def extra(self, path: str, history: Sequence[Sequence[np.ndarray]]
            ) -> np.ndarray:
    """The layer's Hadamard signs, as its `Linear` initializes them."""
    del history
    return np.asarray(fp4.initial_signs(path)((fp4_blocks.NVFP4_BLOCK,),
                                              np.float32))

  def activations(self, x: jax.Array, g: jax.Array, extra: jax.Array
                  ) -> jax.Array:
    return jnp.concatenate([tensor_stats(x, 'input', extra),
                            tensor_stats(g, 'gradient', extra)])

  def weight(self, w: jax.Array, extra: jax.Array) -> jax.Array:
    return tensor_stats(w, 'weight', extra)

  def describe(self, stats: np.ndarray, operand: str) -> dict[str, Any]:
    return as_dict(stats, operand)

  def cases(self) -> dict[str, tuple[str, ...]]:
    """The blockings the train step uses, per operand."""
    wgrad = 'wgrad_hadamard' if self.hadamard else 'wgrad'
    return {'input': ('forward', wgrad), 'gradient': ('dgrad', wgrad),
            'weight': ('forward',)}

  def check(self, operands: Mapping[str, dict], choice: str,
            limits: Fp4Thresholds) -> list[str]:
    reasons = []
    for name, used in self.cases().items():
      for case in used:
        s = operands[name][choice][case]
        where = f'{name} ({case.replace("_", " + ")})'
        if s['flushed_share'] > limits.max_flushed_share:
          reasons.append(
              f'{100 * s["flushed_share"]:.3g}% of the {where}\'s {choice} '
              f'blocks are flushed by an outlier (> '
              f'{100 * limits.max_flushed_share:g}%)')
        if s['relative_error'] > limits.max_relative_error:
          reasons.append(f'{where} in {choice} errs by '
                         f'{s["relative_error"]:.3g} of its norm (> '
                         f'{limits.max_relative_error:g})')
    return reasons

  def cells(self, row: Mapping[str, Any], choice: str) -> list[str]:
    cell = lambda name, case: (
        f'{row[name][choice][case]["flushed_share"]:.2g} / '
        f'{row[name][choice][case]["relative_error"]:.2g}')
    cases = self.cases()
    return [', '.join(cell(name, case) for case in cases[name])
            for name in matmul_formats.OPERANDS]
