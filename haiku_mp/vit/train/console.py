"""The trainer's console: a line per log window with its images/s and ETA
(`Progress`, the run's clock over every segment of a resumed run), the
skipped steps' warnings, the summary line at the end, and `quietly` for
callers that print their own line per run."""

import contextlib
import contextvars
import math
import time
from typing import Any, Callable, Iterator, Mapping, Optional

from absl import logging

from haiku_mp.update import state_check


def log_overflows(window, first_step: int, param_names: list[str],
                   most: int = 5) -> None:
  """Names the parameters whose gradients were not finite at skipped steps
  (or says the Haiku state was not)."""
  for i, m in enumerate(window):
    if state_check.applied(m):
      continue
    if bool(m['grads_finite']):
      logging.warning('step %d skipped (loss scale %g): the new Haiku state '
                      'is not finite', first_step + i, float(m['loss_scale']))
      continue
    bad = [n for n, flag in zip(param_names, m['nonfinite_grads']) if flag]
    more = f' and {len(bad) - most} more' if len(bad) > most else ''
    logging.warning('step %d skipped (loss scale %g): non-finite gradients in '
                    '%s%s', first_step + i, float(m['loss_scale']),
                    ', '.join(bad[:most]), more)


def _percent(value: Optional[float]) -> str:
  return '-' if value is None else f'{100 * value:.2f}%'


def summary_line(summary: Mapping[str, Any], path: str) -> str:
  """The console's last line of a finished run: its figures rounded as the
  progress lines round them; `path` (summary.json) keeps them whole."""
  val_loss = summary.get('val_loss')
  parts = [
      f'test {_percent(summary["test_accuracy"])} '
      f'(loss {summary["test_loss"]:.4f}), val '
      f'{_percent(summary.get("val_accuracy"))}' +
      (f' (loss {val_loss:.4f})' if val_loss is not None else '')]
  if summary.get('ema_test_accuracy') is not None:
    parts.append(f'moving average: test '
                 f'{_percent(summary["ema_test_accuracy"])}, val '
                 f'{_percent(summary.get("ema_val_accuracy"))}')
  parts.append(f'{summary["steps"]} steps, {summary["skipped_steps"]} '
               f'skipped, final loss scale {summary["final_loss_scale"]:g}')
  if summary.get('epsilon') is not None:
    parts.append(f'epsilon {summary["epsilon"]:.2f}')
  parts.append(
      f'{summary["images_per_sec"]:.0f} img/s, train '
      f'{format_duration(summary["train_time_sec"])}, eval '
      f'{format_duration(summary["eval_time_sec"])}')
  return f'Summary: {"; ".join(parts)}. Every figure: {path}'


def log_line(step: int, total: int, summary: Mapping[str, Any],
             progress: Mapping[str, float]) -> str:
  """The console's line for a log window."""
  epsilon = (f'eps {summary["epsilon"]:.2f} ' if 'epsilon' in summary
             else '')
  return (f'step {step}/{total} [{100 * step / total:.0f}%] '
          f'loss {summary["loss"]:.4f} acc {summary["accuracy"]:.3f} '
          f'scale {summary["loss_scale"]:g} skipped {summary["skipped_steps"]} '
          f'{epsilon}| {progress["images_per_sec"]:.0f} img/s '
          f'| ETA {format_duration(progress["eta_sec"])}')


# Whether the trainer's INFO lines are held back (`quietly`): the library's
# own state, per context, where lowering absl's verbosity would change the
# whole process's logging.
_QUIET = contextvars.ContextVar('haiku_mp_trainer_quiet', default=False)


def info(message: str, *args) -> None:
  """One of the trainer's INFO lines (startup, progress, checkpoints,
  evaluation, summary), logged as from its caller's line, unless `quietly`
  holds it back."""
  if _QUIET.get() and logging.get_verbosity() <= logging.INFO:
    return
  logging.info(message, *args, stacklevel=2)


@contextlib.contextmanager
def quietly() -> Iterator[None]:
  """The trainer's INFO lines (`info`) held back inside the block at the
  default verbosity (`--verbosity=1` shows them), for callers that print one
  line per run of their own (the report, the loop benchmark); each run's
  record is in its workdir (metrics.jsonl, summary.json). Warnings, errors
  and every other logger are left as they are."""
  token = _QUIET.set(True)
  try:
    yield
  finally:
    _QUIET.reset(token)


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
