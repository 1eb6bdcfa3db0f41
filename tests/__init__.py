"""The test package. Importing it (every test module does, through
`tests.helpers` or `tests.devices`) gives JAX eight virtual CPU devices, so a
test module runs alone as well as under pytest. XLA reads the flag when JAX
first creates its CPU backend, not when jax is imported.

The tests' programs are tiny and each is run a few times, so compiling them is
most of the suite's time. LLVM's optimization level 0 compiles XLA:CPU
programs about a third faster; it changes how the machine code is generated,
not what XLA's HLO passes decide (fusion, buffer assignment, memory analysis).
Subprocesses get the same flags through `xla_flags`.

Many of those programs are the same program: the two pytest workers and every
`python -m launch...` a test starts compile the tiny train steps of the same
few configs. JAX's persistent compilation cache (a directory under the system
temp dir, shared by every process of the suite) compiles
each of them once per machine; a cached executable keeps its HLO text, memory
and cost analyses, which the tests read.
"""

import os
import tempfile

FAST_COMPILE_FLAGS = '--xla_backend_optimization_level=0'


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a (sub)process of the tests with `devices` CPU devices."""
  return (f'--xla_force_host_platform_device_count={devices} '
          f'{FAST_COMPILE_FLAGS}')


os.environ.setdefault('XLA_FLAGS', xla_flags(8))
for _name, _value in (
    ('JAX_COMPILATION_CACHE_DIR',
     os.path.join(tempfile.gettempdir(), 'haiku_mp_tests_jax_cache')),
    # Train steps and the like, not the thousands of one-op programs eager
    # code compiles.
    ('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.5'),
    ('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1'),
    # Uncapped: a capped cache reads every entry's access-time file on each
    # write, so one entry left without it (a process killed, or out of file
    # size, mid-write) fails every later write of every process, and a cold
    # run then compiles everything many times over.
    ('JAX_COMPILATION_CACHE_MAX_SIZE', '-1')):
  os.environ.setdefault(_name, _value)
