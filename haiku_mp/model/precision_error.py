"""`PrecisionError`: a precision's argument that cannot be used (a policy,
a module target, a matmul or low-bit setting), raised by every module that
builds a precision, in the library's words."""

from typing import Any

from haiku_mp import errors


class PrecisionError(errors.ArgumentError):
  """A policy string, target or matmul setting that cannot be used; the
  message names the argument (`$overrides`, `$low_bit.modules`), which an
  application that passed its settings renames (`named`)."""


def literal(text: str) -> str:
  """`text` as a message's literal text: a `$` in it names no argument."""
  return text.replace('$', '$$')


def quoted(value: Any) -> str:
  """`repr(value)` as a message's literal text."""
  return literal(repr(value))
