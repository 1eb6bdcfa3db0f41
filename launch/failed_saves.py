"""The commands' console while orbax saves and restores: one error line for a
failed checkpoint write or read, not the hundreds its threads print.

A full disk makes orbax log each failed write with its traceback from several
threads; orbax then closes its event loop while TensorStore still completes
the other writes, whose callbacks raise 'Event loop is closed' (through
`sys.excepthook` or `threading.excepthook`); asyncio logs each of its tasks'
and futures' exceptions as never retrieved when they are freed; Python warns
of each coroutine never awaited, and reports the unfinished ones at exit
(`sys.unraisablehook`). A corrupt checkpoint's restore logs each unreadable
file. The library raises one error or warning for each and touches none of
the process's hooks, filters or loggers (a program of one's own sees what
orbax prints); a command enters `silenced()` once, around everything it
runs. Exceptions from elsewhere still reach the hooks that were there.
"""

import contextlib
import logging as python_logging
import os
import sys
import threading
from typing import Iterator
import warnings

from absl import logging

# The message of Python's RuntimeWarning for a coroutine never awaited.
_UNAWAITED = r"coroutine '.*' was never awaited"
_SAVING_CODE = ('orbax', 'asyncio', 'tensorstore')


def _from_saving_code(traceback) -> bool:
  """Whether a traceback runs through orbax's, asyncio's or TensorStore's
  code."""
  while traceback is not None:
    filename = traceback.tb_frame.f_code.co_filename
    if any(f'{os.sep}{name}{os.sep}' in filename for name in _SAVING_CODE):
      return True
    traceback = traceback.tb_next
  return False


class _OrbaxErrors(python_logging.Filter):
  """Drops orbax's ERROR records: the checkpointer's one error (a failed
  save) or warning (an unreadable checkpoint) says what happened."""

  def filter(self, record: python_logging.LogRecord) -> bool:
    return not (record.levelno >= python_logging.ERROR and
                f'{os.sep}orbax{os.sep}' in record.pathname)


class _UnretrievedWrites(python_logging.Filter):
  """asyncio's 'Task exception was never retrieved' for orbax's writes (the
  exception raised through orbax's code) and 'Future exception was never
  retrieved' (set on the future by TensorStore, never raised: no traceback
  at all). Nothing else in a command uses asyncio."""

  def filter(self, record: python_logging.LogRecord) -> bool:
    if not record.exc_info:
      return True
    traceback = record.exc_info[2]
    return not (traceback is None or _from_saving_code(traceback))


@contextlib.contextmanager
def _filtered(logger: python_logging.Logger,
              log_filter: python_logging.Filter) -> Iterator[None]:
  logger.addFilter(log_filter)
  try:
    yield
  finally:
    logger.removeFilter(log_filter)


@contextlib.contextmanager
def _hooks_without_saving_code() -> Iterator[None]:
  """`sys.excepthook`, `sys.unraisablehook` and `threading.excepthook` that
  pass on everything but what comes through the saving code (the main
  thread's own uncaught exception always passes: it ends the command)."""
  excepthook, unraisablehook, thread_hook = (
      sys.excepthook, sys.unraisablehook, threading.excepthook)

  def quiet_excepthook(kind, value, traceback):
    if (threading.current_thread() is threading.main_thread() or
        not _from_saving_code(traceback)):
      excepthook(kind, value, traceback)

  def quiet_unraisablehook(unraisable):
    if not _from_saving_code(unraisable.exc_traceback):
      unraisablehook(unraisable)

  def quiet_thread_hook(args):
    if not _from_saving_code(args.exc_traceback):
      thread_hook(args)

  sys.excepthook = quiet_excepthook
  sys.unraisablehook = quiet_unraisablehook
  threading.excepthook = quiet_thread_hook
  try:
    yield
  finally:
    sys.excepthook, sys.unraisablehook, threading.excepthook = (
        excepthook, unraisablehook, thread_hook)


@contextlib.contextmanager
def silenced() -> Iterator[None]:
  """Inside the block, what failed checkpoint writes and reads print beyond
  the checkpointer's own line is dropped; on leaving it, the hooks, filters
  and warnings filters are the ones found, undone in the reverse order. (A
  command that ends through `cli.leave` never leaves it: what threads of a
  failed save print until the process is gone stays dropped.)"""
  with contextlib.ExitStack() as stack:
    stack.enter_context(_filtered(logging.get_absl_logger(), _OrbaxErrors()))
    stack.enter_context(_filtered(python_logging.getLogger('asyncio'),
                                  _UnretrievedWrites()))
    stack.enter_context(_hooks_without_saving_code())
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings('ignore', _UNAWAITED, RuntimeWarning)
    yield
