"""What every entry point shares: a bad flag, setting or input stops it in one
line, once, before it reads data or writes a file (the flags' messages are
read in `flag_errors.py`; here each error becomes its exit status); and a
console that shows the project's own INFO lines, not its libraries'.

A command ends without freeing its modules' objects (`run`), which costs
seconds after its last line and changes no output.

Exit status: 2 for a usage error (a flag, a config file or setting, an input;
`errors.ConfigError`), 1 for a failure of the environment (`errors.RunError`,
or a file the disk had no room for), 75 for a lost process of a
many-process run (`lost_process.py`), 130 for Ctrl-C (a `KeyboardInterrupt`,
whose message may say what the command did about it). None of them prints a traceback; anything else is a bug and
keeps its own.
"""

import atexit
import errno
import logging as python_logging
import os
import sys
import threading
from typing import Callable, NoReturn

from absl import app
from absl import flags
from absl import logging

from haiku_mp import errors
from launch import failed_saves
from launch import flag_errors

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_CODE = tuple(os.path.join(_ROOT, package) + os.sep
                  for package in ('haiku_mp', 'launch'))

EXIT_USAGE = 2  # What argparse and the shells' builtins exit with.
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it.
# Failures of the disk under a file being written: no room, a quota, a file
# size limit, a read-only or failing filesystem.
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS,
                       errno.EIO)



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


def _one_line(text: str) -> str:
  return ' '.join(str(text).split())


def _exit(message: str, status: int) -> NoReturn:
  """`message` on stderr, once (no absl log line repeats it), then exits."""
  sys.stderr.write(f'{_one_line(message)}\n')
  sys.stderr.flush()
  sys.exit(status)


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flag_errors.parse(argv)
  except errors.ConfigError as e:
    _exit(f'error: {e}', EXIT_USAGE)


def leave(code) -> NoReturn:
  """Ends the process with `sys.exit(code)`'s status as the interpreter's
  shutdown does, up to its last stage: waits for the threads that are not
  daemons, runs the atexit functions (absl's log flush, JAX's backend
  clean-up, a distributed run's shutdown, ...), flushes stdout and stderr.
  What it skips is freeing every imported module's objects, which no output
  or file depends on (each is closed by then): after a run's Summary line,
  0.5 s of CPU (1.7 s where TensorFlow was imported for the data), most of
  it CPython's garbage collections over the libraries' 200,000-550,000
  objects, on one device as on eight; 4-7 s of waiting on two busy cores.
  The tests' forked commands end through it too (`tests/forked_commands.py`)."""
  if code is None:
    status = 0
  elif isinstance(code, int):
    status = code
  else:  # sys.exit('message'): printed, status 1.
    print(code, file=sys.stderr)
    status = 1
  # What the interpreter's shutdown calls first, in its order; neither has a
  # public name. The first also stops executors' idle worker threads.
  threading._shutdown()  # pylint: disable=protected-access
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # A closed pipe: nothing left to show.
      pass
  os._exit(status)  # pylint: disable=protected-access


def run(main: Callable[[list[str]], None], leave_at_exit: bool = True
        ) -> None:
  """`app.run(main)`; errors as the module says. A config is checked where
  the command builds its run (`experiment.build`), before anything is
  written or compiled. The process ends without freeing its modules
  (`leave`) unless `leave_at_exit` is False (then `SystemExit` is
  raised, for a caller that goes on)."""

  def guarded(argv):
    _quiet_libraries()
    try:
      main(argv)
    except (errors.ConfigError, app.UsageError) as e:
      _exit(f'error: {e}', EXIT_USAGE)
    except errors.RunError as e:
      _exit(f'error: {e}', EXIT_FAILURE)
    except OSError as e:
      if e.errno not in _ENVIRONMENT_ERRNOS:
        raise
      # A file the command writes found no room (or no disk): the
      # environment, not a bug; what ran so far is kept.
      _exit(f'error: cannot write {e.filename or "a file"} ({e.strerror}). '
            'Free space (or fix the cause) and run the same command again.',
            EXIT_FAILURE)
    except KeyboardInterrupt as e:
      # The trainer's second-Ctrl-C handler says what it stopped and kept.
      _exit(f'interrupted: {e}' if str(e) else
            'interrupted (Ctrl-C); stopped without saving', EXIT_INTERRUPTED)

  # One console for the whole command, failed checkpoint writes included;
  # a command that leaves ends with it entered.
  with failed_saves.silenced():
    try:
      app.run(guarded, flags_parser=_parse_flags)
    except SystemExit as e:
      if not leave_at_exit:
        raise
      leave(e.code)
