"""fp8 matmuls: E4M3 operands forward, E5M2 gradients backward, float32 sums.

A `Linear` that a precision's `low_bit` selects computes `x @ w` as
`dot_general(q(x), q(w), preferred_element_type=float32) * s_x * s_w`,
rounded once to the compute dtype, where `q(t)` is `t / s_t` saturated to the
format's largest finite value and rounded to nearest even. Its backward pass
runs both matmuls on fp8 operands too: `dx = q5(g) @ q(w).T` and
`dw = q(x).T @ q5(g)` with the output gradient `g` in E5M2. That is the pattern
XLA:GPU's gemm rewriter turns into a cuBLASLt fp8 GEMM (fp8 operands straight
into the dot, scalar float32 scales, one contracting dimension), as flax's
`fp8_ops` writes it. XLA:CPU has no fp8 kernel: its FloatNormalization
converts f8 to f16 and runs a float32 dot, so on a CPU the same program is an
emulation, bit for bit in its rounding, and no faster.

Every scale is a power of two (`fp8_scales`, which says why); the two
scales' product is applied as one exact factor.

Scaling (`SCALINGS`), the divisor `s_t` of each tensor:

- ``current``: from the tensor's own amax in this step;
- ``delayed``: from the maximum of a history of the tensor's amaxes over the
  last `history_length` steps (TE's DelayedScaling, flax's `fp8_ops`). The
  histories are params of the module (`meta_params.META_NAMES`) that the
  optimizer never sees: the custom VJP returns each new history as that
  param's "gradient", and the train step writes it over the param (flax's
  "overwrite with gradient"). So histories live in the TrainState, are
  checkpointed with the params, and need no second Haiku state;
- ``mx``: MXFP8, one power-of-two (E8M0) scale per block of `MX_BLOCK` values
  along the contracting dimension, rounded up so that no block saturates.
  Every matmul re-blocks its operands along its own contracting dimension,
  so the backward pass quantizes from the forward's inputs, as MX hardware
  keeps row- and column-wise copies. `jax.nn.scaled_matmul` has no CPU
  lowering (jax 0.10.2) and an H100 has no MX GEMM, so the blocks are
  quantized and dequantized here and a float32 dot runs: MX is measured for
  its accuracy everywhere and for its speed nowhere yet.

`margin` (current and delayed; MX has none) leaves `2**margin` of headroom
under the largest finite value for amaxes that grow between steps.
"""

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.errors import literal
from haiku_mp.model.precision_error import PrecisionError
from haiku_mp.model.fp8_scales import amax
from haiku_mp.model.fp8_scales import E4M3
from haiku_mp.model.fp8_scales import E5M2
from haiku_mp.model.fp8_scales import exponent_of
from haiku_mp.model.fp8_scales import MX_BLOCK
from haiku_mp.model.fp8_scales import MX_MIN_EXPONENT
from haiku_mp.model.fp8_scales import mx_quantize
from haiku_mp.model.fp8_scales import quantize
from haiku_mp.model.fp8_scales import roll_history
from haiku_mp.model.fp8_scales import scale_from_amax
from haiku_mp.model.fp8_scales import times_exp2

SCALINGS = ('current', 'delayed', 'mx')
# What runs fp8 unless told otherwise (the :fp8 configs, the lab's fp8
# variants): the encoder blocks' Linear layers, as Transformer Engine and
# torchao leave the first and last layers in 16 bits.
DEFAULT_MODULES = '*/encoder_block_*'
# The compute the matmuls around fp8 ones run in.
COMPUTE_DTYPE = 'bfloat16'
# The lab's name of a variant: `fp8_` + its scaling ('fp8_current', ...).
VARIANT_PREFIX = 'fp8_'
# Named scopes of the three matmuls of an fp8 Linear: in the HLO's op names,
# they tell `launch.lab fp8` which matmul a GEMM is.
FPROP, DGRAD, WGRAD = 'fp8_fprop', 'fp8_dgrad', 'fp8_wgrad'


