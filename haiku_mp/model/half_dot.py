"""Matmuls that really run in half precision: half operands, float32 sums.

`jnp.dot(bf16, bf16)` asks XLA for a bf16 result. XLA:CPU runs that as
convert -> float32 dot -> convert, and JAX's transpose of a dot with a float32
result hands the backward pass mixed float32 x half dots, which fall back to
float32 too. Written as `dot_general(half, half, preferred_element_type=f32)`
the same product goes to the backend's half-precision kernel (the CPU's bf16
instructions, a GPU's tensor cores) and accumulates in float32, rounded once to
the result dtype: the standard mixed-precision numerics on every backend.

`einsum` is that dot with a custom VJP whose two backward dots take the
cotangent in the operands' dtype and are written the same way. `Linear` and
`Conv2D` are Haiku's modules (same class names, param names, shapes and
initializers, so checkpoints, sharding rules and overrides keep working) whose
matmul is `einsum`, with the bias added to the float32 sums before the one
rounding, and whose output is tagged for `remat`'s ``dots``; `Conv2D` does so
for the patch embedding's stride = kernel convolution, a matmul over patches.
Float32 operands take Haiku's and JAX's own path, so a float32 policy's
program is what it was.

Which form a half dtype gets is decided in one place, `form_for`:

- ``native``: half x half -> float32, rounded once to the result dtype;
- ``upcast``: both operands converted to float32 first (what XLA does itself
  for a dtype the backend has no kernel for), rounded once;
- ``plain``: Haiku's and JAX's own ops, half x half -> half.
"""

import contextlib
import dataclasses
import fnmatch
import functools
import math
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp import errors
from haiku_mp.model import fp4 as fp4_lib
from haiku_mp.model import fp8 as fp8_lib
from haiku_mp.model import meta_params
from haiku_mp.model import remat

FORMS = ('auto', 'native', 'upcast', 'plain')
# Backends a program may be traced for (`Dots.platform`); '' is JAX's own.
PLATFORMS = ('', 'cpu', 'gpu', 'tpu')
# The measured fastest form per (backend, half dtype) for `auto`: see
# BENCHMARKS.md "Dot forms" for the numbers behind each entry.
_AUTO = {('cpu', 'bfloat16'): 'native', ('cpu', 'float16'): 'upcast'}
_DEFAULT_AUTO = 'native'  # GPUs: half operands, float32 accumulation.
# Backends whose half-precision matmul kernel takes a weight gradient only
# with its first operand transposed in memory (see `_einsum_bwd`): XLA:CPU's.
_TRANSPOSE_FOR_KERNEL = ('cpu',)


def check_form(form: str) -> str:
  errors.check_choice('precision.dot_form', form, FORMS)
  return form


def check_platform(platform: str) -> str:
  errors.check_choice('precision.dot_platform', platform, PLATFORMS)
  return platform


def form_for(form: str, dtype, platform: str, batched: bool = False) -> str:
  """The form a dot with `dtype` operands runs in on `platform`; `batched`:
  the dot has batch dimensions (attention's einsums)."""
  if jnp.finfo(dtype).bits >= 32:
    return 'plain'  # Float32 (and float64) operands: JAX's own dot.
  if form == 'auto':
    form = _AUTO.get((platform, jnp.dtype(dtype).name), _DEFAULT_AUTO)
  if form == 'native' and batched and platform == 'cpu':
    # XLA:CPU (jaxlib 0.10) runs half x half -> float32 only in the dots it
    # fuses into its matmul library; a batched one left outside fails at run
    # time ("Unsupported element type for DotThunk: BF16 x BF16 = F32").
    return 'upcast'
  return form


def _split_spec(spec: str) -> tuple[str, str, str]:
  """'ab,bc->ac' -> ('ab', 'bc', 'ac')."""
  lhs, out = spec.split('->')
  a, b = lhs.split(',')
  return a, b, out


def _is_batched(spec: str) -> bool:
  a, b, out = _split_spec(spec)
  return bool(set(a) & set(b) & set(out))


FP8_CLASS = 'Linear'  # The only module whose matmul runs in fp8.


