"""`launch.lab speed --shape=M,K,N`: one Linear of M tokens, K in and N
out, on paper for a named GPU: its three GEMMs (fprop, dgrad, wgrad) per
matmul format, their casts and scales included, by the speed model
(`haiku_mp.advisor.speed`) that times the whole step (`step_time`).
"""

from typing import Any

from haiku_mp import errors
from haiku_mp.advisor import gpus
from haiku_mp.advisor import speed as speed_lib
from haiku_mp.lab.studies import step_time


def one_gemm(shape: tuple[int, int, int], gpu_name: str,
             assumptions: gpus.Assumptions = gpus.Assumptions(),
             compute_dtype: str = 'bf16') -> dict[str, Any]:
  """`--shape=M,K,N`: one Linear of M tokens, K in and N out. `matmuls`
  holds its forward GEMM's row; `linear`, its three GEMMs per format."""
  gpu = gpus.gpu(gpu_name)
  m, k, n = shape
  c = step_time.element_bytes(compute_dtype)
  formats = list(speed_lib.formats_on(gpu))
  seconds = speed_lib.linear_seconds(m, k, n, gpu, assumptions, c)
  fprop = speed_lib.gemm(m, k, n, 'bf16', gpu, assumptions, c, c)
  row = dict(name=f'{m}x{k}x{n}', m=m, k=k, n=n, batch=1, lhs=compute_dtype,
             rhs=compute_dtype, out=compute_dtype, flops=fprop.flops,
             bytes=fprop.bytes, bound=fprop.bound, linear=True, low_bit=True,
             seconds={f: seconds['fprop'][f] for f in formats})
  row['pass'] = 'fprop'  # A keyword `pass` is not Python.
  total = {f: sum(seconds[p][f] for p in speed_lib.PASSES) for f in formats}
  return dict(experiment='speed', prediction=True, gpu=gpu.name,
              gpu_about=gpu.about,
              assumptions=step_time.describe_assumptions(gpu, assumptions),
              shape=list(shape), baseline=speed_lib.BASELINE, formats=formats,
              matmuls=[row],
              linear=dict(seconds=total,
                          passes={p: {f: seconds[p][f] for f in formats}
                                  for p in speed_lib.PASSES},
                          speedup={f: total[speed_lib.BASELINE] / s
                                   for f, s in total.items()}))


def parse_shape(text: str) -> tuple[int, int, int]:
  """'M,K,N' -> (M, K, N), each a positive integer."""
  parts = text.split(',')
  if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0
                                for p in parts):
    raise errors.ConfigError(
        f'--shape={text}: expected M,K,N, three positive integers (tokens, '
        'inputs, outputs of a Linear), e.g. --shape=8320,384,1536')
  return tuple(int(p) for p in parts)
