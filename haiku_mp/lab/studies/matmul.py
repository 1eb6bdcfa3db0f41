"""Study `matmul`: the seeds' `jnp.dot(A, A.T)` per dtype, time and FLOP/s."""

import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.lab import charts
from haiku_mp.lab import run_plots
from haiku_mp.lab import timing

DTYPES = ('float64', 'float32', 'float16', 'bfloat16')


def run(rows: int, cols: int, repeats: int,
        dtypes: Sequence[str] = DTYPES, log=lambda line: None
        ) -> dict[str, Any]:
  """Median time of `A @ A.T` for A of shape (rows, cols), per dtype."""
  results = []
  for name in dtypes:
    with jax.enable_x64(name == 'float64'):
      a = jnp.asarray(np.random.default_rng(0).standard_normal((rows, cols)),
                      name)
      dot = jax.jit(lambda x: jnp.dot(x, x.T))
      computed_dtype = dot(a).block_until_ready().dtype.name  # Compiles.
      median = timing.median_seconds(dot, (a,), repeats)
    flops = 2.0 * rows * rows * cols
    results.append(dict(dtype=name, computed_dtype=computed_dtype,
                        median_sec=median,
                        gflops_per_sec=flops / median / 1e9))
    log(f'matmul {name}: {results[-1]["gflops_per_sec"]:.1f} GFLOP/s '
        f'(computed in {computed_dtype})')
  base = results[0]['median_sec']
  for r in results:
    r['time_vs_first'] = r['median_sec'] / base
  return dict(experiment='matmul', shape=[rows, cols], repeats=repeats,
              device=str(jax.devices()[0]), results=results)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  path = os.path.join(out_dir, 'matmul.png')
  charts.bar_chart(path, [r['dtype'] for r in result['results']],
                  [r['gflops_per_sec'] for r in result['results']],
                  run_plots.axis_label('gflops_per_sec', 'GFLOP/s'),
                  f'A @ A.T, A {result["shape"]}, {result["device"]}')
  return [path]
