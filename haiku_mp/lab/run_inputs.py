"""What the lab measures on: a run's settings and checkpoint, or init, and the
train batches a run draws, augmented as its train step does. The advisor
(`advisor.driver`) and the studies that start from a run (`lost_updates`,
`ladder`) read them here; nothing here writes a run's directory."""

import contextlib
import json
import os
import time
from typing import Callable, Collection

import jax
import numpy as np

from haiku_mp import errors
from haiku_mp.vit import settings as settings_schema
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.settings import fields as settings_fields
from haiku_mp.vit.train import checkpoint as checkpoint_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import run_dir


def with_run_config(settings: settings_schema.Settings, workdir: str,
                    given: Collection[str] = (),
                    log: Callable[[str], None] = print,
                    command: str = 'advise') -> settings_schema.Settings:
  """`settings` with every field of the run in `workdir` (its config.json, as
  launch.train wrote it: model, data, batch size, precision, loss scale,
  optimizer; what restores its checkpoint and draws its batches), except the
  dotted fields in `given` (set on the command line, they win). A workdir
  without config.json leaves `settings` as they are, and says so."""
  path = os.path.join(workdir, run_dir.CONFIG_FILE)
  if not os.path.isdir(os.path.join(workdir, 'checkpoints')):
    return settings  # Not a run: `run` says so before anything is done.
  if not os.path.exists(path):
    log(f'{command}: no {path}; the config is --config\'s')
    return settings
  return merged_config(settings, path, f'--checkpoint={workdir}', given, log,
                       command)


def merged_config(settings: settings_schema.Settings, path: str, flag: str,
                  given: Collection[str] = (),
                  log: Callable[[str], None] = print,
                  command: str = 'advise') -> settings_schema.Settings:
  """`settings` with every field of the config.json at `path` except those in
  `given`; `flag`, the setting that named the run, heads the one-line error
  when the file cannot be read."""
  try:
    with open(path) as f:
      saved = run_dir.flat_settings(json.load(f))
  except (OSError, ValueError) as e:
    raise errors.ConfigError(f'{flag}: {path} cannot be read ({e})') from None
  tree = settings_fields.to_dict(settings)
  for key, value in saved.items():
    *parents, name = key.split('.')
    holder = tree
    for part in parents:
      holder = holder.get(part) if isinstance(holder, dict) else None
    if key in given or not isinstance(holder, dict) or name not in holder:
      continue  # Set on the command line, or a field no longer in configs.
    holder[name] = value
  # Parsed: config.json's lists become the settings' tuples again.
  merged = settings_schema.parse(tree)
  log(f'{command}: the config of {path}; from the command line: '
      + (', '.join(f'--config.{k}' for k in sorted(given)) or 'nothing'))
  return merged


def initial_state(exp: experiment.Experiment, checkpoint: str,
                  checkpoint_step: int):
  """(state, step, where from): init, or a run's checkpoint (the newest, or
  the newest at or before `checkpoint_step`). Reads and never writes the
  run's directory."""
  if not checkpoint:
    return exp.strategy.init_state(), 0, 'init'
  with contextlib.closing(checkpoint_lib.Checkpointer(checkpoint, 1)) as ckpt:
    restored = ckpt.restore_latest(
        exp.abstract_state,
        max_step=None if checkpoint_step < 0 else checkpoint_step)
  if restored is None:
    raise errors.ConfigError(
        f'--checkpoint={checkpoint}: no checkpoint'
        + (f' at or before step {checkpoint_step}' if checkpoint_step >= 0
           else ''))
  step, state = restored
  return state, step, f'checkpoint {checkpoint} step {step}'


def training_batches(settings: settings_schema.Settings, count: int,
                     start_step: int) -> list[dict[str, np.ndarray]]:
  """The uint8 train batches of steps `start_step` on, as the run draws them."""
  splits = pipeline.load(settings.data, settings.model, settings.seed,
                         settings.batch_size)
  batches = pipeline.train_batches(settings.seed, settings.batch_size,
                                   splits.train, pipeline.Shard(), start_step)
  return [next(batches) for _ in range(count)]


def train_steps(exp: experiment.Experiment, state, batches,
           log: Callable[[str], None]):
  """`state` after the float32 train steps of `batches`."""
  start = time.perf_counter()
  for i, batch in enumerate(batches):
    state, metrics = exp.strategy.train_step(state,
                                             exp.strategy.place_batch(batch))
    if (i + 1) % max(1, len(batches) // 4) == 0 or i + 1 == len(batches):
      log(f'advise: float32 step {i + 1}/{len(batches)} from init, loss '
          f'{float(metrics["loss"]):.4f} ({time.perf_counter() - start:.0f} s)')
  return state


def model_inputs(exp: experiment.Experiment, batches, seed: int):
  """Each batch augmented and normalized as the train step does, keyed per
  batch from `seed`."""
  inputs = jax.jit(exp.train_inputs)
  key = jax.random.key(seed)
  return [inputs(jax.random.fold_in(key, i), batch)
          for i, batch in enumerate(batches)]
