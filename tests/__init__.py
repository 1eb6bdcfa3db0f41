"""The test package. Importing it (every test module does, through
`tests.helpers` or `tests.devices`) gives JAX eight virtual CPU devices, so a
test module runs alone as well as under pytest. XLA reads the flag when JAX
first creates its CPU backend, not when jax is imported.

The tests' programs are tiny and each is run a few times, so compiling them is
most of the suite's time. Three flags change how XLA:CPU generates machine
code, not what its HLO passes decide (fusion, buffer assignment, memory
analysis): LLVM's optimization level 0 compiles about a third faster,
XLA's elemental emitters instead of its MLIR fusion emitters halve what is
left (a tiny train step: 2.1 s, then 1.1 s on two cores), and one LLVM
module per program instead of parts compiled on a thread pool saves a fifth
of the CPU time that is left (on two busy cores the parts never ran side by
side anyway; tests/library/step_test.py and mixed_precision_test.py: 62 s of CPU,
then 54). The elemental
emitters fuse some multiply-adds into one rounding (FMA), so two programs of
the same arithmetic (a device's part and the whole batch, say) may differ in
a last bit; the tests compare such results to float32 rounding.
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

FAST_COMPILE_FLAGS = ('--xla_backend_optimization_level=0 '
                      '--xla_cpu_use_fusion_emitters=false '
                      '--xla_cpu_parallel_codegen_split_count=1')


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a (sub)process of the tests with `devices` CPU devices."""
  return (f'--xla_force_host_platform_device_count={devices} '
          f'{FAST_COMPILE_FLAGS}')


os.environ.setdefault('XLA_FLAGS', xla_flags(8))
for _name, _value in (
    ('JAX_COMPILATION_CACHE_DIR',
     os.path.join(tempfile.gettempdir(), 'haiku_mp_tests_jax_cache')),
    # Train and eval steps and the like (a tiny one compiles in a few tenths
    # of a second), not the thousands of one-op programs eager code compiles.
    ('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.1'),
    ('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1'),
    # Uncapped: a capped cache reads every entry's access-time file on each
    # write, so one entry left without it (a process killed, or out of file
    # size, mid-write) fails every later write of every process, and a cold
    # run then compiles everything many times over.
    ('JAX_COMPILATION_CACHE_MAX_SIZE', '-1'),
    # Lowering gives every op a location of up to 100 frames of its Python
    # traceback (the HLO's source_file and source_line, for profiles and
    # dumps); no test reads them past the op's name, which the name stack
    # gives. Without them the library's tests take a tenth less time
    # (tests/library on two cores of an EPYC: 74 s, then 67).
    ('JAX_TRACEBACK_IN_LOCATIONS_LIMIT', '0')):
  os.environ.setdefault(_name, _value)

# Where a run's JAX time goes, when asked (tests/jax_events.py). Imported
# only then: `python -m tests.jax_events` runs it as a module of its own.
JAX_EVENTS_ENV = 'HAIKU_MP_TESTS_JAX_EVENTS'
if os.environ.get(JAX_EVENTS_ENV):
  from tests import jax_events  # pylint: disable=g-import-not-at-top
  jax_events.record(os.environ[JAX_EVENTS_ENV])
