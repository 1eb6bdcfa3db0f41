"""metrics.jsonl and TensorBoard: one event per log point, the same in both.

Only the writing process (process 0) writes files; the others get a writer
that only logs.
"""

import json
import os
import time
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from tensorboardX import event_file_writer
from tensorboardX.proto import event_pb2
from tensorboardX.proto import summary_pb2

from haiku_mp.vit.train import run_dir

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
  run_dir.write_atomically(path, ''.join(kept))
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
    record = dict(step=int(step), split=split, **run_dir.to_python(metrics))
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


# The steps since the last log point: their host metrics summarized, and kept
# in a checkpoint for the run that resumes from it.

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


# What the devices report of their memory.

def peak_memory_bytes() -> Optional[int]:
  """The largest peak bytes in use over local devices, where reported."""
  peaks = []
  for device in jax.local_devices():
    stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
    if stats and 'peak_bytes_in_use' in stats:
      peaks.append(int(stats['peak_bytes_in_use']))
  return max(peaks) if peaks else None
