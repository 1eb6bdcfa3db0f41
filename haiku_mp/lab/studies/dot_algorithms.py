"""Study `dot_algorithms`: which dot algorithms the backend compiles.

The seeds asked for `precision=ALG_DOT_F16_F16_F32` on a GPU and got an
error. Here every `jax.lax.DotAlgorithmPreset` is tried on one square matmul
with operands of the preset's first input dtype: the error's first line if
it does not compile or run, else the result dtype, the time, and the error
against the float64 product of the same (rounded) operands.

JAX truncates 64-bit operands to 32 bits unless x64 is enabled, which is a
process-wide setting; so a preset with 64-bit operands (`F64_F64_F64`) is
measured in a fresh process with x64 enabled (`python -m
haiku_mp.lab.studies.dot_algorithms`, request on stdin, row as the last line of
stdout). Every row names the operand dtype the matmul really received.
"""

import json
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.lab import charts
from haiku_mp.lab import run_plots
from haiku_mp.lab import timing

X64_ENV = 'JAX_ENABLE_X64'


def _operand_dtype(preset):
  types = preset.supported_lhs_types
  return np.dtype(types[0]) if types else np.dtype(np.float32)


def needs_x64(preset) -> bool:
  """Whether the preset's operands are 64-bit (JAX truncates them without x64)."""
  return _operand_dtype(preset).itemsize == 8


def _one(preset, size: int, repeats: int) -> dict[str, Any]:
  dtype = _operand_dtype(preset)
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.standard_normal((size, size)), dtype)
          for _ in range(2))
  row = dict(algorithm=preset.name, operand_dtype=a.dtype.name,
             x64=bool(jax.config.jax_enable_x64))
  if a.dtype != dtype:
    raise RuntimeError(f'{preset.name}: operands became {a.dtype.name}, not '
                       f'{dtype.name}')
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
             median_sec=timing.median_seconds(dot, (a, b), repeats))
  return row


def _in_x64_process(preset, size: int, repeats: int) -> dict[str, Any]:
  """`_one` in a fresh process with x64 enabled."""
  request = dict(algorithm=preset.name, size=size, repeats=repeats)
  proc = subprocess.run([sys.executable, '-m', __name__],
                        input=json.dumps(request), capture_output=True,
                        text=True, check=False,
                        env=dict(os.environ, **{X64_ENV: '1'}))
  if proc.returncode:
    raise RuntimeError(f'{preset.name} in a process with x64 enabled failed:\n'
                       + '\n'.join(proc.stderr.strip().splitlines()[-30:]))
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run(size: int = 1024, repeats: int = 5, log=lambda line: None
        ) -> dict[str, Any]:
  """Every preset on a `size` x `size` matmul."""
  results = []
  for preset in jax.lax.DotAlgorithmPreset:
    measure = _in_x64_process if needs_x64(preset) else _one
    results.append(measure(preset, size, repeats))
    row = results[-1]
    log(f'dot_algorithms {preset.name}: ' + (
        f'{row["operand_dtype"]} operands, {row["result_dtype"]} result, '
        f'relative error {row["relative_error"]:.1e}' if row['compiles'] else
        'does not compile'))
  return dict(experiment='dot_algorithms', size=size, repeats=repeats,
              device=str(jax.devices()[0].device_kind),
              backend=jax.default_backend(), results=results)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Relative error of the algorithms that run (log scale; F64's exact 0 is
  written as such, not drawn as a made-up tiny bar)."""
  rows = [r for r in result['results'] if r['compiles']]
  path = os.path.join(out_dir, 'dot_algorithms.png')
  charts.horizontal_bar_chart(
      path, [r['algorithm'] for r in rows],
      [r['relative_error'] for r in rows],
      run_plots.axis_label('relative_error', 'log'),
      f'dot algorithms that run on {result["device"]}', log=True)
  return [path]


def main() -> None:
  request = json.loads(sys.stdin.read())
  preset = jax.lax.DotAlgorithmPreset[request['algorithm']]
  print(json.dumps(_one(preset, request['size'], request['repeats'])))


if __name__ == '__main__':
  main()