@dataclasses.dataclass(frozen=True)
class Fp8:
  """How fp8 matmuls scale their operands: a `LowBit`'s format.

  Example:
    precision = haiku_mp.make_precision(
        BF16, model_class=hk.nets.MLP, low_bit=haiku_mp.LowBit(
            [hk.Linear], haiku_mp.Fp8('delayed', history_length=16)))
  """
  scaling: str = 'current'
  history_length: int = 16  # delayed: amaxes kept per tensor.
  margin: float = 0.0  # Headroom: the scale leaves amax * 2**margin in range.

  def __post_init__(self):
    errors.check_choice('$scaling', self.scaling, SCALINGS, PrecisionError)
    length = self.history_length
    if not (isinstance(length, int) and not isinstance(length, bool)
            and length >= 1):
      raise PrecisionError(
          f'$history_length={literal(str(length))} must be an integer >= 1 '
          '(amaxes kept per tensor)')
    if not 0 <= self.margin < math.inf:
      raise PrecisionError(
          f'$margin={self.margin:g} must be a finite number '
          '>= 0 (a power of two of headroom)')

  def describe(self) -> str:
    """The scaling with the settings that apply to it (MX takes no margin)."""
    if self.scaling == 'delayed':
      return (f'delayed (history {self.history_length}, '
              f'margin {self.margin:g})')
    if self.scaling == 'mx':
      return f'mx (a power-of-two scale per {MX_BLOCK} values)'
    return f'current (margin {self.margin:g})'

  def emulation(self, backend: str) -> str:
    """How `backend` runs these matmuls where it makes no fp8 GEMM of them;
    '' where XLA may make one (a GPU: `launch.lab fp8` says per matmul)."""
    if self.scaling == 'mx':  # No backend here has an MX GEMM.
      return ('emulated: blocks quantized and dequantized, float32 dots')
    if backend == 'cpu':
      return 'emulated: XLA:CPU converts f8 to f16 and runs float32 dots'
    return ''


def scaled_dot(qa, qb, dims, a_scale, b_scale, scope):
  """The fp8 GEMM pattern: f8 operands into the dot, float32 result times the
  two scalar (power-of-two) scales' product, `times_exp2`'s one factor where
  it is a normal number, two where it is not (never flushed to zero). The
  dot's one user multiplies it by a broadcast scalar: the form XLA's gemm
  rewriter folds into the fp8 GEMM's scale (`F8ScaleD` in its source; not
  yet compiled on a GPU here); the second factor stays a multiply after
  it, 1 for amaxes not near float32's bottom."""
  with jax.named_scope(scope):
    out = jax.lax.dot_general(qa, qb, dims,
                              preferred_element_type=jnp.float32)
    return times_exp2(out, exponent_of(a_scale) + exponent_of(b_scale))


# Dimension numbers of the three matmuls of `x [n, k] @ w [k, o]`.
_FWD = (((1,), (0,)), ((), ()))  # x @ w
_DGRAD = (((1,), (1,)), ((), ()))  # g [n, o] @ w.T
_WGRAD = (((0,), (0,)), ((), ()))  # x.T @ g [n, o]
# The three by the passes' names (fprop: x, w; dgrad: g, w; wgrad: x, g),
# for `launch.lab gemm`, which times each as the Linear runs it.
DIMENSIONS = {'fprop': _FWD, 'dgrad': _DGRAD, 'wgrad': _WGRAD}


# ---- current and delayed scaling: one scale per tensor ----------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _current_matmul(margin: float, out_dtype, axis_name, x, w, x_scale,
                    w_scale):
  """`x @ w` on E4M3 operands with the given divisors, float32 sums rounded to
  `out_dtype`; the backward pass scales the output gradient by its own
  amax."""
  out, _ = _current_fwd(margin, out_dtype, axis_name, x, w, x_scale, w_scale)
  return out


