"""Matmuls that really run in half precision: half operands, float32 sums.

`jnp.dot(bf16, bf16)` asks XLA for a bf16 result. XLA:CPU runs that as
convert -> float32 dot -> convert, and JAX's transpose of a dot with a float32
result hands the backward pass mixed float32 x half dots, which fall back to
float32 too. Written as `dot_general(half, half, preferred_element_type=f32)`
the same product goes to the backend's half-precision kernel (the CPU's bf16
instructions, a GPU's tensor cores) and accumulates in float32, rounded once to
the result dtype: the standard mixed-precision numerics on every backend.

`einsum` is that dot with a custom VJP whose two backward dots take the
cotangent in the operands' dtype and are written the same way. A model's
`matmuls.Matmuls` says which form it takes; the modules that run it are in
`matmul_modules`.

Which form a half dtype gets is decided in one place, `form_for`:

- ``native``: half x half -> float32, rounded once to the result dtype;
- ``upcast``: both operands converted to float32 first (what XLA does itself
  for a dtype the backend has no kernel for), rounded once;
- ``plain``: Haiku's and JAX's own ops, half x half -> half.

``auto`` takes the form measured fastest (`auto_form`). On a GPU or TPU that
is ``native``. On a CPU it depends on the CPU (`cpu_form`): XLA:CPU's bf16
kernel is fast with AMX-BF16 or AVX512-BF16 instructions and slower than a
float32 dot without them (it emulates bf16), and XLA:CPU has no float16
kernel at all, so bfloat16 is ``native`` only on a CPU with bf16 instructions
and float16 is always ``upcast``. The features are this host's
(`cpu_features`), also when a program is traced for 'cpu' on a host whose
backend is another (`Matmuls.platform`): the one CPU that can be read, and the
one that runs the program unless it is exported; a program meant for another
CPU names its form.
"""

import contextlib
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.model import cpu_features
from haiku_mp.model import recording
from haiku_mp.model.precision_error import PrecisionError

FORMS = ('auto', 'native', 'upcast', 'plain')
# Backends a program may be traced for (`Matmuls.platform`); '' is JAX's own.
PLATFORMS = ('', 'cpu', 'gpu', 'tpu')
# `auto` on a GPU or TPU: half operands on its matrix units, float32 sums.
_ACCELERATOR_AUTO = 'native'
# `auto` on a CPU, per half dtype: with bf16 instructions (any of
# `CPU_BF16_FEATURES`) and without (the fastest form measured on each kind
# of CPU: BENCHMARKS.md "Dot forms per CPU"). Where the CPU's features
# cannot be read, the first: the choice before they were read.
CPU_BF16_FEATURES = ('amx_bf16', 'avx512_bf16')
_CPU_WITH_BF16_AUTO = {'bfloat16': 'native', 'float16': 'upcast'}
_CPU_WITHOUT_BF16_AUTO = {'bfloat16': 'upcast', 'float16': 'upcast'}
# Backends whose half-precision matmul kernel takes a weight gradient only
# with its first operand transposed in memory (see `_einsum_bwd`): XLA:CPU's.
_TRANSPOSE_FOR_KERNEL = ('cpu',)


def check_form(form: str) -> str:
  errors.check_choice('$dot_form', form, FORMS, PrecisionError)
  return form


def check_platform(platform: str) -> str:
  errors.check_choice('$dot_platform', platform, PLATFORMS, PrecisionError)
  return platform


def cpu_form(dtype, features: Optional[frozenset[str]]) -> tuple[str, str]:
  """`auto`'s form for a dot with half `dtype` operands on a CPU with
  `features` (its /proc/cpuinfo flags; None: unknown), and why."""
  name = jnp.dtype(dtype).name
  if features is None:
    table = _CPU_WITH_BF16_AUTO
    why = 'cpu features unknown: the choice for a cpu with bf16 instructions'
  else:
    best = next((f for f in CPU_BF16_FEATURES if f in features), None)
    table = _CPU_WITH_BF16_AUTO if best else _CPU_WITHOUT_BF16_AUTO
    why = (f'cpu has {best}' if best else 'cpu has no bf16 instructions: '
           f'{cpu_features.describe(features)}')
  if name == 'float16':
    why = 'XLA:CPU has no float16 matmul kernel'
  return table.get(name, _ACCELERATOR_AUTO), why


