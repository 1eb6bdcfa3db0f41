"""What a measurement ran on, recorded beside every figure: the device, JAX's
version and the host CPU (whose half-precision instructions decide bf16's
speed on a CPU)."""

from typing import Any

import jax

CPU_FLAGS = ('amx_bf16', 'avx512_bf16', 'avx512_fp16')


def cpu_info(cpuinfo_path: str = '/proc/cpuinfo') -> dict[str, Any]:
  """The host CPU's model name and whether it has the half-precision
  instructions XLA:CPU can use (bf16 speed depends on them)."""
  name, flags = 'unknown', set()
  try:
    with open(cpuinfo_path) as f:
      for line in f:
        key, _, value = line.partition(':')
        if key.strip() == 'model name' and name == 'unknown':
          name = value.strip()
        elif key.strip() == 'flags' and not flags:
          flags = set(value.split())
  except OSError:
    pass
  return dict(model=name, **{flag: flag in flags for flag in CPU_FLAGS})


def describe() -> dict[str, Any]:
  """What a measurement ran on: the device, JAX's version, the host CPU."""
  return dict(device=str(jax.devices()[0].device_kind),
              jax_version=jax.__version__, cpu=cpu_info())
