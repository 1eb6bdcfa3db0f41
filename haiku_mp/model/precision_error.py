"""`PrecisionError`: a precision's argument that cannot be used (a policy,
a module target, a matmul or low-bit setting), raised by every module that
builds a precision, in the library's words."""

from haiku_mp import errors


class PrecisionError(errors.ArgumentError):
  """A policy string, target or matmul setting that cannot be used; the
  message names the argument (`$overrides`, `$low_bit.modules`), which an
  application that passed its settings renames (`named`)."""
