"""The host CPU's half-precision instructions, which decide which matmul form
runs fastest on XLA:CPU (`half_dot.auto_form`).

XLA:CPU runs a bf16 x bf16 -> float32 dot on its bf16 kernel, which is fast
only with the CPU's bf16 instructions (AMX-BF16, AVX512-BF16); without them
the kernel emulates bf16 and runs slower than a float32 dot. Linux names an
x86 CPU's instructions on the `flags` lines of /proc/cpuinfo; they are read
once per process. Elsewhere (macOS, Windows, a CPU that is not x86) nothing
is read and the features are unknown (None).
"""

import functools
from typing import Optional

CPUINFO_PATH = '/proc/cpuinfo'
# The /proc/cpuinfo key of an x86 CPU's instruction set extensions.
FLAGS_KEY = 'flags'
# The half-precision instructions the matmul forms depend on, best first.
HALF_FEATURES = ('amx_bf16', 'avx512_bf16', 'avx512_fp16')
# Vector extensions named when a CPU has none of those, widest first.
VECTOR_FEATURES = ('avx512f', 'avx2')


def parse_flags(cpuinfo: str) -> Optional[frozenset[str]]:
  """The instruction set extensions on the first `flags` line of /proc/cpuinfo
  text (every core lists the same), or None without one (not an x86 CPU)."""
  for line in cpuinfo.splitlines():
    key, sep, value = line.partition(':')
    if sep and key.strip() == FLAGS_KEY:
      return frozenset(value.split())
  return None


@functools.cache
def host_features(path: str = CPUINFO_PATH) -> Optional[frozenset[str]]:
  """This machine's CPU extensions, read once; None where they are unknown."""
  try:
    with open(path) as f:
      return parse_flags(f.read())
  except OSError:  # No /proc (macOS, Windows).
    return None


def describe(features: frozenset[str]) -> str:
  """The features that matter for half precision, for a console line: the
  half-precision instructions the CPU has, or its widest vector extension."""
  half = [f for f in HALF_FEATURES if f in features]
  if half:
    return ', '.join(half)
  vector = next((f for f in VECTOR_FEATURES if f in features), None)
  return f'{vector} only' if vector else f'no {VECTOR_FEATURES[-1]}'
