"""A GEMM's time on a GPU, on paper, and what a low-bit Linear adds to it.

A GEMM of `batch` x (M x K @ K x N) takes the longer of its FLOPs at the
format's peak and its bytes at the memory bandwidth, each at the share
`gpus.Assumptions` gives, plus one kernel's cost. Its FLOPs run in waves of
output tiles over the SMs: a GEMM of 195 tiles on 132 SMs takes two waves,
the second half empty, so its FLOPs count at 74% of the rate; one of fewer
tiles than SMs splits K over the rest (`_tiling`).

A Linear `y = x @ w` (x: M x K, w: K x N) runs three GEMMs (`PASSES`):
``fprop`` (x @ w), ``dgrad`` (g @ w.T, the input's gradient) and
``wgrad`` (x.T @ g, the weight's). In a low-bit format each also pays for
what the format adds around it, as this project's matmuls run them
(haiku_mp/model/fp8.py, fp4.py) and XLA:GPU's fp8 GEMM requires (both
operands with their contracting dimension minor):

- ``fp8_current``: per tensor (x, w, g) an amax (a read, and a second tiny
  kernel that turns it into the power-of-two scale), a cast (a read in the
  compute dtype, a write in fp8), and a transpose of the fp8 copy for the
  GEMM that contracts it along its other axis (qw for fprop, qx and qg for
  wgrad);
- ``fp8_delayed``: the same without the amax's read: the scale comes from
  the history and the cast's kernel takes this step's amax on its way
  (one tiny kernel still rolls the history);
- ``mxfp8``: a quantization along each contracting axis a tensor meets
  (two per tensor: a read, a write of E4M3 and one E8M0 scale per 32),
  no amax, no transpose;
- ``nvfp4``: per tensor an amax (NVFP4's second-level scale) and the
  recipe's quantizations: x along K and, Hadamard-transformed, along M; w
  once in 16 x 16 tiles and a transposed copy; g along N and,
  transformed and stochastically rounded, along M (E2M1 and an E4M3 scale
  per 16: 9/16 of a byte a value);
- ``mxfp4``: as nvfp4 without the amaxes, E8M0 scales per 32.

A low-bit GEMM reads its operands in their bits and writes the compute
dtype (XLA folds the scales and the cast into the fp8 GEMM); its scales
are folded in. What this leaves out, and how each figure was checked, is in
docs/speed.md.
"""

import math
from typing import Mapping, NamedTuple, Optional

from haiku_mp.advisor import gpus

PASSES = ('fprop', 'dgrad', 'wgrad')
BASELINE = 'bf16'
# Low-bit formats of a Linear, and the tensor-core format each GEMM runs.
LOW_BIT_FORMATS = {'fp8_current': 'fp8', 'fp8_delayed': 'fp8',
                   'mxfp8': 'mxfp8', 'nvfp4': 'nvfp4', 'mxfp4': 'mxfp4'}
FORMATS = (BASELINE,) + tuple(LOW_BIT_FORMATS)
# Bytes a value takes in each low-bit format, its block scales included.
_OPERAND_BYTES = {'fp8_current': 1.0, 'fp8_delayed': 1.0,
                  'mxfp8': 1 + 1 / 32, 'nvfp4': 0.5 + 1 / 16,
                  'mxfp4': 0.5 + 1 / 32}


class Gemm(NamedTuple):
  """One GEMM's predicted seconds and what bounds it."""
  seconds: float
  flops: float
  bytes: float
  bound: str  # 'compute', 'memory' or 'overhead'.


