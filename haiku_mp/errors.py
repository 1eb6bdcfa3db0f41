"""The errors an entry point reports in one line, without a traceback.

A `ConfigError` is a mistake in what a user asked for (exit status 2, a usage
error); a `RunError` is a failure of the environment the run met, not of its
input (exit status 1). Anything else is a bug and keeps its traceback.
"""

import os
import string
from typing import Mapping


class ConfigError(ValueError):
  """A setting, input or file that cannot be used; the message names it."""


class _Arguments(string.Template):
  """`$name` or `$group.name` (a dotted argument, ending in no dot)."""
  idpattern = r'(?a:[_a-z][_a-z0-9]*(?:\.[_a-z][_a-z0-9]*)*)'


class ArgumentError(ConfigError):
  """A library argument that cannot be used, in the library's own words.

  The message is a `string.Template` whose `$name`s (`$initial`, or dotted:
  `$low_bit.modules`) are the arguments it speaks of; as raised it names them
  as a library caller wrote them
  (`initial: must be ...`). An application that passed its settings as those
  arguments re-raises `named(...)`, the same message naming its setting
  paths (`loss_scale.initial: must be ...`), so the library never learns the
  application's words and a user still reads their own.
  """

  def __init__(self, template: str):
    self.template = _Arguments(template)
    super().__init__(self.template.safe_substitute(
        {name: name for name in self.arguments}))

  @property
  def arguments(self) -> tuple[str, ...]:
    """The argument names the message speaks of."""
    return tuple(self.template.get_identifiers())

  def named(self, paths: Mapping[str, str] = (), prefix: str = '') -> ConfigError:
    """The message with each argument named by `paths`, or `prefix` + its
    name where `paths` lacks it; a ConfigError of the same class."""
    paths = dict(paths)
    names = {name: paths.get(name, prefix + name) for name in self.arguments}
    renamed = ConfigError.__new__(type(self))
    ConfigError.__init__(renamed, self.template.safe_substitute(names))
    renamed.template = _Arguments(literal(renamed.args[0]))
    return renamed


def literal(text: str) -> str:
  """`text` as an ArgumentError template's literal text: a `$` in it names
  no argument."""
  return text.replace('$', '$$')


def quoted(value) -> str:
  """`repr(value)` as an ArgumentError template's literal text."""
  return literal(repr(value))


class DataError(ConfigError):
  """Missing or unusable data; names the setting to change."""


class RunError(Exception):
  """The environment failed a valid run (a full disk, say); the message says
  what failed and where."""


def check_choice(setting: str, value, choices, error=ConfigError) -> None:
  """Raises `error` naming `setting` unless `value` is one of `choices`; an
  ArgumentError's `setting` is its template's (`$dot_form`), the value and
  choices its literal text."""
  if value not in choices:
    shown = quoted if issubclass(error, ArgumentError) else repr
    raise error(f'{setting}: unknown value {shown(value)}; expected one of '
                f'{shown(tuple(choices))}')


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
