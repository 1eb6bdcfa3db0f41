"""The one base class of errors in what a user asked for.

Entry points report a `ConfigError` as one line naming the setting, without a
traceback, and exit non-zero; anything else is a bug and keeps its traceback.
"""


class ConfigError(ValueError):
  """A setting, input or file that cannot be used; the message names it."""


class DataError(ConfigError):
  """Missing or unusable data; names the setting to change."""