def selects(targets: tuple[str, ...], class_name: str, path: str) -> bool:
  """Whether `targets` (class names or path globs) select a module: its class
  is one, or a glob matches its path or the path of a module around it."""
  if class_name in targets:
    return True
  parts = path.split('/')
  prefixes = ['/'.join(parts[:i]) for i in range(1, len(parts) + 1)]
  return any(fnmatch.fnmatchcase(p, t) for t in targets for p in prefixes)


@dataclasses.dataclass(frozen=True)
class Dots:
  """How a model's matmuls run: the form for half operands and the
  `jax.default_matmul_precision` name in force (None: JAX's default), which
  the backward pass, traced later and outside it, must use as well; and which
  `Linear` layers run fp8 matmuls (`fp8_targets`) with what scaling.
  A `Precision` makes them (`precision.dots`) for every Linear it applies to.

  Example:
    dots = haiku_mp.Dots('native')  # Half operands, float32 sums.
    y = dots.einsum('ni,io->no', x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
  """
  form: str = 'auto'
  matmul_precision: Optional[str] = None
  fp8: Optional[fp8_lib.Fp8] = None
  fp8_targets: tuple[str, ...] = ()
  # The pmap axis over which fp8 amaxes are reduced (`Precision.under_pmap`).
  fp8_axis: Optional[str] = None
  # The backend the forms are chosen for; '': the one JAX runs on.
  platform: str = ''
  # The fp8 targets' matmuls in 4 bits instead (`fp4.Fp4`); None: fp8.
  fp4: Optional[fp4_lib.Fp4] = None
  # Under `fp4`, the fp8 targets whose Linears keep fp8.
  fp8_kept: tuple[str, ...] = ()

  @property
  def backend(self) -> str:
    return self.platform or jax.default_backend()

  def runs_fp8(self, class_name: str, path: str) -> bool:
    """Whether the Linear runs low-bit matmuls: fp8, or 4 bits where
    `runs_fp4` says so."""
    return (self.fp8 is not None and class_name == FP8_CLASS
            and selects(self.fp8_targets, class_name, path))

  def runs_fp4(self, class_name: str, path: str) -> bool:
    """Whether the Linear's low-bit matmuls are 4-bit ones."""
    return (self.fp4 is not None and self.runs_fp8(class_name, path)
            and not selects(self.fp8_kept, class_name, path))

  def einsum(self, spec: str, a: jax.Array, b: jax.Array,
             out_dtype=None) -> jax.Array:
    """`jnp.einsum(spec, a, b)` accumulated in float32 (at least), returned in
    `out_dtype` (default: the operands' dtype)."""
    dtype = jnp.result_type(a, b)
    form = form_for(self.form, dtype, self.backend, _is_batched(spec))
    if form == 'plain':
      if out_dtype is None:
        return jnp.einsum(spec, a, b)
      # A result dtype asked for (attention's float32 logits): accumulated
      # in it, the backward dots back in the operands' dtype.
      form = 'native'
    return _einsum(spec, form, self.matmul_precision,
                   jnp.dtype(out_dtype or dtype), self.backend, a, b)


def _dot(spec, form, out_dtype, a, b):
  accumulate = jnp.promote_types(out_dtype, jnp.float32)
  if form == 'upcast':
    a, b = a.astype(accumulate), b.astype(accumulate)
  out = jnp.einsum(spec, a, b, preferred_element_type=accumulate)
  return out.astype(out_dtype)


def _precision(name):
  return (jax.default_matmul_precision(name) if name
          else contextlib.nullcontext())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _einsum(spec, form, matmul_precision, out_dtype, backend, a, b):
  del backend  # The backward pass's.
  with _precision(matmul_precision):
    return _dot(spec, form, out_dtype, a, b)


def _einsum_fwd(spec, form, matmul_precision, out_dtype, backend, a, b):
  return (_einsum(spec, form, matmul_precision, out_dtype, backend, a, b),
          (a, b))