def auto_form(dtype, platform: str) -> tuple[str, str]:
  """The form `auto` takes for a dot with `dtype` operands on `platform`
  (a CPU: this host's), and why, for the run's first lines."""
  if jnp.finfo(dtype).bits >= 32:
    return 'plain', "float32 operands: JAX's own dots"
  if platform == 'cpu':
    return cpu_form(dtype, cpu_features.host_features())
  return _ACCELERATOR_AUTO, f'{platform}: half operands, float32 sums'


def form_for(form: str, dtype, platform: str, batched: bool = False) -> str:
  """The form a dot with `dtype` operands runs in on `platform`; `batched`:
  the dot has batch dimensions (attention's einsums)."""
  if jnp.finfo(dtype).bits >= 32:
    return 'plain'  # Float32 (and float64) operands: JAX's own dot.
  if form == 'auto':
    form, _ = auto_form(dtype, platform)
  if form == 'native' and batched and platform == 'cpu':
    # XLA:CPU (jaxlib 0.10) runs half x half -> float32 only in the dots it
    # fuses into its matmul library; a batched one left outside fails at run
    # time ("Unsupported element type for DotThunk: BF16 x BF16 = F32").
    return 'upcast'
  return form


def matmuls_line(form: str, dtypes, platform: str,
                 setting: str = 'dot_form') -> str:
  """The console's `Matmuls:` line: the form the dots of each compute dtype
  in `dtypes` take on `platform` under `form`, and why (a form asked for
  named as `setting`)."""
  parts = []
  for name in dict.fromkeys(jnp.dtype(d).name for d in dtypes):
    chosen = form_for(form, name, platform)
    if form == 'auto' or jnp.finfo(name).bits >= 32:
      why = auto_form(name, platform)[1]
    else:
      why = f'{setting}={form!r}'
    batched = form_for(form, name, platform, batched=True)
    if batched != chosen:
      why += f'; batched dots {batched}'
    parts.append(f'{name} dots {chosen} ({why})')
  return 'Matmuls: ' + '; '.join(parts)


def _split_spec(spec: str) -> tuple[str, str, str]:
  """'ab,bc->ac' -> ('ab', 'bc', 'ac')."""
  lhs, out = spec.split('->')
  a, b = lhs.split(',')
  return a, b, out


def _is_batched(spec: str) -> bool:
  a, b, out = _split_spec(spec)
  return bool(set(a) & set(b) & set(out))


def einsum(spec: str, a: jax.Array, b: jax.Array, form: str,
           matmul_precision: Optional[str], backend: str,
           out_dtype=None) -> jax.Array:
  """`jnp.einsum(spec, a, b)` accumulated in float32 (at least), returned in
  `out_dtype` (default: the operands' dtype), in the form `form` takes for
  the operands' dtype on `backend` (`form_for`), under the
  `jax.default_matmul_precision` name `matmul_precision` (None: JAX's
  default) forward and backward."""
  dtype = jnp.result_type(a, b)
  form = form_for(form, dtype, backend, _is_batched(spec))
  recording.ran_here('float32' if jnp.finfo(dtype).bits >= 32 else form)
  if form == 'plain':
    if out_dtype is None:
      return jnp.einsum(spec, a, b)
    # A result dtype asked for (attention's float32 logits): accumulated
    # in it, the backward dots back in the operands' dtype.
    form = 'native'
  return _einsum(spec, form, matmul_precision, jnp.dtype(out_dtype or dtype),
                 backend, a, b)


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
