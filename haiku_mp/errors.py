"""The errors an entry point reports in one line, without a traceback.

A `ConfigError` is a mistake in what a user asked for (exit status 2, a usage
error); a `RunError` is a failure of the environment the run met, not of its
input (exit status 1). Anything else is a bug and keeps its traceback.
"""

import os


class ConfigError(ValueError):
  """A setting, input or file that cannot be used; the message names it."""


class DataError(ConfigError):
  """Missing or unusable data; names the setting to change."""


class RunError(Exception):
  """The environment failed a valid run (a full disk, say); the message says
  what failed and where."""


def check_choice(setting: str, value, choices, error=ConfigError) -> None:
  """Raises `error` naming `setting` unless `value` is one of `choices`."""
  if value not in choices:
    raise error(f'{setting}: unknown value {value!r}; expected one of '
                f'{tuple(choices)}')


def check_given(setting: str, path: str) -> None:
  """A ConfigError for a required directory given empty (`--workdir=`)."""
  if not path:
    raise ConfigError(f'{setting} is required: an empty {setting}= names no '
                      'directory')


def _read_only(path: str) -> bool:
  """Whether `path` is on a file system mounted read-only."""
  try:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
  except OSError:
    return False


def check_writable_directory(setting: str, path: str) -> None:
  """A ConfigError naming `setting` unless `path` is a directory, or none yet
  under a folder that can be written; creates nothing, so a wrong path fails
  before anything is loaded or made."""
  check_given(setting, path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'{setting}={path} is a file, not a directory')
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ConfigError(f'{setting}={path} is not writable (Not a directory: '
                      f'{existing})')
  if not os.access(existing, os.W_OK | os.X_OK):
    # access() fails with EROFS on a read-only mount, root's included; it
    # returns no errno, the mount's flags tell.
    why = ('Read-only file system' if _read_only(existing) else
           'Permission denied')
    raise ConfigError(f'{setting}={path} is not writable ({why}: '
                      f'{existing})')
