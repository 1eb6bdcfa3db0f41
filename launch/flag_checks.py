"""The command-line values of the lab and the benchmark, checked before
anything is compiled or written: a bad one is one ConfigError that names the
flag and what would be valid."""

from typing import Iterable, Sequence

from haiku_mp import errors
from haiku_mp.lab import variants
from haiku_mp.model import fp8
from haiku_mp.model import policy_strings


def at_least(flags: Iterable[tuple[str, int, int]]) -> None:
  """Each (name, value, least meaningful value) of integer flags."""
  for name, value, least in flags:
    if value < least:
      raise errors.ConfigError(f'--{name}={value} must be at least {least}')


def positive_ints(name: str, values: Sequence[str]) -> list[int]:
  """A list flag of positive integers (batch sizes), parsed."""
  try:
    numbers = [int(v) for v in values]
  except ValueError:
    numbers = []
  if not numbers or min(numbers) <= 0:
    raise errors.ConfigError(f'--{name}: expected positive integers, got '
                             f'{",".join(values)!r}')
  return numbers


def ints_in(name: str, values: Sequence[str], low: int, high: int) -> None:
  """A list flag of integers in [low, high] (empty: nothing to check)."""
  for value in values:
    try:
      ok = low <= int(value) <= high
    except ValueError:
      ok = False
    if not ok:
      raise errors.ConfigError(f'--{name}={",".join(values)}: expected '
                               f'integers in [{low}, {high}]')


def compute_dtypes(name: str, dtypes: Sequence[str]) -> list[str]:
  """A list flag of compute dtypes, each one a jmp policy accepts."""
  if not dtypes:
    raise errors.ConfigError(f'--{name}: expected at least one compute dtype, '
                             'e.g. float32,bfloat16,float16')
  for dtype in dtypes:
    if dtype == variants.PURE_BF16 or dtype in variants.FP4_VARIANTS:
      continue
    if dtype.startswith(fp8.VARIANT_PREFIX):
      errors.check_choice(f'--{name}', dtype, variants.FP8_VARIANTS)
      continue
    policy_strings.parse_policy(f'compute={dtype}',
                                setting=f'--{name} ({dtype})')
  return list(dtypes)


def out_dir(name: str, path: str) -> None:
  """A directory flag the command writes into: a directory, or none yet."""
  if not path:
    raise errors.ConfigError(f'--{name} is empty: expected a directory to write '
                             'into')
  errors.check_writable_directory(f'--{name}', path)
