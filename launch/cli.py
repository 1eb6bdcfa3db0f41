"""What every entry point shares: flag errors and user errors in one line."""

import sys
from typing import Callable

from absl import app
from absl import flags
from absl import logging

from haiku_mp import errors


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
    try:
      main(argv)
    except errors.ConfigError as e:
      logging.error('%s', e)
      sys.exit(f'error: {e}')

  app.run(guarded, flags_parser=_parse_flags)
