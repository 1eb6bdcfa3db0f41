"""The C allocator a command runs with: glibc's malloc on huge pages by
default, the user's own setting where they gave one.

XLA:CPU allocates a step's temp buffer (gigabytes for the reference ViT) for
every execution; glibc hands it back to the kernel and faults it in again,
4 KiB at a time: over a second of system CPU per reference step. With
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, glibc (2.35 and newer) asks for
transparent huge pages for its large blocks, and CPU steps run about a fifth
faster (BENCHMARKS.md). glibc reads the variable only as a process starts,
so `python -m launch.NAME` started without it executes itself again, once,
with it set, before it has imported anything (`launch/__init__.py`).

A user who sets `GLIBC_TUNABLES` (even to nothing) or `LD_PRELOAD` (tcmalloc,
say) keeps their own. Where glibc is older, absent (musl, macOS) or the
kernel has transparent huge pages off, nothing changes.

`python -m launch.machine` prints the setting the commands run with here.
"""

import os
import sys
from typing import Mapping, Optional

TUNABLES = 'GLIBC_TUNABLES'
HUGE_PAGES = 'glibc.malloc.hugetlb=1'
# The first glibc whose malloc has the hugetlb tunable.
FIRST_GLIBC = (2, 35)
_THP = '/sys/kernel/mm/transparent_hugepage/enabled'


def glibc_version() -> Optional[tuple[int, int]]:
  """(major, minor) of the C library if it is glibc, else None."""
  try:
    name, version = os.confstr('CS_GNU_LIBC_VERSION').split()
    major, minor = version.split('.')[:2]
    return (int(major), int(minor)) if name == 'glibc' else None
  except (AttributeError, OSError, TypeError, ValueError):
    return None


def transparent_huge_pages(path: str = _THP) -> Optional[str]:
  """The kernel's transparent huge page mode ('always', 'madvise',
  'never'), or None where it has none to say."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find('['), text.find(']')
  return text[start + 1:end] if 0 <= start < end else None


def wants_huge_pages(env: Mapping[str, str],
                     glibc: Optional[tuple[int, int]],
                     thp_mode: Optional[str]) -> bool:
  """Whether a command started with `env` should be given glibc's huge
  pages: the user chose no allocator setting, and glibc and the kernel can."""
  if TUNABLES in env or 'LD_PRELOAD' in env:
    return False
  return (glibc is not None and glibc >= FIRST_GLIBC
          and thp_mode in ('always', 'madvise'))


def _started_as_command() -> bool:
  """True while `python -m launch.NAME` imports this package: `sys.argv[0]`
  is '-m' until the command's own module runs."""
  argv = getattr(sys, 'orig_argv', [])
  return (sys.argv[:1] == ['-m'] and '-m' in argv[:-1]
          and argv[argv.index('-m') + 1].startswith('launch.'))


def use_huge_pages() -> None:
  """Executes this command again with glibc's huge pages if it should have
  them; returns otherwise, or if the exec fails (the command then runs on
  as it was started)."""
  if not _started_as_command() or not wants_huge_pages(
      os.environ, glibc_version(), transparent_huge_pages()):
    return
  try:
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              dict(os.environ, **{TUNABLES: HUGE_PAGES}))
  except OSError:
    return