def _current_fwd(margin, out_dtype, axis_name, x, w, x_scale, w_scale):
  del margin, axis_name
  qx, qw = quantize(x, E4M3, x_scale), quantize(w, E4M3, w_scale)
  out = scaled_dot(qx, qw, _FWD, x_scale, w_scale, FPROP).astype(out_dtype)
  # The backward keeps the fp8 operands: half the bytes of bfloat16 ones.
  return out, (qx, qw, x_scale, w_scale, _dtype_of(x), _dtype_of(w))


def _dtype_of(x):
  """An empty array of `x`'s dtype: residuals hold arrays, not dtypes."""
  return jnp.zeros((0,), x.dtype)


def _current_bwd(margin, out_dtype, axis_name, residuals, g):
  del out_dtype
  qx, qw, x_scale, w_scale, x_dtype, w_dtype = residuals
  g_scale = scale_from_amax(amax(g, axis_name), E5M2, margin)
  qg = quantize(g, E5M2, g_scale)
  dx = scaled_dot(qg, qw, _DGRAD, g_scale, w_scale, DGRAD)
  dw = scaled_dot(qx, qg, _WGRAD, x_scale, g_scale, WGRAD)
  # The scales are constants of the step: no gradient flows into them.
  return (dx.astype(x_dtype.dtype), dw.astype(w_dtype.dtype),
          jnp.zeros_like(x_scale), jnp.zeros_like(w_scale))


_current_matmul.defvjp(_current_fwd, _current_bwd)


