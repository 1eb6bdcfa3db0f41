"""SIGTERM and Ctrl-C: a run stopped at a step every process agrees on,
after a checkpoint (`Interruption`), and the line it stops with."""

import signal
from typing import Any, Callable, Optional

from absl import logging
import jax
import numpy as np

from haiku_mp.vit.parallel import stop_request


Batch = dict[str, np.ndarray]


class Interruption:
  """SIGTERM or a first Ctrl-C on any process stops every process after the
  same step, with a checkpoint; a second Ctrl-C stops at once, unsaved.

  One process stops after the step it is dispatching when its own flag is
  seen, which the loop looks at after every step: with `steps_in_flight`
  steps ahead of the devices, the save holds that many steps more than the
  one running when the signal came. Several processes agree without a host
  sync of their own: each train batch carries its process's flag, set as the
  step is dispatched (`tag`), the step reduces the flags of the whole global
  batch into its `stop_requested` metric, and every process reads that
  metric from the same finished step, so all stop after the same step; a
  scheduler may signal only some of them, and one that stopped to save alone
  would leave the others waiting in the next step's collectives. A context
  manager: the previous handlers are back on every exit path.
  """

  _SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received = None  # The name of the first signal, e.g. 'SIGINT'.
    self._previous = {}
    self._several = jax.process_count() > 1

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
    if self.received is not None:
      return
    self.received = signal.Signals(signum).name
    if signum == signal.SIGINT:
      logging.warning('Ctrl-C: finishing the steps under way, then saving a '
                      'checkpoint (Ctrl-C again stops at once, without '
                      'saving).')
    else:
      logging.warning('%s: finishing the steps under way, then saving a '
                      'checkpoint and stopping.', self.received)

  def tag(self, batch: dict[str, Any], place: Callable[[Batch], Any],
          local_shards: int) -> dict[str, Any]:
    """`batch` (placed) with this process's stop request when the run has
    several processes, one flag per batch shard it holds (`local_shards`,
    placed by `place`, as a batch is); as it is for one process."""
    if not self._several:
      return batch
    flags = np.full(local_shards, self.received is not None)
    return dict(batch, **place({stop_request.STOP_REQUEST: flags}))

  def stop_after(self, finished_metrics: Optional[dict]) -> bool:
    """Whether to checkpoint and stop after the step just dispatched, the
    same on every process. `finished_metrics`: the device metrics of the
    newest step known finished (None before the first), whose
    `stop_requested` decides for several processes (a copy of a value that
    is ready: no wait)."""
    if not self._several:
      return self.received is not None
    if finished_metrics is None:
      return False
    # This process's copy of the replicated flag (global arrays of several
    # processes are read shard by shard).
    flag = finished_metrics['stop_requested'].addressable_shards[0].data
    return bool(np.any(np.asarray(flag)))


def stop_line(signal_name: str, step: int) -> str:
  by = 'Ctrl-C (SIGINT)' if signal_name == 'SIGINT' else signal_name
  return (f'{by}: saved a checkpoint at step {step}; stopping. Run the same '
          'command to resume.')
