"""A run's directory: whether it can be written, whether the run it holds
is already finished, and what it records as it runs.

Checked before the data is loaded (a wrong path costs a second, not a load);
a finished run is recognized by its config.json, summary.json and final
checkpoint, and left as it is. `MetricsWriter` writes metrics.jsonl and
TensorBoard: one event per log point, the same in both; only the writing
process (process 0) writes files, the others get a writer that only logs.
"""

import json
import math
import os
import time
from typing import Any, Mapping, Optional, Sequence

from absl import logging
import jax
import numpy as np
from tensorboardX import event_file_writer
from tensorboardX.proto import event_pb2
from tensorboardX.proto import summary_pb2

from haiku_mp import errors
from haiku_mp.update import state_check
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.settings import fields as settings_fields
from haiku_mp.vit.train import compilation


CONFIG_FILE = 'config.json'
SUMMARY_FILE = 'summary.json'
# Groups that a config.json of an older version holds under another name
# (0.1's `precision.fp8`), read under today's: its run still compares, and
# the lab still takes its settings, where flags take today's names only.
STORED_GROUPS = {'precision.fp8.': 'precision.low_bit.'}


def check_given(workdir: str) -> None:
  """Says in one line that an empty `--workdir=` names no directory (it
  would mean the current one to a path join, and to os.makedirs nothing)."""
  errors.check_given('--workdir', workdir)


def check_writable(workdir: str) -> None:
  """Says in one line why `workdir` could not be made or written, before the
  data is loaded (a wrong path costs a second, not a load), and creates
  nothing: the data may still turn out unusable."""
  errors.check_writable_directory('--workdir', workdir)


def prepare(workdir: str) -> None:
  """Creates the workdir, or says in one line why it cannot be written."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, '.write_test')
    with open(probe, 'w'):
      pass
    os.remove(probe)
  except OSError as e:
    raise errors.ConfigError(f'--workdir={workdir} is not writable '
                             f'({e.strerror})') from None


def config_text(tree: dict[str, Any]) -> str:
  """config.json's text of the settings' tree (`settings.fields.to_dict`)."""
  return json.dumps(tree, indent=1, sort_keys=True) + '\n'


# Settings that change how a run gets its programs, not what it computes: a
# finished run is the same run whatever they say.
_NOT_THE_RUN = (compilation.SETTING, 'steps_in_flight',
                'stall_timeout_sec')
# Changed settings a warning names before it counts the rest.
_CHANGES_NAMED = 4


def finished_summary(settings: settings_lib.Settings, workdir: str
                     ) -> Optional[dict[str, Any]]:
  """The summary of the run `settings` already finished in `workdir`, if it
  did: its summary.json, the same config.json, and the final checkpoint."""
  saved = _saved_config(workdir)
  try:
    with open(os.path.join(workdir, SUMMARY_FILE)) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  same_config = saved is not None and not _changes(
      saved, settings_fields.to_dict(settings))
  final = os.path.join(workdir, 'checkpoints', str(summary.get('steps')))
  if same_config and isinstance(summary, dict) and os.path.isdir(final):
    return summary
  return None


def write_config(workdir: str, settings: settings_lib.Settings) -> None:
  """config.json: what `finished_summary` compares a later start with."""
  write_atomically(
      os.path.join(workdir, CONFIG_FILE),
      config_text(settings_fields.to_dict(settings)))


def flat_settings(tree: Any, prefix: str = '') -> dict[str, Any]:
  """A config.json's tree as dotted settings under today's names:
  {'model': {'embed_dim': 16}} -> {'model.embed_dim': 16}."""
  if not isinstance(tree, dict):
    for old, new in STORED_GROUPS.items():
      prefix = new + prefix[len(old):] if prefix.startswith(old) else prefix
    return {prefix: tree}
  flat = {}
  for key, value in tree.items():
    flat.update(flat_settings(value, f'{prefix}.{key}' if prefix else key))
  return flat


def _saved_config(workdir: str) -> Optional[dict[str, Any]]:
  """The workdir's config.json as {dotted setting: value}, if readable."""
  try:
    with open(os.path.join(workdir, CONFIG_FILE)) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return None
  return flat_settings(saved) if isinstance(saved, dict) else None


def _changes(saved: dict[str, Any], tree: dict[str, Any]
             ) -> list[tuple[str, Any, Any]]:
  now = flat_settings(json.loads(config_text(tree)))
  return [(k, saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
          if saved.get(k) != now.get(k) and k not in _NOT_THE_RUN]


def record_config(settings: settings_lib.Settings, workdir: str,
                  start_step: int) -> None:
  """Warns of the settings this command changes against the run's
  config.json (`describe_changes`), then writes `settings` there."""
  changes = config_changes(settings, workdir)
  if changes:
    logging.warning('%s', describe_changes(changes, workdir, start_step))
  write_config(workdir, settings)


def config_changes(settings: settings_lib.Settings, workdir: str
                   ) -> list[tuple[str, Any, Any]]:
  """(setting, in the workdir's config.json, in `settings`) for each setting
  that differs, the compilation cache's aside; [] without a readable one."""
  saved = _saved_config(workdir)
  return ([] if saved is None else
          _changes(saved, settings_fields.to_dict(settings)))


def describe_changes(changes: list[tuple[str, Any, Any]], workdir: str,
                     start_step: int) -> str:
  """One line: which settings this command changes against the run's
  config.json, and what the run does with them."""
  named = ', '.join(f'{k} {old!r} -> {new!r}'
                    for k, old, new in changes[:_CHANGES_NAMED])
  more = (f' and {len(changes) - _CHANGES_NAMED} more'
          if len(changes) > _CHANGES_NAMED else '')
  return (f'{os.path.join(workdir, CONFIG_FILE)} differs from this '
          f'command\'s config ({named}{more}): this command\'s settings '
          f'apply from step {start_step} on, and config.json now holds them.')


# A run's files written so that a kill or a full disk never leaves one half
# written: JSON-ready values, and atomic replaces.

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
      sum(not state_check.applied(m) for m in window))
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
