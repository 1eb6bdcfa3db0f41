"""4-bit matmuls, emulated: a Linear's three GEMMs on NVFP4 or MXFP4
operands (`fp4_blocks`), with NVIDIA's NVFP4 training recipe (arXiv
2509.25149) as settings (`Fp4`): 2-D weight tiles, a random Hadamard
transform on the weight gradient's inputs, stochastic rounding of the
output gradients.

Nothing here runs a 4-bit GEMM: the dequantized values multiply in bfloat16
or float32 with float32 sums. What these formats cost in accuracy can be
measured on any machine; their speed exists only on Blackwell's tensor cores.
"""

import dataclasses
import functools
from typing import Optional
import zlib

import haiku as hk
import jax
import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.errors import literal
from haiku_mp.model.fp4_blocks import hadamard_transform
from haiku_mp.model.fp4_blocks import mxfp4
from haiku_mp.model.fp4_blocks import MXFP4_BLOCK
from haiku_mp.model.fp4_blocks import nvfp4
from haiku_mp.model.fp4_blocks import NVFP4_BLOCK
from haiku_mp.model.fp8 import DGRAD
from haiku_mp.model.fp8 import FPROP
from haiku_mp.model.fp8 import WGRAD
from haiku_mp.model.meta_params import FP4_SIGNS
from haiku_mp.model.precision_error import PrecisionError

FORMATS = ('nvfp4', 'mxfp4')

# A Linear's Hadamard signs (float32 [16], +-1): a param the optimizer never
# sees, kept in the state like fp8's amax histories
# (`meta_params.META_NAMES`); its "gradient" is itself, so the train step's
# overwrite keeps it.
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
    precision = haiku_mp.make_precision(
        BF16, model_class=hk.nets.MLP, low_bit=haiku_mp.LowBit(
            'Linear', haiku_mp.Fp4('nvfp4'),
            keep_fp8='*/linear_1'))  # linear_1 keeps fp8, the others 4 bits.
  """
  format: str = 'nvfp4'
  # Weights in 2-D tiles (16 x 16 for NVFP4, 32 x 32 for MXFP4): the forward
  # and the input gradient's GEMM see the same quantized weight.
  two_d_weights: bool = True
  # The weight gradient's GEMM inputs through a random 16 x 16 Hadamard
  # transform along the tokens, which spreads an outlier over its block.
  hadamard: bool = True
  # Output gradients rounded stochastically (unbiased, but for the values an
  # NVFP4 block whose E4M3 scale rounded down saturates at 6); the rest to
  # nearest.
  stochastic_gradients: bool = True

  def __post_init__(self):
    errors.check_choice('$format', self.format, FORMATS, PrecisionError)

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
  """Raises, naming `config`'s `$format` and the Linears' `$modules` (a
  `LowBit`'s), unless each of the three GEMMs' contracting
  dimensions is a whole number of blocks (and the tokens of Hadamard
  blocks): the blocks are never padded. `tokens` None: not known yet (an
  init traced at another batch size)."""
  needs = [('input features', inputs, config.block),
           ('output features (the input gradient\'s GEMM)', outputs,
            config.block)]
  if tokens is not None:
    needs.append(('tokens of a step on a device (the weight gradient\'s '
                  'GEMM)',
                  tokens, config.block))
  if config.hadamard and tokens is not None:
    needs.append(('tokens of a step on a device (the Hadamard transform)',
                  tokens,
                  NVFP4_BLOCK))
  for what, size, block in needs:
    if size % block:
      raise PrecisionError(
          f'$format={config.format}: {literal(path)}: {what}: {size}, not a '
          f'multiple of {block}; leave it out of $modules or pick sizes that '
          'blocks divide')


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
