"""absl's and ml_collections' messages about a command's flags, as one line
each: a bad flag, config file or config field names the flag, the value and
what it takes. (absl and ml_collections say it in tracebacks and several
forms; reading those is written here, once, for every command.)"""

import ast
import glob
import importlib.util
import inspect
import os
import re
from typing import Iterator, Optional

from absl import flags
import ml_collections
# The package exports no test for a config-file flag; its module does.
from ml_collections.config_flags.config_flags import is_config_flag

from configs import vit_cpu
from configs import vit_fp8
from haiku_mp import errors
from launch import command_help

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# absl's "flag --NAME=VALUE: REASON".
_FLAG_MESSAGE = re.compile(r'^flag --([^=\s]+)=(.*?): (.*)$', re.DOTALL)
_REQUIRED = re.compile(r'Flag --(\S+) must have a value other than None')
# ml_collections' KeyError for a field a config does not have.
_SUGGESTION = re.compile(r'Did you mean "([^"]+)"')
_OVERRIDE = re.compile(r'^--?(?:no)?(\w+)\.([\w.]+)')
_NUMBERS = {'int': 'an integer', 'float': 'a number'}


def _chain(e: BaseException) -> Iterator[BaseException]:
  while e is not None:
    yield e
    e = e.__cause__ or e.__context__


def _innermost(e: BaseException) -> str:
  """The first cause of `e`: its message alone if it is a `ConfigError`."""
  cause = list(_chain(e))[-1]
  if isinstance(cause, errors.ConfigError):
    return str(cause)
  return f'{type(cause).__name__}: {cause}'


def _config_names() -> str:
  """The repository's config files, as `--config` takes them from here."""
  paths = sorted(glob.glob(os.path.join(_ROOT, 'configs', '*.py')))
  # As a path from here: relative under the root, whole from elsewhere.
  shown = [p if os.path.relpath(p).startswith('..') else os.path.relpath(p)
           for p in paths if not p.endswith('__init__.py')]
  return ', '.join(shown)


def _key_error(e: BaseException) -> Optional[KeyError]:
  """The KeyError ml_collections raised for a field a config does not have
  (an AttributeError carries it as its argument)."""
  for cause in _chain(e):
    if isinstance(cause, KeyError):
      return cause
    if cause.args and isinstance(cause.args[0], KeyError):
      return cause.args[0]
  return None


def _unknown_field(key_error: KeyError, argv: list[str]) -> str:
  """An override of a field the config does not have, and the one meant."""
  text = str(key_error.args[0]) if key_error.args else ''
  key = text.splitlines()[0].strip('\'"') if text else ''
  suggestion = _SUGGESTION.search(text)
  for arg in argv[1:]:
    match = _OVERRIDE.match(arg)
    parts = match.group(2).split('.') if match else []
    if key in parts:
      flag, path = match.group(1), parts[:parts.index(key)]
      name = f'--{flag}.{".".join(path + [key])}'
      if suggestion:
        meant = '.'.join(path + [suggestion.group(1)])
        return (f'{name}: the config has no such setting; did you mean '
                f'--{flag}.{meant}?')
      return f'{name}: the config has no such setting'
  return f'the config has no setting {key!r}'


# What the argument after a config file's colon names, by its
# `get_config` parameter: the precision variant, or fp8's placement.
_ARGUMENTS = {'precision': ('VARIANT', vit_cpu.VARIANTS),
              'placement': ('PLACEMENT', vit_fp8.PLACEMENTS)}


