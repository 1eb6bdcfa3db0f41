"""4-bit floats, emulated: NVFP4 and MXFP4 blocks quantized and dequantized.

Both formats hold E2M1 values (sign, 2 exponent bits, 1 mantissa bit: 0,
0.5, 1, 1.5, 2, 3, 4, 6; no inf or NaN) in blocks that share a scale:

- ``nvfp4`` (NVIDIA, "Pretraining LLMs with NVFP4", arXiv 2509.25149): blocks
  of 16 values with an E4M3 scale, under a float32 scale per tensor that
  maps the tensor's amax to E4M3's largest scale times E2M1's largest value
  (6 x 448), as Transformer Engine computes it. A block's E4M3 scale is its
  amax / 6 in those units, rounded to nearest, so the block's largest value
  may exceed 6 after it and saturate.
- ``mxfp4`` (OCP MX v1.0): blocks of 32 values with an E8M0 (power-of-two)
  scale. The spec's scale, 2**(floor(log2(amax)) - 2), lets a block's
  largest values reach 8 and saturate at 6; here, as for MXFP8
  (`fp8.mx_block_exponents`) and in Transformer Engine's MX recipes, the
  exponent is rounded up so that no value of a block saturates.

Rounding to E2M1 is the cast to `float4_e2m1fn` (ml_dtypes' dtype): XLA:CPU
(jaxlib 0.10.2) converts float32 to it round-to-nearest-even and saturating
at 6, the same bit for bit as ml_dtypes (tests/fp4_test.py checks it on this
machine), but it turns NaN into -0; `round_e2m1` keeps non-finite values
as they are, so that a step's finite check still sees them. Stochastic
rounding (`stochastic_round_e2m1`) picks one of the two grid points around a
value with the probability that makes it unbiased.

Nothing here runs a 4-bit GEMM: the dequantized values multiply in bfloat16
or float32 with float32 sums. What these formats cost in accuracy can be
measured on any machine; their speed exists only on Blackwell's tensor cores.
"""

import dataclasses
import functools
import math
from typing import Optional
import zlib

import haiku as hk
import jax
import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.model import blocks as blocks_lib
from haiku_mp.model.fp8 import DGRAD
from haiku_mp.model.fp8 import FP4_SIGNS
from haiku_mp.model.fp8 import FPROP
from haiku_mp.model.fp8 import times_exp2
from haiku_mp.model.fp8 import WGRAD

E2M1 = jnp.float4_e2m1fn
E2M1_MAX = 6.0  # The largest E2M1 value.
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448: NVFP4's block scales.
NVFP4_BLOCK = 16  # Values per E4M3 scale (NVIDIA's NVFP4).
MXFP4_BLOCK = 32  # Values per E8M0 scale (the OCP MX spec's).
FORMATS = ('nvfp4', 'mxfp4')
# E2M1's largest exponent: 6 = 1.5 * 2**2.
_E2M1_EMAX = 2
# E8M0's exponent range, as MXFP8's (`fp8`).
_MX_MIN_EXPONENT, _MX_MAX_EXPONENT = -127, 127
_TINY = float(jnp.finfo(jnp.float32).tiny)


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


# Random bits per stochastically rounded value: 16, two values per 32-bit
# word of JAX's threefry (`jax.random.bits`). The uniform draw of 32 bits
# each was half of a 4-bit matmul's time on XLA:CPU; 16 bits leave a bias
# of at most 2**-17 of the gap between two grid values.
_RANDOM_BITS = 16


