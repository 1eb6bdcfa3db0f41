"""What a measurement ran on, recorded beside every figure: the device, JAX's
version, the host CPU (whose half-precision instructions decide bf16's
speed on a CPU) and the C allocator (whose page faults cost a CPU step a
fifth of its time without huge pages)."""

import os
import platform
from typing import Any

import jax

from haiku_mp.model import cpu_features

# The half-precision instructions recorded: those `auto`'s matmul form
# follows (`cpu_features`).
CPU_FLAGS = cpu_features.HALF_FEATURES


def cpu_info(cpuinfo_path: str = cpu_features.CPUINFO_PATH
             ) -> dict[str, Any]:
  """The host CPU's model name and whether it has the half-precision
  instructions XLA:CPU can use (bf16 speed depends on them)."""
  try:
    with open(cpuinfo_path) as f:
      text = f.read()
  except OSError:
    text = ''
  name = next((value.strip() for key, _, value in
               (line.partition(':') for line in text.splitlines())
               if key.strip() == 'model name'), 'unknown')
  flags = cpu_features.parse_flags(text) or frozenset()
  return dict(model=name, **{flag: flag in flags for flag in CPU_FLAGS})


def _initial_environment(path: str) -> dict[str, str]:
  """The environment the process was started with: what the dynamic loader
  and malloc read (`os.environ` may have changed since; a forked process
  keeps its parent's)."""
  try:
    with open(path, 'rb') as f:
      entries = f.read().split(b'\0')
  except OSError:
    return dict(os.environ)
  pairs = (e.decode(errors='replace').partition('=') for e in entries if e)
  return {name: value for name, _, value in pairs}


def allocator(environ_path: str = '/proc/self/environ') -> str:
  """The C allocator setting in force in this process (`launch/allocator.py`
  chooses it for the commands)."""
  env = _initial_environment(environ_path)
  if env.get('LD_PRELOAD'):
    return f'LD_PRELOAD={env["LD_PRELOAD"]}'
  libc, version = platform.libc_ver()
  malloc = f'{libc} {version} malloc' if libc else 'the C library\'s malloc'
  tunables = env.get('GLIBC_TUNABLES', '')
  if 'glibc.malloc.hugetlb=1' in tunables.split(':'):
    return f'{malloc} on huge pages (GLIBC_TUNABLES={tunables})'
  if tunables:
    return f'{malloc}, GLIBC_TUNABLES={tunables}'
  return f'{malloc}, default settings'


def host_line() -> str:
  """The console's `Machine:` line: the CPU, its cores and the allocator."""
  cpu = cpu_info()
  flags = [flag for flag in CPU_FLAGS if cpu[flag]]
  cores = (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity')
           else os.cpu_count())
  return (f'Machine: {cpu["model"]}' + (f' ({", ".join(flags)})' if flags
                                        else '')
          + f', {cores} cores; allocator: {allocator()}')


def describe() -> dict[str, Any]:
  """What a measurement ran on: the device, JAX's version, the host CPU and
  its allocator."""
  return dict(device=str(jax.devices()[0].device_kind),
              jax_version=jax.__version__, cpu=cpu_info(),
              allocator=allocator())
