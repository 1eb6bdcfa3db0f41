"""`PrecisionError`: a precision's argument that cannot be used (a policy,
a module target, a matmul or low-bit setting), raised by every module that
builds a precision."""

from haiku_mp import errors


class PrecisionError(errors.ConfigError):
  """A policy string, target or matmul setting that cannot be used; names
  the setting."""
