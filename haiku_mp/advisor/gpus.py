"""The GPUs the speed model knows, as their datasheets give them, and the
share of those peaks a training step's kernels reach (`Assumptions`: one set
for every GPU, never fitted per case).

Peaks are dense (no 2:4 sparsity) and per GPU, in FLOP/s per matmul format:

- ``float32``: CUDA cores, what `matmul_precision='highest'` runs;
- ``tf32``: tensor cores on float32 operands, what JAX's default matmul
  precision runs on these GPUs (an H100's `jnp.dot` in float32 ran at 234
  TFLOP/s, beyond its 67 of true float32: docs/benchmarks/gpu.md);
- ``bf16``: bfloat16 and float16 tensor cores;
- ``fp8``: E4M3 / E5M2 with one scale per tensor (Hopper's and Blackwell's);
- ``mxfp8``, ``nvfp4``, ``mxfp4``: block-scaled tensor cores (Blackwell's).

A GPU without a format's tensor cores has no entry for it: the model then
predicts nothing for that format there, as an A100 runs no fp8.
"""

import dataclasses
from typing import Mapping

from haiku_mp import errors

MATMUL_FORMATS = ('float32', 'tf32', 'bf16', 'fp8', 'mxfp8', 'nvfp4', 'mxfp4')


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU: its SMs, dense peaks per matmul format and memory bandwidth."""
  name: str
  about: str  # The part, and where its figures come from.
  sms: int
  peaks: Mapping[str, float]  # FLOP/s, dense, keyed by MATMUL_FORMATS.
  memory_bandwidth: float  # Bytes/s, the datasheet's.

  def has(self, matmul_format: str) -> bool:
    return matmul_format in self.peaks


@dataclasses.dataclass(frozen=True)
class Assumptions:
  """What the model assumes a step's kernels reach, for every GPU.

  Each value's source is beside it; `launch.lab speed --json` prints them
  with every prediction, and docs/speed.md holds the model to every GPU
  figure measured with them unchanged.

  Example:
    slower_kernels = advisor.Assumptions(kernel_seconds=4e-6)
    advisor.linear_seconds(8320, 384, 1536, advisor.gpu('h100'), slower_kernels)
  """
  # Of a format's peak, on a GEMM that fills the GPU: torchao's
  # `pct_achievable_gemm_tops` ("based on experimental observation with
  # sample large inputs", H100), and an H100's bf16 `jnp.dot` at 1024 x
  # 65536 here: 377 of 989 TFLOP/s at a K of 1024 (38%), 78% at large K in
  # XLA's own GEMM tables.
  gemm_efficiency: float = 0.78
  # Of the datasheet's memory bandwidth, on a kernel that streams a large
  # tensor: torchao's `pct_achievable_mem_bw` (pointwise Triton kernels on
  # an H100).
  memory_efficiency: float = 0.92
  # Seconds each kernel costs beyond its work: the GPU's gap between two
  # kernels of a stream and a kernel's ramp. torchao measures 2 us for a
  # kernel that reads and writes one element on an H100.
  kernel_seconds: float = 2e-6
  # A GEMM's output tile per SM, for the waves over the SMs: 128 x 128, the
  # tile CUTLASS and cuBLAS start from on Hopper; a GEMM of fewer tiles than
  # SMs leaves the rest idle, one of one and a bit waves idles most of the
  # second.
  tile: int = 128


# NVIDIA's datasheets, dense figures (the sparse ones halved).
GPUS = {
    'a100': Gpu(
        'a100', 'NVIDIA A100 SXM 80GB (datasheet): 108 SMs, 19.5 TFLOP/s '
        'float32, 156 tf32, 312 bf16, no fp8; HBM2e 2.04 TB/s', 108,
        dict(float32=19.5e12, tf32=156e12, bf16=312e12), 2.039e12),
    'h100': Gpu(
        'h100', 'NVIDIA H100 SXM5 80GB (datasheet): 132 SMs, 67 TFLOP/s '
        'float32, 495 tf32, 989 bf16, 1,979 fp8; HBM3 3.35 TB/s', 132,
        dict(float32=67e12, tf32=494.7e12, bf16=989.4e12, fp8=1978.9e12),
        3.35e12),
    'h200': Gpu(
        'h200', 'NVIDIA H200 SXM 141GB (datasheet): the H100\'s 132 SMs and '
        'peaks; HBM3e 4.8 TB/s', 132,
        dict(float32=67e12, tf32=494.7e12, bf16=989.4e12, fp8=1978.9e12),
        4.8e12),
    'b200': Gpu(
        'b200', 'NVIDIA B200 (HGX B200 datasheet, per GPU; Blackwell '
        'architecture brief): 148 SMs, 75 TFLOP/s float32, 1,100 tf32, 2,250 '
        'bf16, 4,500 fp8 and mxfp8, 9,000 nvfp4 and mxfp4; HBM3e 8 TB/s', 148,
        dict(float32=75e12, tf32=1.1e15, bf16=2.25e15, fp8=4.5e15,
             mxfp8=4.5e15, nvfp4=9e15, mxfp4=9e15), 8e12),
}
NAMES = tuple(GPUS)


def gpu(name: str) -> Gpu:
  """The GPU called `name` (one of `NAMES`); a ConfigError naming `name`.

  Example:
    h200 = advisor.gpu('h200')
    h200.memory_bandwidth, h200.peaks['fp8']  # 4.8e12 bytes/s, FLOP/s.
  """
  errors.check_choice('gpu', name, NAMES)
  return GPUS[name]


def detect(device_kind: str) -> str:
  """The name in `NAMES` of a JAX device kind ('NVIDIA H100 80GB HBM3' ->
  'h100'); '' for a device the model does not know (a CPU's)."""
  kind = device_kind.lower()
  return next((name for name in NAMES if name in kind), '')
