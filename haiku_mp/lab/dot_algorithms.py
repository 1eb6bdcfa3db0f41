"""Experiment `dot_algorithms`: which dot algorithms the backend compiles.

The seeds asked for `precision=ALG_DOT_F16_F16_F32` on a GPU and got an
error. Here every `jax.lax.DotAlgorithmPreset` is tried on one square matmul
with operands of the preset's first input dtype: the error's first line if
it does not compile or run, else the result dtype, the time, and the error
against the float64 product of the same (rounded) operands.
"""

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp import plots
from haiku_mp.lab import matmul


def _operand_dtype(preset):
  types = preset.supported_lhs_types
  return np.dtype(types[0]) if types else np.dtype(np.float32)


def _one(preset, size: int, repeats: int) -> dict[str, Any]:
  dtype = _operand_dtype(preset)
  row = dict(algorithm=preset.name, operand_dtype=dtype.name)
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.standard_normal((size, size)), dtype)
          for _ in range(2))
  dot = jax.jit(lambda a, b: jax.lax.dot(a, b, precision=preset))
  try:
    out = jax.block_until_ready(dot(a, b))
  except Exception as e:  # pylint: disable=broad-except
    # Unsupported algorithms raise backend-specific types (XlaRuntimeError,
    # NotImplementedError, ValueError); the message is the result here.
    row.update(compiles=False, error=' '.join(str(e).split())[:300])
    return row
  exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  error = np.linalg.norm(np.asarray(out, np.float64) - exact)
  row.update(compiles=True, error=None, result_dtype=out.dtype.name,
             relative_error=float(error / np.linalg.norm(exact)),
             median_sec=matmul.median_seconds(dot, (a, b), repeats))
  return row


def run(size: int = 1024, repeats: int = 5) -> dict[str, Any]:
  """Every preset on a `size` x `size` matmul."""
  results = [_one(p, size, repeats) for p in jax.lax.DotAlgorithmPreset]
  return dict(experiment='dot_algorithms', size=size, repeats=repeats,
              device=str(jax.devices()[0].device_kind),
              backend=jax.default_backend(), results=results)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Relative error of the algorithms that run (log scale)."""
  rows = [r for r in result['results'] if r['compiles']]
  path = os.path.join(out_dir, 'dot_algorithms.png')
  plots.horizontal_bar_chart(
      path, [r['algorithm'] for r in rows],
      [max(r['relative_error'], 1e-17) for r in rows],
      'relative error vs float64 (log)',
      f'dot algorithms that run on {result["device"]}', log=True)
  return [path]