def _einsum_bwd(spec, form, matmul_precision, out_dtype, backend, residuals,
                g):
  """Both operands' cotangents as dots of the cotangent (in the operands'
  dtype) with the other operand: for ``A,B->C``, ``C,B->A`` and ``C,A->B``
  (every index of A is in B or C, as in any matmul)."""
  del out_dtype
  a, b = residuals
  a_spec, b_spec, out = _split_spec(spec)
  g = g.astype(a.dtype)
  with _precision(matmul_precision):
    da = _dot(f'{out},{b_spec}->{a_spec}', form, a.dtype, g, b)
    if _weight_gradient_transposed(spec, form, backend):
      # A weight gradient `a.T @ g` contracts both operands' leading axis, a
      # layout XLA:CPU's half-precision matmul kernel does not take (it
      # converts such a dot to float32). The same dot with `a` transposed in
      # memory first runs on the kernel: ~3x faster for an fc1 at batch 128.
      m, k = a_spec
      db = _dot(f'{k}{m},{out}->{b_spec}', form, b.dtype,
                _transposed_in_memory(a), g)
    else:
      db = _dot(f'{out},{a_spec}->{b_spec}', form, b.dtype, g, a)
  return da, db


def _weight_gradient_transposed(spec: str, form: str, backend: str) -> bool:
  """Whether the backward pass of `spec` transposes its first operand in
  memory for the weight gradient: a native 2-D matmul ``mk,kn->mn`` on a
  backend whose half-precision kernel needs it (`_TRANSPOSE_FOR_KERNEL`)."""
  a, b, out = _split_spec(spec)
  is_matmul = (len(a) == len(b) == 2 and a[1] == b[0]
               and out == a[0] + b[1])
  return (form == 'native' and is_matmul
          and backend in _TRANSPOSE_FOR_KERNEL)


def _transposed_in_memory(a: jax.Array) -> jax.Array:
  """`a.T` (2-D) as a row-major array. A plain transpose is a layout change
  XLA folds into the dot; a transpose through a 3-D view of the leading axis
  has to be materialized. Falls back to `a.T` when that axis cannot be split."""
  rows, cols = a.shape
  # A split near sqrt(rows) transposes ~2x faster on XLA:CPU than a split
  # in two (BENCHMARKS.md).
  split = max((d for d in range(2, math.isqrt(rows) + 1) if rows % d == 0),
              default=None)
  if split is None:
    return a.T
  return a.reshape(split, rows // split, cols).transpose(2, 0, 1).reshape(
      cols, rows)


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


def _agreed(dots: Optional[Dots], in_force: Dots, module: hk.Module) -> Dots:
  """The dots a haiku_mp module runs: the precision's in force, which its own
  `dots=`, where given, must equal (a silently ignored setting is a bug)."""
  if dots is not None and dots != in_force:
    raise errors.ConfigError(
        f'{module.module_name}: dots={dots} contradicts the precision in force '
        f'({in_force}); leave dots= out to take the precision\'s')
  return in_force


def linear(module: hk.Linear, dots: Dots, plain: Callable[..., jax.Array],
           inputs: jax.Array, *, precision=None) -> jax.Array:
  """`module`'s call with its matmul as `dots` says: fp8 where its targets
  select it, half operands with float32 sums otherwise, and `plain` (Haiku's
  own call) for float32 operands or the ``plain`` form. Runs in the module's
  own scope: any `hk.Linear`, stock or not, keeps its params' names, shapes,
  dtypes and initializers."""
  fp8 = dots.runs_fp8(FP8_CLASS, module.module_name)
  if not fp8 and form_for(dots.form, inputs.dtype, dots.backend) == 'plain':
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
  if fp8 and dots.runs_fp4(FP8_CLASS, module.module_name):
    sums = fp4_lib.linear_sums(dots.fp4, module.module_name, x, w)
  elif fp8:
    sums = _fp8_sums(dots, x, w)
  else:
    sums = dots.einsum('ni,io->no', x, w, out_dtype=jnp.float32)
  b = (hk.get_parameter('b', [module.output_size], inputs.dtype,
                        init=module.b_init) if module.with_bias else None)
  out = _biased_and_rounded(sums, b, inputs.dtype)
  out = out.reshape(inputs.shape[:-1] + (module.output_size,))
  return remat.tag_matmul_output(out)