def _uniform_halves(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform float32 in (0, 1) of `shape`, 16 random bits each, drawn as
  half as many 32-bit words: the words' high halves fill the first half of
  the last axis, their low halves the second."""
  last = shape[-1] if shape else 1
  words = jax.random.bits(key, (*shape[:-1], -(-last // 2)), jnp.uint32)
  halves = jnp.concatenate([words >> _RANDOM_BITS, words & 0xFFFF], axis=-1)
  halves = halves[..., :last].reshape(shape)
  return (halves.astype(jnp.float32) + 0.5) * 2.0**-_RANDOM_BITS


def stochastic_round_e2m1(x: jax.Array, key: jax.Array) -> jax.Array:
  """`x` (float32) rounded to one of the two E2M1 values around it, the
  upper one with probability (|x| - low) / (high - low) (to 16 bits):
  unbiased, E[result] = x, for |x| <= 6; saturated at +-6 beyond;
  non-finite values as they are."""
  x = x.astype(jnp.float32)
  magnitude = jnp.minimum(jnp.abs(x), E2M1_MAX)
  low, high = _grid_below(magnitude)
  gap = jnp.where(high > low, high - low, 1.0)
  up = _uniform_halves(key, x.shape) < (magnitude - low) / gap
  rounded = jnp.sign(x) * jnp.where(up, high, low)
  return jnp.where(jnp.isfinite(x), rounded, x)


def _rounded(x: jax.Array, key: Optional[jax.Array]) -> jax.Array:
  return round_e2m1(x) if key is None else stochastic_round_e2m1(x, key)


def nvfp4_tensor_scale(x: jax.Array) -> jax.Array:
  """NVFP4's float32 scale per tensor: amax / (6 x 448), so that a block
  scale of at most E4M3's 448 covers the tensor's largest value; 1 for a
  zero or non-finite amax."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  usable = jnp.isfinite(amax) & (amax > 0)
  return jnp.where(usable, jnp.maximum(amax, _TINY) / (E2M1_MAX * E4M3_MAX),
                   1.0)


def _nvfp4_blocks(blocks: jax.Array, tensor_scale: jax.Array,
                  key: Optional[jax.Array], axes: tuple[int, ...]
                  ) -> jax.Array:
  """Blocks (each block's values on `axes`) as NVFP4 holds them: each
  block's scale, amax / 6 in units of `tensor_scale`, rounded to E4M3; its
  values divided by it, rounded to E2M1, and multiplied back."""
  block_amax = jnp.max(jnp.abs(blocks), axis=axes, keepdims=True)
  scale = (block_amax / E2M1_MAX / tensor_scale).astype(
      jnp.float8_e4m3fn).astype(jnp.float32)
  # A zero block (or one whose scale underflows E4M3) holds zeros.
  safe = jnp.where(scale > 0, scale, 1.0) * tensor_scale
  values = _rounded(blocks / safe, key)
  return jnp.where(scale > 0, values * safe, 0.0 * blocks)


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
  ceil = jnp.clip(ceil, _MX_MIN_EXPONENT, _MX_MAX_EXPONENT)
  return jnp.where(amax > 0, ceil, 0)


def _mxfp4_blocks(blocks: jax.Array, key: Optional[jax.Array],
                  axes: tuple[int, ...]) -> jax.Array:
  """Blocks (values on `axes`) as MXFP4 holds them: exact powers of two, in
  two factors where E8M0 leaves float32's normals."""
  exponents = mxfp4_block_exponents(blocks, axes)
  return times_exp2(_rounded(times_exp2(blocks, -exponents), key), exponents)


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


# ---- the 4-bit matmul of a Linear -------------------------------------------

# A Linear's Hadamard signs (float32 [16], +-1): a param the optimizer never
# sees, kept in the state like fp8's amax histories (`fp8.META_NAMES`); its
# "gradient" is itself, so the train step's overwrite keeps it.
SIGNS_NAME = FP4_SIGNS
# The signs' seed, folded with the layer's path: the same signs for a layer
# in every run, drawn without Haiku's key sequence (which would change the
# init of the params after it).
SIGNS_SEED = 4


@dataclasses.dataclass(frozen=True)
class Fp4:
  """How a 4-bit matmul quantizes, with the NVFP4 recipe's parts (arXiv
  2509.25149) as settings, each at the paper's default.

  Example:
    precision = haiku_mp.make_precision(BF16, model_class=hk.nets.MLP,
        fp8_modules='Linear', fp4=haiku_mp.Fp4('nvfp4'),
        keep_fp8='*/linear_1')  # linear_1 keeps fp8, the others 4 bits.
  """
  format: str = 'nvfp4'
  # Weights in 2-D tiles (16 x 16 for NVFP4, 32 x 32 for MXFP4): the forward
  # and the input gradient's GEMM see the same quantized weight.
  two_d_weights: bool = True
  # The weight gradient's GEMM inputs through a random 16 x 16 Hadamard
  # transform along the tokens, which spreads an outlier over its block.
  hadamard: bool = True
  # Output gradients rounded stochastically (unbiased); the rest to nearest.
  stochastic_gradients: bool = True

  def __post_init__(self):
    errors.check_choice('precision.fp8.format', self.format, FORMATS)

  @property
  def block(self) -> int:
    return NVFP4_BLOCK if self.format == 'nvfp4' else MXFP4_BLOCK

  def quantized(self, x: jax.Array, axis: int, key=None,
                two_d: bool = False) -> jax.Array:
    """`x` as this format holds it, in blocks along `axis` (or tiles)."""
    if self.format == 'nvfp4':
      return nvfp4(x, axis, two_d=two_d, key=key)
    return mxfp4(x, axis, two_d=two_d, key=key)

  def describe(self) -> str:
    parts = [f'{self.format} (blocks of {self.block})']
    if self.two_d_weights:
      parts.append(f'{self.block}x{self.block} weight tiles')
    if self.hadamard:
      parts.append('Hadamard on the weight gradient')
    if self.stochastic_gradients:
      parts.append('stochastic gradients')
    return ', '.join(parts)


def check_dims(config: Fp4, path: str, tokens: Optional[int], inputs: int,
               outputs: int) -> None:
  """Raises, naming the setting, unless each of the three GEMMs' contracting
  dimensions is a whole number of blocks (and the tokens of Hadamard
  blocks): the blocks are never padded. `tokens` None: not known yet (an
  init traced at another batch size)."""
  needs = [('input features', inputs, config.block),
           ('output features (the input gradient\'s GEMM)', outputs,
            config.block)]
  if tokens is not None:
    needs.append(('tokens of a step (the weight gradient\'s GEMM)',
                  tokens, config.block))
  if config.hadamard and tokens is not None:
    needs.append(('tokens of a step (the Hadamard transform)', tokens,
                  NVFP4_BLOCK))
  for what, size, block in needs:
    if size % block:
      raise errors.ConfigError(
          f'precision.fp8.format={config.format}: {path}: {what}: {size}, '
          f'not a multiple of {block}; leave it out of '
          'precision.fp8.modules or pick sizes that blocks divide')


def _dot(a, b, dims):
  return jax.lax.dot_general(a, b, dims, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)


_FWD = (((1,), (0,)), ((), ()))  # x [n, k] @ w [k, o]
_DGRAD = (((1,), (1,)), ((), ()))  # g [n, o] @ w.T
_WGRAD = (((0,), (0,)), ((), ()))  # x.T @ g


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def matmul(config: Fp4, out_dtype, x, w, key_bits, signs):
  """`x [n, k] @ w [k, o]` on 4-bit operands, float32 sums rounded to
  `out_dtype`. `key_bits` (uint32, `jax.random.key_data` of the step's key
  for this layer) draws the gradients' stochastic rounding; `signs` the
  Hadamard's (+-1 [16]; ignored without it)."""
  return _forward(config, out_dtype, x, w, key_bits, signs)[0]


def _forward(config, out_dtype, x, w, key_bits, signs):
  qx = config.quantized(x, 1)
  qw = config.quantized(w, 0, two_d=config.two_d_weights)
  with jax.named_scope(FPROP):
    out = _dot(qx, qw, _FWD).astype(out_dtype)
  return out, (x, w, qw, key_bits, signs)


def _backward(config, out_dtype, residuals, g):
  del out_dtype
  x, w, qw, key_bits, signs = residuals
  g = g.astype(jnp.float32)
  key = jax.random.wrap_key_data(key_bits)
  dgrad_key, wgrad_key = jax.random.split(key)
  stochastic = config.stochastic_gradients
  qg = config.quantized(g, 1, dgrad_key if stochastic else None)
  # 2-D tiles hold the same values whichever axis contracts.
  w_dgrad = qw if config.two_d_weights else config.quantized(w, 1)
  with jax.named_scope(DGRAD):
    dx = _dot(qg, w_dgrad, _DGRAD)
  xt, gt = x.astype(jnp.float32), g
  if config.hadamard:
    xt, gt = (hadamard_transform(t, signs, 0) for t in (xt, gt))
  qxt = config.quantized(xt, 0)
  qgt = config.quantized(gt, 0, wgrad_key if stochastic else None)
  with jax.named_scope(WGRAD):
    dw = _dot(qxt, qgt, _WGRAD)
  # The key has no gradient; the signs' "gradient" is themselves (kept).
  return (dx.astype(x.dtype), dw.astype(w.dtype), None, signs)


matmul.defvjp(_forward, _backward)


def initial_signs(path: str):
  """The initializer of the Linear at `path`'s Hadamard signs: +-1 from
  `SIGNS_SEED` and the path (crc32), the same in every run."""

  def init(shape, dtype) -> jax.Array:
    key = jax.random.fold_in(jax.random.key(SIGNS_SEED),
                             zlib.crc32(path.encode()) & 0x7fffffff)
    bits = jax.random.bernoulli(key, 0.5, tuple(shape))
    return jnp.where(bits, 1.0, -1.0).astype(dtype)

  return init


def linear_sums(config: Fp4, path: str, x: jax.Array,
                w: jax.Array) -> jax.Array:
  """`x [n, k] @ w [k, o]` in float32 from 4-bit operands, in the calling
  Linear's scope: its Hadamard signs a param of its own, its stochastic
  rounding keyed by the next of Haiku's keys (none at init, which so keeps
  the params' init; a forward without a key, such as evaluation's, has no
  backward to round)."""
  key = None if hk.running_init() else hk.maybe_next_rng_key()
  # The tokens matter where there is a backward: a forward with a key.
  check_dims(config, path, None if key is None else x.shape[0], x.shape[1],
             w.shape[1])
  signs = (hk.get_parameter(SIGNS_NAME, [NVFP4_BLOCK], jnp.float32,
                            init=initial_signs(path))
           if config.hadamard else jnp.ones([NVFP4_BLOCK], jnp.float32))
  bits = (jax.random.key_data(key) if key is not None else
          jax.random.key_data(jax.random.key(0)))
  return matmul(config, jnp.float32, x, w, bits, signs)
