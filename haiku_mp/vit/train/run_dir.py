"""A run's directory: whether it can be written, and whether the run it
holds is already finished.

Checked before the data is loaded (a wrong path costs a second, not a load);
a finished run is recognized by its config.json, summary.json and final
checkpoint, and left as it is.
"""

import json
import math
import os
from typing import Any, Mapping, Optional

from absl import logging
import numpy as np

from haiku_mp import errors
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.settings import fields as settings_fields
from haiku_mp.vit.train import compilation

CONFIG_FILE = 'config.json'
SUMMARY_FILE = 'summary.json'


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
  """A config.json's tree as dotted settings: {'model': {'embed_dim': 16}}
  -> {'model.embed_dim': 16}."""
  if not isinstance(tree, dict):
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
