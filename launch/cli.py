"""What every entry point shares: flag errors and user errors in one line, and
a console that shows the project's own INFO lines, not its libraries'."""

import logging as python_logging
import os
import sys
from typing import Callable

from absl import app
from absl import flags
from absl import logging

from haiku_mp import errors

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_CODE = tuple(os.path.join(_ROOT, package) + os.sep
                  for package in ('haiku_mp', 'launch'))


class _OwnInfoOnly(python_logging.Filter):
  """Passes warnings and errors from anywhere, INFO only from this project.

  orbax writes about twenty INFO lines per checkpoint, JAX and TFDS a few per
  start; they would drown the progress lines.
  """

  def filter(self, record: python_logging.LogRecord) -> bool:
    return (record.levelno >= python_logging.WARNING or
            os.path.abspath(record.pathname).startswith(_OWN_CODE))


def _quiet_libraries() -> None:
  """At the default verbosity, hides libraries' INFO logging (Python and
  TensorFlow's C++ notices); `--verbosity=1` shows everything."""
  if flags.FLAGS.verbosity >= 1:
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')  # Before TF is imported.
  logging.get_absl_handler().addFilter(_OwnInfoOnly())


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, with a bad flag or config field reported in one line."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError) as e:
    message = ' '.join(str(e).split())
    sys.exit(f'error: {message} (--helpfull lists the flags)')


def run(main: Callable[[list[str]], None]) -> None:
  """`app.run(main)`; a `ConfigError` becomes one line and exit status 1."""

  def guarded(argv):
    _quiet_libraries()
    try:
      main(argv)
    except errors.ConfigError as e:
      logging.error('%s', e)
      sys.exit(f'error: {e}')

  app.run(guarded, flags_parser=_parse_flags)
