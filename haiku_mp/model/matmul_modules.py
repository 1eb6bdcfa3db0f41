"""Haiku's `Linear` and `Conv2D` with haiku_mp's matmuls (`matmuls.Matmuls`).

`Linear` and `Conv2D` are Haiku's modules (same class names, param names,
shapes and initializers, so checkpoints, sharding rules and overrides keep
working) whose matmul is `Matmuls.einsum` (half operands, float32 sums), fp8
(`fp8.matmul`) or 4 bits (`fp4.linear_sums`) where the precision selects
them, with the bias added to the float32 sums before the one rounding, and
whose output is tagged for `remat`'s ``dots``; `Conv2D` does so for the
patch embedding's stride = kernel convolution, a matmul over patches.
Float32 operands take Haiku's and JAX's own path, so a float32 policy's
program is what it was. `intercepted` gives stock `hk.Linear` and
`hk.Conv2D` calls the same matmuls under `apply_precision`.
"""

import functools
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp import errors
from haiku_mp.model.half_dot import form_for
from haiku_mp.model.low_bit import LOW_BIT_CLASS
from haiku_mp.model.matmuls import Matmuls
from haiku_mp.model import fp4 as fp4_lib
from haiku_mp.model import fp8 as fp8_lib
from haiku_mp.model import meta_params
from haiku_mp.model import recording
from haiku_mp.model import remat
from haiku_mp.model import stock_attention


def _agreed(matmuls: Optional[Matmuls], in_force: Matmuls,
            module: hk.Module) -> Matmuls:
  """The matmuls a haiku_mp module runs: the precision's in force, which its
  own `matmuls=`, where given, must equal (a silently ignored setting is a
  bug)."""
  if matmuls is not None and matmuls != in_force:
    raise errors.ConfigError(
        f'{module.module_name}: matmuls={matmuls} contradicts the precision in '
        f'force ({in_force}); leave matmuls= out to take the precision\'s')
  return in_force


def linear(module: hk.Linear, matmuls: Matmuls, plain: Callable[..., jax.Array],
           inputs: jax.Array, *, precision=None) -> jax.Array:
  """`module`'s call with its matmul as `matmuls` says: low-bit (fp8 or 4
  bits) where its targets select it, half operands with float32 sums
  otherwise, and `plain` (Haiku's
  own call) for float32 operands or the ``plain`` form. Runs in the module's
  own scope: any `hk.Linear`, stock or not, keeps its params' names, shapes,
  dtypes and initializers."""
  low_bit = matmuls.runs_low_bit(LOW_BIT_CLASS, module.module_name)
  if not low_bit and form_for(matmuls.form, inputs.dtype,
                              matmuls.backend) == 'plain':
    recording.ran(module.module_name, 'float32' if jnp.finfo(
        inputs.dtype).bits >= 32 else 'plain')
    return remat.tag_matmul_output(plain(inputs, precision=precision))
  if not inputs.shape:
    raise ValueError('Input must not be scalar.')  # hk.Linear's own check.
  input_size = module.input_size = inputs.shape[-1]
  # The params exactly as hk.Linear creates them (name, shape, initializer).
  w_init = module.w_init or hk.initializers.TruncatedNormal(
      1.0 / np.sqrt(input_size))
  w = hk.get_parameter('w', [input_size, module.output_size], inputs.dtype,
                       init=w_init)
  x = inputs.reshape(-1, input_size)
  if low_bit and matmuls.runs_fp4(LOW_BIT_CLASS, module.module_name):
    fp4 = matmuls.low_bit.fp4
    recording.ran(module.module_name, fp4.format)
    sums = fp4_lib.linear_sums(fp4, module.module_name, x, w)
  elif low_bit:
    recording.ran(module.module_name, 'fp8')
    sums = _fp8_sums(matmuls, x, w)
  else:
    sums = matmuls.einsum('ni,io->no', x, w, out_dtype=jnp.float32)
  b = (hk.get_parameter('b', [module.output_size], inputs.dtype,
                        init=module.b_init) if module.with_bias else None)
  out = _biased_and_rounded(sums, b, inputs.dtype)
  out = out.reshape(inputs.shape[:-1] + (module.output_size,))
  return remat.tag_matmul_output(out)


def _fp8_sums(matmuls: Matmuls, x: jax.Array, w: jax.Array) -> jax.Array:
  """`x @ w` in float32 from fp8 operands (`fp8.matmul`); delayed scaling
  keeps its amax histories as the calling module's params
  (`meta_params.META_NAMES`)."""
  config = matmuls.low_bit.fp8
  histories = None
  if config.scaling == 'delayed':
    histories = tuple(
        hk.get_parameter(name, [config.history_length], jnp.float32,
                         init=jnp.zeros)
        for name in meta_params.HISTORY_NAMES)
  return fp8_lib.matmul(config, x, w, jnp.float32, histories,
                        matmuls.amax_axis)


class Linear(hk.Linear):
  """`hk.Linear` whose matmul is `Matmuls.einsum` (half operands, float32 sums).

  Inside `apply_precision` it takes the precision's matmuls (as a stock
  `hk.Linear` does there); `matmuls=` is for a call outside one, and inside one
  must agree with the precision's.

  Example:
    layer = haiku_mp.Linear(10)  # In a function under hk.transform.
    logits = layer(features)     # bf16 x bf16 -> f32 sums, rounded once.
  """

  def __init__(self, output_size: int, matmuls: Optional[Matmuls] = None,
               **kwargs):
    super().__init__(output_size, **kwargs)
    self.matmuls = matmuls

  def __call__(self, inputs: jax.Array, *, precision=None) -> jax.Array:
    return linear(self, Matmuls() if self.matmuls is None else self.matmuls,
                  super().__call__, inputs, precision=precision)


