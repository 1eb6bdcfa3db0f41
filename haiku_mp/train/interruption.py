"""Stopping a run on a signal: SIGTERM or Ctrl-C save a checkpoint first."""

import signal

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np


class Interruption:
  """SIGTERM or a first Ctrl-C on any process stops every process after the
  same step, with a checkpoint; a second Ctrl-C stops at once, unsaved.

  One process checks its own flag after every step. Several decide together
  at log points, in a collective all of them take part in: a scheduler may
  signal only some of them, and one that stopped to save alone would leave the
  others waiting in the next step's collectives (and the save's barrier).
  A context manager: the previous handlers are back on every exit path.
  """

  _SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, log_every_steps: int):
    self._log_every_steps = log_every_steps
    self.received = None  # The name of the first signal, e.g. 'SIGINT'.
    self._previous = {}

  def __enter__(self):
    for signum in self._SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum, frame):
    del frame
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt('a second Ctrl-C: stopped at once, without '
                              'saving; the newest checkpoint is kept')
    if self.received is None:
      self.received = signal.Signals(signum).name
    if signum == signal.SIGINT:
      logging.warning('Ctrl-C: finishing this step, then saving a checkpoint '
                      '(Ctrl-C again stops at once, without saving).')

  def stop_after(self, step: int) -> bool:
    """Whether to checkpoint and stop after `step` (the same on every process)."""
    if jax.process_count() == 1:
      return self.received is not None
    if step % self._log_every_steps:
      return False
    flags = multihost_utils.process_allgather(
        np.int32(self.received is not None))
    return bool(np.max(flags))


def stop_line(signal_name: str, step: int) -> str:
  by = 'Ctrl-C (SIGINT)' if signal_name == 'SIGINT' else signal_name
  return (f'{by}: saved a checkpoint at step {step}; stopping. Run the same '
          'command to resume.')