def _tiling(m: int, k: int, n: int, batch: int, gpu: gpus.Gpu,
            assumptions: gpus.Assumptions) -> tuple[float, int]:
  """(the share of the SMs' time a GEMM's tiles keep busy, its K splits).

  Output tiles run in waves over the SMs. A GEMM whose tiles fill under a
  quarter of the SMs splits K over the idle ones (split-K, as cuBLAS does
  for a weight gradient's few tiles and long K), each split at least four
  K tiles long; one that fills more runs its one wave as it is (the
  seeds' `jnp.dot` of 64 tiles on an H100's 132 SMs ran at 38% of the
  bf16 peak). A tile's padding past M or N does no work."""
  tile = assumptions.tile
  rows, cols = math.ceil(m / tile), math.ceil(n / tile)
  tiles = batch * rows * cols
  splits = 1
  if 4 * tiles <= gpu.sms:
    splits = max(1, min(gpu.sms // tiles, k // (4 * tile)))
  units = tiles * splits
  waves = math.ceil(units / gpu.sms)
  fill = (m / (rows * tile)) * (n / (cols * tile))
  return units / (waves * gpu.sms) * fill, splits


def wave_efficiency(m: int, k: int, n: int, batch: int, gpu: gpus.Gpu,
                    assumptions: gpus.Assumptions) -> float:
  """The share of the SMs' time a GEMM's output tiles keep busy."""
  return _tiling(m, k, n, batch, gpu, assumptions)[0]


def gemm(m: int, k: int, n: int, matmul_format: str, gpu: gpus.Gpu,
         assumptions: gpus.Assumptions, operand_bytes: float,
         output_bytes: float, batch: int = 1) -> Gemm:
  """`batch` x (M x K @ K x N) on `gpu`'s `matmul_format` tensor cores
  (`gpus.MATMUL_FORMATS`), its operands `operand_bytes` a value and its
  output `output_bytes`."""
  flops = 2.0 * batch * m * k * n
  busy, splits = _tiling(m, k, n, batch, gpu, assumptions)
  rate = gpu.peaks[matmul_format] * assumptions.gemm_efficiency * busy
  moved = batch * ((m * k + k * n) * operand_bytes + m * n * output_bytes)
  if splits > 1:  # Each split's float32 partial sums, written and read.
    moved += 2 * splits * batch * m * n * 4
  compute = flops / rate
  memory = moved / (gpu.memory_bandwidth * assumptions.memory_efficiency)
  work = max(compute, memory)
  bound = 'compute' if compute >= memory else 'memory'
  if assumptions.kernel_seconds > work:
    bound = 'overhead'
  return Gemm(work + assumptions.kernel_seconds, flops, moved, bound)


def streamed(nbytes: float, kernels: int, gpu: gpus.Gpu,
             assumptions: gpus.Assumptions) -> float:
  """Seconds of `kernels` kernels that move `nbytes` between them: the bytes
  at the achieved bandwidth, plus each kernel's cost."""
  return (nbytes / (gpu.memory_bandwidth * assumptions.memory_efficiency) +
          kernels * assumptions.kernel_seconds)


class Adds(NamedTuple):
  """What a low-bit format adds to one GEMM of a Linear: bytes moved and
  kernels run by its casts, amaxes, transposes and scale arithmetic."""
  bytes: float
  kernels: int


class Cast(NamedTuple):
  """How an fp8 recipe makes one tensor's fp8 copies: a separate amax pass
  or none, the cast kernels (each reads the tensor in the compute dtype),
  the fp8 copies they write (a second in the other layout, for the GEMM
  that contracts the tensor along its other axis), separate transposes of
  an fp8 copy, and tiny kernels of scale arithmetic."""
  amax_pass: int
  casts: int
  copies: int
  transposes: int
  scale_kernels: int


# Per fp8 scaling and recipe, each tensor's casts (x, w, g). 'haiku_mp' is
# this project's path (module docstring); the others are modeled only to
# hold the model to their published figures: torchao's tensorwise recipe
# as its roofline counts it (the input's and gradient's two layouts from one
# kernel, the weight's from two), Transformer Engine's fused cast-transpose
# (its delayed scaling updates every amax history in one kernel a step,
# left out here).
RECIPES = ('haiku_mp', 'torchao', 'transformer_engine')
_CASTS = {
    ('fp8_current', 'haiku_mp'): dict.fromkeys('xwg', Cast(1, 1, 1, 1, 1)),
    ('fp8_delayed', 'haiku_mp'): dict.fromkeys('xwg', Cast(0, 1, 1, 1, 1)),
    ('fp8_current', 'torchao'): dict(x=Cast(1, 1, 2, 0, 1),
                                     w=Cast(1, 2, 2, 0, 1),
                                     g=Cast(1, 1, 2, 0, 1)),
    ('fp8_delayed', 'torchao'): dict(x=Cast(0, 1, 2, 0, 1),
                                     w=Cast(0, 2, 2, 0, 1),
                                     g=Cast(0, 1, 2, 0, 1)),
    ('fp8_current', 'transformer_engine'): dict.fromkeys(
        'xwg', Cast(1, 1, 2, 0, 1)),
    ('fp8_delayed', 'transformer_engine'): dict.fromkeys(
        'xwg', Cast(0, 1, 2, 0, 0)),
}
# The GEMM that first needs each tensor (its casts are counted there), and
# the one a transposed copy is for.
_FIRST_USE = dict(x='fprop', w='fprop', g='dgrad')
_TRANSPOSED_FOR = dict(x='wgrad', w='fprop', g='wgrad')


def _fp8_adds(fmt: str, pass_: str, sizes: Mapping[str, float], c: float,
              recipe: str) -> Adds:
  total, kernels = 0.0, 0
  for tensor, cast in _CASTS[fmt, recipe].items():
    size = sizes[tensor]
    if _FIRST_USE[tensor] == pass_:
      total += size * ((cast.amax_pass + cast.casts) * c + cast.copies)
      kernels += cast.amax_pass + cast.casts + cast.scale_kernels
    if _TRANSPOSED_FOR[tensor] == pass_ and cast.transposes:
      total += cast.transposes * 2 * size
      kernels += cast.transposes
  return Adds(total, kernels)


def _block_adds(fmt: str, pass_: str, sizes: Mapping[str, float],
                c: float) -> Adds:
  """MX and 4-bit formats: a quantization along each contracting axis a
  tensor meets (module docstring); NVFP4's amaxes with the first."""
  q = _OPERAND_BYTES[fmt]
  x, w, g = sizes['x'], sizes['w'], sizes['g']
  def quantize(size):
    return Adds(size * (c + q), 1)
  def amax(size):
    return Adds(size * c, 2) if fmt == 'nvfp4' else Adds(0, 0)
  if fmt == 'mxfp8':
    parts = {'fprop': [quantize(x), quantize(w)],
             'dgrad': [quantize(g), quantize(w)],
             'wgrad': [quantize(x), quantize(g)]}[pass_]
  else:  # 4 bits: w once in 2-D tiles, and a transposed copy for dgrad.
    parts = {'fprop': [amax(x), quantize(x), amax(w), quantize(w)],
             'dgrad': [amax(g), quantize(g), Adds(2 * w * q, 1)],
             'wgrad': [quantize(x), quantize(g)]}[pass_]
  return Adds(sum(p.bytes for p in parts), sum(p.kernels for p in parts))


def adds(fmt: str, pass_: str, m: int, k: int, n: int,
         compute_bytes: float = 2.0, recipe: str = 'haiku_mp') -> Adds:
  """What low-bit `fmt` adds to `pass_` of a Linear of M tokens, K inputs
  and N outputs (module docstring): each tensor's costs go to the GEMM that
  first needs it (x and w to fprop, g to dgrad), a copy for one GEMM alone
  to that GEMM. `recipe`: whose fp8 casts (`RECIPES`)."""
  sizes = dict(x=m * k, w=k * n, g=m * n)
  if fmt in ('fp8_current', 'fp8_delayed'):
    return _fp8_adds(fmt, pass_, sizes, compute_bytes, recipe)
  return _block_adds(fmt, pass_, sizes, compute_bytes)


def linear_gemm(pass_: str, m: int, k: int, n: int) -> tuple[int, int, int]:
  """(M, K, N) of `pass_`'s GEMM for a Linear of M tokens, K inputs, N
  outputs."""
  return {'fprop': (m, k, n), 'dgrad': (m, n, k), 'wgrad': (k, m, n)}[pass_]


def linear_pass_seconds(pass_: str, m: int, k: int, n: int, fmt: str,
                        gpu: gpus.Gpu, assumptions: gpus.Assumptions,
                        compute_bytes: float = 2.0,
                        recipe: str = 'haiku_mp') -> Optional[float]:
  """Seconds of one pass of a Linear in `fmt` (`FORMATS`), what the format
  adds included; None where `gpu` has no tensor cores for it."""
  gm, gk, gn = linear_gemm(pass_, m, k, n)
  if fmt == BASELINE:
    return gemm(gm, gk, gn, 'bf16', gpu, assumptions, compute_bytes,
                compute_bytes).seconds
  tensor_cores = LOW_BIT_FORMATS[fmt]
  if not gpu.has(tensor_cores):
    return None
  core = gemm(gm, gk, gn, tensor_cores, gpu, assumptions,
              _OPERAND_BYTES[fmt], compute_bytes)
  added = adds(fmt, pass_, m, k, n, compute_bytes, recipe)
  return core.seconds + streamed(added.bytes, added.kernels, gpu,
                                 assumptions)


def linear_seconds(m: int, k: int, n: int, gpu: gpus.Gpu,
                   assumptions: gpus.Assumptions = gpus.Assumptions(),
                   compute_bytes: float = 2.0, recipe: str = 'haiku_mp'
                   ) -> dict[str, dict[str, Optional[float]]]:
  """{pass: {format: seconds}} of a Linear (M tokens, K in, N out) on `gpu`,
  every format of `FORMATS` (None where `gpu` has no tensor cores for it);
  `recipe`: whose fp8 casts (`RECIPES`).

  Example:
    seconds = advisor.linear_seconds(8320, 384, 1536, advisor.gpu('h100'))
    seconds['wgrad']['fp8_current']  # With its casts, on paper.
  """
  return {p: {f: linear_pass_seconds(p, m, k, n, f, gpu, assumptions,
                                     compute_bytes, recipe)
              for f in FORMATS} for p in PASSES}


def formats_on(gpu: gpus.Gpu) -> tuple[str, ...]:
  """The formats of `FORMATS` that `gpu` has tensor cores for."""
  return tuple(f for f in FORMATS
               if f == BASELINE or gpu.has(LOW_BIT_FORMATS[f]))


def gain(m: int, k: int, n: int, fmt: str, gpu: gpus.Gpu,
         assumptions: gpus.Assumptions = gpus.Assumptions(),
         compute_bytes: float = 2.0, recipe: str = 'haiku_mp'
         ) -> Optional[float]:
  """A Linear's three GEMMs in bf16 over the same in `fmt`: above 1, the
  format pays; None where `gpu` has no tensor cores for `fmt`.

  Example:
    h100 = advisor.gpu('h100')
    advisor.low_bit_gain(65536, 4096, 16384, 'fp8_delayed', h100)  # > 1.
  """
  seconds = linear_seconds(m, k, n, gpu, assumptions, compute_bytes,
                           recipe=recipe)
  low = [seconds[p][fmt] for p in PASSES]
  if any(s is None for s in low):
    return None
  return sum(seconds[p][BASELINE] for p in PASSES) / sum(low)
