"""The test package. Importing it (every test module does, through
`tests.helpers` or `tests.devices`) gives JAX eight virtual CPU devices, so a
test module runs alone as well as under pytest. XLA reads the flag when JAX
first creates its CPU backend, not when jax is imported.

The tests' programs are tiny and each is run a few times, so compiling them is
most of the suite's time. LLVM's optimization level 0 compiles XLA:CPU
programs about a third faster; it changes how the machine code is generated,
not what XLA's HLO passes decide (fusion, buffer assignment, memory analysis).
Subprocesses get the same flags through `xla_flags`.
"""

import os

FAST_COMPILE_FLAGS = '--xla_backend_optimization_level=0'


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a (sub)process of the tests with `devices` CPU devices."""
  return (f'--xla_force_host_platform_device_count={devices} '
          f'{FAST_COMPILE_FLAGS}')


os.environ.setdefault('XLA_FLAGS', xla_flags(8))
