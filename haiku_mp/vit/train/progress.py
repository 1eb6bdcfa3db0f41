"""The run's clock: images/s between log points, the ETA, and its train and
eval time over every segment of a resumed run."""

import math
import time
from typing import Callable, Mapping, Optional


def format_duration(seconds: float) -> str:
  if not math.isfinite(seconds):
    return '?'
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f'{hours}h{minutes:02d}m{seconds:02d}s' if hours else (
      f'{minutes}m{seconds:02d}s')


class Progress:
  """Images/s between log points, the ETA, and the run's train and eval time
  over all of its segments (a resumed run starts from its checkpoint's
  `record()`).

  The train clock runs only between `start` and `stop`: compilation,
  evaluation and checkpointing stay out of every rate. Call `stop` once the
  device has finished the steps up to `step` (after a transfer or a
  `block_until_ready`), or their time would count as the next pause's.
  """

  def __init__(self, total_steps: int, batch_size: int, start_step: int = 0,
               record: Optional[Mapping[str, float]] = None,
               clock: Callable[[], float] = time.perf_counter):
    """`clock`: seconds from any origin (a test's own clock)."""
    record = record or {}
    self._clock = clock
    self.total_steps = total_steps
    self.batch_size = batch_size
    self._train_seconds = float(record.get('train_sec', 0.0))
    self._train_steps = int(record.get('train_steps', 0))
    self.eval_seconds = float(record.get('eval_sec', 0.0))
    self._window_seconds, self._window_steps = 0.0, 0
    self._step, self._time = start_step, None
    self._host = dict(waiting_for_batch=0.0, in_step_call=0.0)
    self._host_steps = 0

  def start(self, step: int) -> None:
    """Starts the train clock after `step` (after compiling, an evaluation,
    a checkpoint)."""
    self._step, self._time = step, self._clock()

  def stop(self, step: int) -> None:
    """Adds the steps up to `step` and their time to the window and the run;
    a no-op when the clock is not running."""
    if self._time is None:
      return
    seconds = self._clock() - self._time
    steps = step - self._step
    self._window_seconds += seconds
    self._window_steps += steps
    self._train_seconds += seconds
    self._train_steps += steps
    self._step, self._time = step, None

  def update(self, step: int) -> dict[str, float]:
    """Call at a log point, after the metrics have reached the host: the
    window's images/s and the ETA; the clock goes on running."""
    self.stop(step)
    steps, seconds = self._window_steps, self._window_seconds
    self._window_seconds, self._window_steps = 0.0, 0
    self.start(step)
    rate = steps / seconds if seconds > 0 else float('nan')
    return dict(images_per_sec=rate * self.batch_size,
                eta_sec=(self.total_steps - step) / rate if rate > 0 else
                float('nan'))

  def host_time(self, waiting_for_batch: float, in_step_call: float) -> None:
    """Adds one step's host time: waiting for its batch, then in its call.

    Where a run is slower than its compiled step, these say whether the host
    waited for data or in the call (a full dispatch queue, or a call that
    does not return before the device is done).
    """
    self._host['waiting_for_batch'] += waiting_for_batch
    self._host['in_step_call'] += in_step_call
    self._host_steps += 1

  def host_ms_per_step(self) -> dict[str, Optional[float]]:
    """Milliseconds per step of each `host_time` part, over the steps this
    process ran since it started (not the whole run's); None if it ran none."""
    steps = self._host_steps
    return {k: 1e3 * v / steps if steps else None
            for k, v in self._host.items()}

  @property
  def train_seconds(self) -> float:
    return self._train_seconds

  @property
  def mean_images_per_sec(self) -> float:
    if not self._train_seconds:
      return float('nan')
    return self._train_steps * self.batch_size / self._train_seconds

  def record(self) -> dict[str, float]:
    """What a checkpoint keeps so that a resumed run reports the whole run."""
    return dict(train_sec=self._train_seconds, train_steps=self._train_steps,
                eval_sec=self.eval_seconds)