def _biased_and_rounded(sums: jax.Array, b: Optional[jax.Array],
                        dtype) -> jax.Array:
  """`sums + b` in float32, rounded once to `dtype`: a GPU matmul's bias
  epilogue. Its gradient is a float32 sum of the float32 cotangent; a half
  bias added after rounding has a half sum instead, which XLA:CPU runs as a
  slow windowed tree reduction (fc1 at batch 128: 48 ms, BENCHMARKS.md)."""
  if b is not None:
    sums = sums + b.astype(sums.dtype)
  return sums.astype(dtype)


def _is_patch_embedding(module: hk.Conv2D) -> bool:
  """Whether `module` convolves non-overlapping patches (stride = kernel,
  VALID, NHWC, no groups, dilation or mask): a matmul over patches."""
  return (tuple(module.stride) == tuple(module.kernel_shape)
          and module.padding == 'VALID' and module.data_format == 'NHWC'
          and module.feature_group_count == 1
          and tuple(module.kernel_dilation) == (1, 1) and module.mask is None)


def conv2d(module: hk.Conv2D, matmuls: Matmuls, plain: Callable[..., jax.Array],
           inputs: jax.Array, *, precision=None) -> jax.Array:
  """`module`'s call; as a patch embedding (`_is_patch_embedding`) with half
  operands, a `Matmuls.einsum` over the image's patches. Any other convolution
  is `plain`'s (Haiku's own): XLA's convolution takes the operands' dtype."""
  form = form_for(matmuls.form, inputs.dtype, matmuls.backend)
  ph, pw = module.kernel_shape
  if (form == 'plain' or not _is_patch_embedding(module) or inputs.ndim != 4
      or inputs.shape[1] % ph or inputs.shape[2] % pw):
    return remat.tag_matmul_output(plain(inputs, precision=precision))
  batch, height, width, channels = inputs.shape
  w_shape = (ph, pw, channels, module.output_channels)
  # The params exactly as hk.Conv2D creates them.
  w_init = module.w_init or hk.initializers.TruncatedNormal(
      1.0 / np.sqrt(ph * pw * channels))
  w = hk.get_parameter('w', w_shape, inputs.dtype, init=w_init)
  rows, cols = height // ph, width // pw
  patches = inputs.reshape(batch, rows, ph, cols, pw, channels)
  patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(-1, ph * pw * channels)
  sums = matmuls.einsum('np,pd->nd', patches,
                     w.reshape(ph * pw * channels, -1), out_dtype=jnp.float32)
  b = (hk.get_parameter('b', (module.output_channels,), inputs.dtype,
                        init=module.b_init) if module.with_bias else None)
  out = _biased_and_rounded(sums, b, inputs.dtype)
  out = out.reshape(batch, rows, cols, module.output_channels)
  return remat.tag_matmul_output(out)


class Conv2D(hk.Conv2D):
  """`hk.Conv2D`; as a patch embedding (stride = kernel, VALID, NHWC) its
  convolution is a `Matmuls.einsum` over the image's patches. Takes its matmuls as
  `Linear` does.

  Example:
    embed = haiku_mp.Conv2D(64, kernel_shape=4, stride=4, padding='VALID')
    tokens = embed(images)  # [b, h/4, w/4, 64]: one matmul over patches.
  """

  def __init__(self, output_channels: int, matmuls: Optional[Matmuls] = None,
               **kwargs):
    super().__init__(output_channels, **kwargs)
    self.matmuls = matmuls

  def __call__(self, inputs: jax.Array, *, precision=None) -> jax.Array:
    return conv2d(self, Matmuls() if self.matmuls is None else self.matmuls,
                  super().__call__, inputs, precision=precision)


def intercepted(matmuls: Matmuls, next_f: Callable[..., Any], args, kwargs,
                context: hk.MethodContext) -> Any:
  """A module method call inside `apply_precision`, its matmul as `matmuls`
  says: Haiku's own `hk.Linear` and `hk.Conv2D` calls (a stock module's, a
  subclass's `super().__call__`) and haiku_mp's; Haiku's
  `hk.MultiHeadAttention` with float32 logits and softmax
  (`stock_attention`); any other as it is."""
  module, defined_by = context.module, context.orig_class
  if context.method_name != '__call__':
    return next_f(*args, **kwargs)
  if defined_by is Linear or defined_by is Conv2D:
    run = linear if defined_by is Linear else conv2d
    haiku_call = (hk.Linear if defined_by is Linear else hk.Conv2D).__call__
    # Haiku's call, intercepted in turn as the plain form below.
    plain = functools.partial(haiku_call, module)
    return run(module, _agreed(module.matmuls, matmuls, module), plain, *args,
               **kwargs)
  if isinstance(module, (Linear, Conv2D)):
    return next_f(*args, **kwargs)  # The plain form of the branch above.
  if defined_by is hk.Linear:
    return linear(module, matmuls, next_f, *args, **kwargs)
  if defined_by is hk.ConvND and isinstance(module, hk.Conv2D):
    return conv2d(module, matmuls, next_f, *args, **kwargs)
  if defined_by is hk.MultiHeadAttention:
    return stock_attention.multi_head_attention(module, matmuls, next_f, *args,
                                                **kwargs)
  return next_f(*args, **kwargs)