def _argument_of(path: str) -> Optional[str]:
  """The name of the config file at `path`'s `get_config` argument, if it
  takes one."""
  spec = importlib.util.spec_from_file_location('_config_for_help', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return next(iter(inspect.signature(module.get_config).parameters), None)


def _variant_error(name: str, value: str) -> Optional[str]:
  """A variant (`:bf16`) given to a config file that takes none."""
  path, colon, variant = value.partition(':')
  if not colon or not os.path.exists(path) or _argument_of(path):
    return None
  by_argument = {}
  for config in _config_names().split(', '):
    argument = _argument_of(os.path.join(_ROOT, config))
    if argument:
      by_argument.setdefault(argument, []).append(config)
  takers = [f'{", ".join(configs)} (:{_ARGUMENTS[a][0]}, one of '
            f'{_ARGUMENTS[a][1]})' for a, configs in by_argument.items()]
  return (f'--{name}={value}: {path} takes no variant (:{variant}); the '
          f'configs that do are {" and ".join(takers)}')


def _bad_value(name: str, value: str, reason: str, e: BaseException) -> str:
  """A flag value that did not parse, with what the flag takes."""
  flag = flags.FLAGS[name] if name in flags.FLAGS else None
  if flag is None:
    return f'--{name}={value}: {reason}'
  if is_config_flag(flag):
    return (_variant_error(name, value) or
            f'--{name}={value}: {_innermost(e)}')
  kind = flag.parser.flag_type()
  if kind == 'bool':
    return f'--{name}={value}: expected true or false'
  if kind in _NUMBERS:
    try:
      flag.parser.convert(value)
    except (TypeError, ValueError):
      return f'--{name}={value}: expected {_NUMBERS[kind]}'
  return f'--{name}={value}: {reason}'


def _flag_error(e: Exception, argv: list[str]) -> str:
  """absl's or ml_collections' complaint about the command line, as one line
  that names the flag or setting and what it takes."""
  key_error = _key_error(e)
  if key_error is not None:
    return _unknown_field(key_error, argv)
  text = str(e)
  required = _REQUIRED.findall(text)
  if required:
    return ' and '.join(f'--{name}' for name in required) + (
        ' is required' if len(required) == 1 else ' are required')
  message = _FLAG_MESSAGE.match(text)
  if message:
    return _bad_value(*message.groups(), e)
  if isinstance(e, flags.Error):
    return f'{text} (--helpfull lists the flags)'
  return _innermost(e)


def _no_such_config(name: str, path: str) -> str:
  return f'--{name}={path}: no such file; the configs are {_config_names()}'


def _config_file_error() -> Optional[str]:
  """Why a `--config` file could not be loaded, if it could not.

  ml_collections keeps a load failure (a missing file) until the config is
  first read; this reads it now, before anything else happens.
  """
  for name in flags.FLAGS:
    flag = flags.FLAGS[name]
    if not is_config_flag(flag):
      continue
    value = flag.value
    if value is None or isinstance(value, ml_collections.ConfigDict):
      continue
    path = flag.config_filename
    file = path.split(':', 1)[0]
    if not os.path.exists(file):
      return _no_such_config(name, path)
    try:
      value.lock()
    except OSError as e:
      return f'--{name}={path}: cannot be loaded ({_innermost(e)})'
  return None


# What `--config` takes, said wherever a file given to it is not that.
_A_CONFIG_FILE = ('a config file: Python with a get_config() that returns '
                  'the settings')


def _given_config_files(argv: list[str]) -> Iterator[tuple[str, str]]:
  """(flag, value) of each config-file flag on the command line, as
  `--NAME=PATH` or `--NAME PATH`."""
  args = argv[1:]
  for i, arg in enumerate(args):
    if arg == '--':
      break
    name, equals, value = arg.lstrip('-').partition('=')
    if (not arg.startswith('-') or name not in flags.FLAGS or
        not is_config_flag(flags.FLAGS[name])):
      continue
    if equals:
      yield name, value
    elif i + 1 < len(args):
      yield name, args[i + 1]


def _defines_get_config(tree: ast.Module) -> bool:
  """Whether a module's source binds the name `get_config` anywhere (a def,
  an assignment, an import, under an `if` too) or imports `*`, which may;
  a file that does so some other way fails as it loads (`_no_get_config`)."""
  for node in ast.walk(tree):
    if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and
        node.name == 'get_config'):
      return True
    if (isinstance(node, ast.Name) and node.id == 'get_config' and
        isinstance(node.ctx, ast.Store)):
      return True
    if (isinstance(node, ast.alias) and
        (node.asname or node.name) in ('get_config', '*')):
      return True
  return False


def _not_a_config_file(name: str, value: str) -> Optional[str]:
  """Why the file of `--NAME=VALUE` cannot be a config file, read without
  running it: missing, a directory, not Python, no get_config()."""
  file = value.split(':', 1)[0]
  if not os.path.exists(file):
    return _no_such_config(name, value)
  if os.path.isdir(file):
    return (f'--{name}={value}: {file} is a directory; --{name} takes '
            f'{_A_CONFIG_FILE}: one of {_config_names()}')
  takes = f'--{name} takes {_A_CONFIG_FILE}, like configs/vit_cpu.py'
  try:
    with open(file, 'rb') as f:
      tree = ast.parse(f.read(), filename=file)
  except OSError as e:
    return f'--{name}={value}: cannot be read ({e.strerror})'
  except SyntaxError as e:
    where = f' at line {e.lineno}' if e.lineno else ''
    return (f'--{name}={value}: {file} is not Python (SyntaxError{where}: '
            f'{e.msg}); {takes}')
  except ValueError as e:  # Null bytes, a binary file.
    return f'--{name}={value}: {file} is not Python ({e}); {takes}'
  if not _defines_get_config(tree):
    return _without_get_config(name, value)
  return None


def _without_get_config(name: str, value: str) -> str:
  return (f'--{name}={value}: {value.split(":", 1)[0]} defines no '
          f'get_config(); --{name} takes {_A_CONFIG_FILE}, like '
          'configs/vit_cpu.py')


def _config_file_problem(argv: list[str]) -> Optional[str]:
  """The first config file on the command line that cannot be one."""
  for name, value in _given_config_files(argv):
    problem = _not_a_config_file(name, value)
    if problem:
      return problem
  return None


def _no_get_config(e: BaseException, argv: list[str]) -> Optional[str]:
  """A config file that defined no get_config() after all (one its source
  did not show), as `_not_a_config_file` says it."""
  for cause in _chain(e):
    if isinstance(cause, AttributeError) and cause.name == 'get_config':
      for name, value in _given_config_files(argv):
        return _without_get_config(name, value)
  return None


def parse(argv: list[str]) -> list[str]:
  """absl's parsing; a bad flag, config file or config field raises a
  `ConfigError` of one line."""
  if command_help.wanted(argv):  # Before a required flag is asked for.
    command_help.show(argv)
  # Before ml_collections runs the file: what it would raise (a SyntaxError,
  # an IsADirectoryError) names neither the flag nor what it takes.
  problem = _config_file_problem(argv)
  if problem:
    raise errors.ConfigError(problem)
  try:
    argv = flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError,
          OSError) as e:
    # A config file that did not load fails every override of its fields
    # too: the file is the error to report.
    raise errors.ConfigError(
        _no_get_config(e, argv) or _flag_error(e, argv)) from None
  error = _config_file_error()
  if error:
    raise errors.ConfigError(error)
  return argv