def _fp8_sums(dots: Dots, x: jax.Array, w: jax.Array) -> jax.Array:
  """`x @ w` in float32 from fp8 operands (`fp8.matmul`); delayed scaling
  keeps its amax histories as the calling module's params
  (`meta_params.META_NAMES`)."""
  config = dots.fp8
  histories = None
  if config.scaling == 'delayed':
    histories = tuple(
        hk.get_parameter(name, [config.history_length], jnp.float32,
                         init=jnp.zeros)
        for name in meta_params.HISTORY_NAMES)
  return fp8_lib.matmul(config, x, w, jnp.float32, histories, dots.fp8_axis)


class Linear(hk.Linear):
  """`hk.Linear` whose matmul is `Dots.einsum` (half operands, float32 sums).

  Inside `apply_precision` it takes the precision's dots (as a stock
  `hk.Linear` does there); `dots=` is for a call outside one, and inside one
  must agree with the precision's.

  Example:
    layer = haiku_mp.Linear(10)  # In a function under hk.transform.
    logits = layer(features)     # bf16 x bf16 -> f32 sums, rounded once.
  """

  def __init__(self, output_size: int, dots: Optional[Dots] = None,
               **kwargs):
    super().__init__(output_size, **kwargs)
    self.dots = dots

  def __call__(self, inputs: jax.Array, *, precision=None) -> jax.Array:
    return linear(self, Dots() if self.dots is None else self.dots,
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


def conv2d(module: hk.Conv2D, dots: Dots, plain: Callable[..., jax.Array],
           inputs: jax.Array, *, precision=None) -> jax.Array:
  """`module`'s call; as a patch embedding (`_is_patch_embedding`) with half
  operands, a `Dots.einsum` over the image's patches. Any other convolution
  is `plain`'s (Haiku's own): XLA's convolution takes the operands' dtype."""
  form = form_for(dots.form, inputs.dtype, dots.backend)
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
  sums = dots.einsum('np,pd->nd', patches,
                     w.reshape(ph * pw * channels, -1), out_dtype=jnp.float32)
  b = (hk.get_parameter('b', (module.output_channels,), inputs.dtype,
                        init=module.b_init) if module.with_bias else None)
  out = _biased_and_rounded(sums, b, inputs.dtype)
  out = out.reshape(batch, rows, cols, module.output_channels)
  return remat.tag_matmul_output(out)


class Conv2D(hk.Conv2D):
  """`hk.Conv2D`; as a patch embedding (stride = kernel, VALID, NHWC) its
  convolution is a `Dots.einsum` over the image's patches. Takes its dots as
  `Linear` does.

  Example:
    embed = haiku_mp.Conv2D(64, kernel_shape=4, stride=4, padding='VALID')
    tokens = embed(images)  # [b, h/4, w/4, 64]: one matmul over patches.
  """

  def __init__(self, output_channels: int, dots: Optional[Dots] = None,
               **kwargs):
    super().__init__(output_channels, **kwargs)
    self.dots = dots

  def __call__(self, inputs: jax.Array, *, precision=None) -> jax.Array:
    return conv2d(self, Dots() if self.dots is None else self.dots,
                  super().__call__, inputs, precision=precision)


def intercepted(dots: Dots, next_f: Callable[..., Any], args, kwargs,
                context: hk.MethodContext) -> Any:
  """A module method call inside `apply_precision`, its matmul as `dots`
  says: Haiku's own `hk.Linear` and `hk.Conv2D` calls (a stock module's, a
  subclass's `super().__call__`) and haiku_mp's; any other as it is."""
  module, defined_by = context.module, context.orig_class
  if context.method_name != '__call__':
    return next_f(*args, **kwargs)
  if defined_by is Linear or defined_by is Conv2D:
    run = linear if defined_by is Linear else conv2d
    haiku_call = (hk.Linear if defined_by is Linear else hk.Conv2D).__call__
    # Haiku's call, intercepted in turn as the plain form below.
    plain = functools.partial(haiku_call, module)
    return run(module, _agreed(module.dots, dots, module), plain, *args,
               **kwargs)
  if isinstance(module, (Linear, Conv2D)):
    return next_f(*args, **kwargs)  # The plain form of the branch above.
  if defined_by is hk.Linear:
    return linear(module, dots, next_f, *args, **kwargs)
  if defined_by is hk.ConvND and isinstance(module, hk.Conv2D):
    return conv2d(module, dots, next_f, *args, **kwargs)
  return next_f(*args, **kwargs)
