"""Metrics out of a run: metrics.jsonl, TensorBoard, progress lines, memory.

Only the writing process (process 0) writes files; the others get a writer
that only logs.
"""

import json
import math
import os
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import logging
import jax
import numpy as np
from tensorboardX import event_file_writer
from tensorboardX.proto import event_pb2
from tensorboardX.proto import summary_pb2


def to_python(value: Any) -> Any:
  """A JSON-ready number or container (NaN and inf as strings JSON accepts)."""
  if isinstance(value, Mapping):
    return {k: to_python(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_python(v) for v in value]
  value = np.asarray(value).item() if hasattr(value, 'dtype') else value
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


def truncate_after(workdir: str, step: int) -> int:
  """Drops metrics.jsonl events after `step` and every test event, test_ema
  included (a resumed run redoes them; a run resumed at its last step still
  evaluates on test).

  Returns how many were dropped. The file is replaced atomically.
  """
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  kept = []
  for line in lines:
    try:
      event = json.loads(line)
      if event['step'] <= step and not event.get('split', '').startswith(
          'test'):
        kept.append(line.rstrip('\n') + '\n')
    except (ValueError, KeyError):
      pass  # A line cut short by a kill.
  write_atomically(path, ''.join(kept))
  return len(lines) - len(kept)


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
  """The scalar metrics as floats, inf and NaN included (never dropped)."""
  numbers = {}
  for key, value in metrics.items():
    value = np.asarray(value).item() if hasattr(value, 'dtype') else value
    if isinstance(value, (int, float)):
      numbers[key] = float(value)
  return numbers


class MetricsWriter:
  """Appends one JSON object per event to metrics.jsonl and to TensorBoard.

  Events go through tensorboardX's synchronous `EventsWriter`, not its
  `SummaryWriter`, whose `flush` returns with events still in its queue (and
  not TensorBoard's own writer, which imports TensorFlow): `flush()` before a
  checkpoint then puts on disk every point that checkpoint covers. Each writer
  opens with a SessionLog.START event at `start_step + 1`, which tells
  TensorBoard to drop the points of an earlier, killed run from that step on:
  after a resume it shows exactly what metrics.jsonl holds.
  """

  def __init__(self, workdir: str, enabled: bool = True, start_step: int = 0):
    self._jsonl = None
    self._tensorboard = None
    if not enabled:
      return
    self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a')
    logdir = os.path.join(workdir, 'tensorboard')
    os.makedirs(logdir, exist_ok=True)
    # TensorBoard reads event files in name order, and the name starts with
    # the second the writer opened: the step it starts from, then the pid,
    # order (and keep apart) writers opened in the same second, as a resume
    # soon after a stop is.
    self._tensorboard = event_file_writer.EventsWriter(
        os.path.join(logdir, 'events'),
        filename_suffix=f'.{start_step:010d}.{os.getpid()}')
    self._tensorboard.write_event(event_pb2.Event(
        wall_time=time.time(), step=start_step + 1,
        session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    self._tensorboard.flush()

  def write(self, step: int, split: str, metrics: Mapping[str, Any]) -> None:
    record = dict(step=int(step), split=split, **to_python(metrics))
    if self._jsonl is not None:
      try:
        self._jsonl.write(json.dumps(record) + '\n')
        self._jsonl.flush()
      except OSError as e:  # A full disk: the error names the file.
        raise OSError(e.errno, e.strerror, self._jsonl.name) from None
    if self._tensorboard is not None:
      summary = summary_pb2.Summary(value=[
          summary_pb2.Summary.Value(tag=f'{split}/{key}', simple_value=value)
          for key, value in _numbers(metrics).items()])
      self._tensorboard.write_event(event_pb2.Event(
          wall_time=time.time(), step=int(step), summary=summary))

  def flush(self) -> None:
    """Puts every event written so far on disk (call before a checkpoint)."""
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


def write_atomically(path: str, text: str) -> None:
  """A temp file renamed over `path`: a kill leaves the old or the new file,
  and so does a failed write (a full disk), whose OSError names `path`."""
  tmp = f'{path}.tmp'
  try:
    with open(tmp, 'w') as f:
      f.write(text)
    os.replace(tmp, path)
  except OSError as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise OSError(e.errno, e.strerror, path) from None


def write_json(path: str, data: Mapping[str, Any]) -> None:
  """Writes `data` atomically."""
  write_atomically(path, json.dumps(to_python(data), indent=1) + '\n')


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


def peak_memory_bytes() -> Optional[int]:
  """The largest peak bytes in use over local devices, where reported."""
  peaks = []
  for device in jax.local_devices():
    stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
    if stats and 'peak_bytes_in_use' in stats:
      peaks.append(int(stats['peak_bytes_in_use']))
  return max(peaks) if peaks else None


# ------------------------------------------------------------ log windows --


def _mean_of_kept(values) -> float:
  """The mean of the values that are not NaN; NaN, without numpy's warning,
  when a whole window of steps was skipped."""
  values = np.asarray(values, np.float64)
  kept = values[~np.isnan(values)]
  return float(kept.mean()) if kept.size else float('nan')


def window_summary(window: list[dict[str, Any]], means: Sequence[str]
                   ) -> dict[str, float]:
  """Host summary of the metrics of the steps since the last log point:
  `means` averaged (each over the steps that have it: a resumed run's first
  window starts with the steps its checkpoint kept, which a run of another
  config may have saved, without DP-SGD's metrics, say), the loss scale and
  skipped steps as they stand."""
  summary = {k: _mean_of_kept([m[k] for m in window if k in m])
             for k in means}
  last = window[-1]
  summary['loss_scale'] = float(last['loss_scale'])
  summary['skipped_steps'] = int(last['skipped_steps'])
  summary['window_skipped_steps'] = int(
      sum(not bool(m['grads_finite']) for m in window))
  return summary


def window_record(window: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The host metrics of a log window's steps as JSON-ready values (arrays
  as lists, NaN and inf kept as floats): what a checkpoint keeps of the
  steps since the last log point, for the run that resumes from it."""
  return [{k: np.asarray(v).tolist() for k, v in m.items()} for m in window]


def window_from_record(record: Sequence[Mapping[str, Any]]
                       ) -> list[dict[str, np.ndarray]]:
  """`window_record`'s steps as host metrics again, every value as it was
  (a float32 value comes back as the same number in float64, which is how
  `window_summary` averages it)."""
  return [{k: np.asarray(v) for k, v in m.items()} for m in record]


def log_overflows(window, first_step: int, param_names: list[str],
                   most: int = 5) -> None:
  """Names the parameters whose gradients were not finite at skipped steps."""
  for i, m in enumerate(window):
    if bool(m['grads_finite']):
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
  parts.append(f'{summary["images_per_sec"]:.0f} img/s, train '
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