def current_matmul(x: jax.Array, w: jax.Array, out_dtype,
                   margin: float = 0.0,
                   axis_name: Optional[str] = None) -> jax.Array:
  """`x [n, k] @ w [k, o]` in fp8, every tensor scaled by its own amax."""
  # Scales are constants of the step: no derivative flows through an amax
  # (nor could one through pmax, which has none).
  x_scale = scale_from_amax(amax(jax.lax.stop_gradient(x), axis_name), E4M3,
                            margin)
  w_scale = scale_from_amax(amax(jax.lax.stop_gradient(w)), E4M3, margin)
  return _current_matmul(margin, out_dtype, axis_name, x, w, x_scale,
                         w_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def delayed_matmul(margin: float, out_dtype, axis_name, x, w, x_history,
                   w_history, g_history):
  """`x @ w` in fp8 with delayed scaling: each tensor's divisor from the
  maximum of its amax history. The histories' cotangents are the histories
  rolled with this step's amaxes (see the module docstring)."""
  out, _ = _delayed_fwd(margin, out_dtype, axis_name, x, w, x_history,
                        w_history, g_history)
  return out


def _history_scale(history, dtype, margin):
  return scale_from_amax(jnp.max(history), dtype, margin)


def _delayed_fwd(margin, out_dtype, axis_name, x, w, x_history, w_history,
                 g_history):
  x_scale = _history_scale(x_history, E4M3, margin)
  w_scale = _history_scale(w_history, E4M3, margin)
  qx, qw = quantize(x, E4M3, x_scale), quantize(w, E4M3, w_scale)
  out = scaled_dot(qx, qw, _FWD, x_scale, w_scale, FPROP).astype(out_dtype)
  new_x = roll_history(x_history, amax(x, axis_name))
  new_w = roll_history(w_history, amax(w))
  return out, (qx, qw, x_scale, w_scale, new_x, new_w, g_history,
               _dtype_of(x), _dtype_of(w))


def _replicas(axis_name: Optional[str]) -> float:
  """How many replicas share the batch: under pmap each one's output
  gradient is that of its own share's mean loss, `_replicas` times the
  gradient of the whole batch's mean loss that one device sees."""
  return 1.0 if axis_name is None else float(jax.lax.psum(1, axis_name))


def _delayed_bwd(margin, out_dtype, axis_name, residuals, g):
  del out_dtype
  qx, qw, x_scale, w_scale, new_x, new_w, g_history, x_dtype, w_dtype = (
      residuals)
  x_dtype, w_dtype = x_dtype.dtype, w_dtype.dtype
  # The history holds amaxes of the whole batch's gradient, as on one
  # device, so that a checkpoint's histories are the same on any strategy;
  # a replica quantizes its gradient in those units too (exactly for a
  # power-of-two count), keeping the scale a power of two, and multiplies
  # the products back.
  replicas = _replicas(axis_name)
  g_scale = _history_scale(g_history, E5M2, margin)
  qg = quantize(g.astype(jnp.float32) / replicas if axis_name else g, E5M2,
                g_scale)
  dx = scaled_dot(qg, qw, _DGRAD, g_scale, w_scale, DGRAD)
  dw = scaled_dot(qx, qg, _WGRAD, x_scale, g_scale, WGRAD)
  if axis_name:
    dx, dw = dx * replicas, dw * replicas
  dx, dw = dx.astype(x_dtype), dw.astype(w_dtype)
  g_amax = amax(g, axis_name) / replicas
  return dx, dw, new_x, new_w, roll_history(g_history, g_amax)


delayed_matmul.defvjp(_delayed_fwd, _delayed_bwd)


# ---- MX: one power-of-two scale per block of 32 -----------------------------


def _mx_dot(a, a_axis, a_dtype, b, b_axis, b_dtype, dims, scope):
  """A 2-D dot of MX operands blocked along their contracting axes. Each
  row of `a` (column of `b`) is dequantized relative to its largest block
  exponent, the dot runs on those values (products of tiny blocks never
  underflow), and each output is scaled by its row's and column's power of
  two as `times_exp2` does; exactly as dequantizing first wherever no
  product underflows."""
  def relative(t, axis, dtype):
    q, exponents = mx_quantize(t, dtype, axis, MX_BLOCK)
    # Zero blocks (scale 1) set no row's exponent.
    largest = jnp.max(jnp.where(q == 0, MX_MIN_EXPONENT, exponents),
                      axis=axis, keepdims=True)
    return times_exp2(q, exponents - largest), largest.reshape(-1)

  qa, a_exponents = relative(a, a_axis, a_dtype)
  qb, b_exponents = relative(b, b_axis, b_dtype)
  with jax.named_scope(scope):
    out = jax.lax.dot_general(qa, qb, dims,
                              precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
    return times_exp2(out, a_exponents[:, None] + b_exponents[None, :])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def mx_matmul(out_dtype, x, w):
  """`x [n, k] @ w [k, o]` as MXFP8: E4M3 blocks along k forward; E5M2
  gradient blocks along each backward matmul's contracting dimension."""
  return _mx_dot(x, 1, E4M3, w, 0, E4M3, _FWD, FPROP).astype(out_dtype)


def _mx_fwd(out_dtype, x, w):
  return mx_matmul(out_dtype, x, w), (x, w)


def _mx_bwd(out_dtype, residuals, g):
  del out_dtype
  x, w = residuals
  dx = _mx_dot(g, 1, E5M2, w, 1, E4M3, _DGRAD, DGRAD).astype(x.dtype)
  dw = _mx_dot(x, 0, E4M3, g, 0, E5M2, _WGRAD, WGRAD).astype(w.dtype)
  return dx, dw


mx_matmul.defvjp(_mx_fwd, _mx_bwd)


def matmul(fp8: Fp8, x: jax.Array, w: jax.Array, out_dtype,
           histories: Optional[tuple[jax.Array, jax.Array, jax.Array]] = None,
           axis_name: Optional[str] = None) -> jax.Array:
  """`x [n, k] @ w [k, o]` in fp8 as `fp8` says, float32 sums rounded to
  `out_dtype`; `histories` (x, w, g): delayed scaling's amax histories;
  `axis_name`: the pmap axis whose replicas' amaxes are one tensor's."""
  if fp8.scaling == 'current':
    return current_matmul(x, w, out_dtype, fp8.margin, axis_name)
  if fp8.scaling == 'delayed':
    return delayed_matmul(fp8.margin, out_dtype, axis_name, x, w, *histories)
  return mx_matmul(out_dtype, x, w)
