"""A run's directory: whether it can be written, and whether the run it
holds is already finished.

Checked before the data is loaded (a wrong path costs a second, not a load);
a finished run is recognized by its config.json, summary.json and final
checkpoint, and left as it is.
"""

import json
import os
from typing import Any, Optional

import ml_collections

from haiku_mp import errors
from haiku_mp.train import compilation_cache

CONFIG_FILE = 'config.json'
SUMMARY_FILE = 'summary.json'


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


def config_text(config: ml_collections.ConfigDict) -> str:
  return config.to_json_best_effort(indent=1, sort_keys=True) + '\n'


# Settings that change how a run gets its programs, not what it computes: a
# finished run is the same run whatever they say.
_NOT_THE_RUN = (compilation_cache.SETTING,)


def _same_run(config_json: str, config: ml_collections.ConfigDict) -> bool:
  try:
    saved = json.loads(config_json)
  except ValueError:
    return False
  now = json.loads(config_text(config))
  for setting in _NOT_THE_RUN:
    saved.pop(setting, None)
    now.pop(setting, None)
  return saved == now


def finished_summary(config: ml_collections.ConfigDict, workdir: str
                     ) -> Optional[dict[str, Any]]:
  """The summary of the run `config` already finished in `workdir`, if it
  did: its summary.json, the same config.json, and the final checkpoint."""
  try:
    with open(os.path.join(workdir, CONFIG_FILE)) as f:
      same_config = _same_run(f.read(), config)
    with open(os.path.join(workdir, SUMMARY_FILE)) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  final = os.path.join(workdir, 'checkpoints', str(summary.get('steps')))
  if same_config and isinstance(summary, dict) and os.path.isdir(final):
    return summary
  return None


def write_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """config.json: what `finished_summary` compares a later start with."""
  with open(os.path.join(workdir, CONFIG_FILE), 'w') as f:
    f.write(config_text(config))
