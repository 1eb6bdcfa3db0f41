"""TrainState checkpoints with orbax: atomic saves, keep-last-K, safe restore.

orbax writes each checkpoint to a temporary directory and renames it when it
is complete, so a process killed mid-save leaves no checkpoint that restores
wrongly. A checkpoint that cannot be restored (truncated, or from a model of
another shape) is skipped with a warning for the one before it; if none
restores, the run stops with an error naming the directory. PRNG keys are
stored as their raw key data.
"""

import os
from typing import Optional

from absl import logging
import jax
import orbax.checkpoint as ocp

from haiku_mp import errors
from haiku_mp import train_step as train_step_lib

TrainState = train_step_lib.TrainState


class CheckpointError(errors.ConfigError):
  """No usable checkpoint where one is expected; names the directory."""


def _to_storable(state: TrainState) -> TrainState:
  return state._replace(rng=jax.random.key_data(state.rng))


def _from_storable(state: TrainState) -> TrainState:
  """Keys come from `jax.random.key`: the default implementation."""
  return state._replace(rng=jax.random.wrap_key_data(state.rng))


def _first_shape_mismatch(restored, target) -> Optional[str]:
  """Where a restored tree differs from the expected shapes, if anywhere."""
  got = jax.tree_util.tree_flatten_with_path(restored)[0]
  want = jax.tree_util.tree_flatten_with_path(target)[0]
  if len(got) != len(want):
    return f'{len(got)} arrays where the model has {len(want)}'
  for (path, a), (_, b) in zip(got, want):
    if tuple(a.shape) != tuple(b.shape):
      return (f'{jax.tree_util.keystr(path)} has shape {tuple(a.shape)}, the '
              f'model expects {tuple(b.shape)}')
  return None


class Checkpointer:
  """Saves and restores `TrainState`s under `workdir/checkpoints`."""

  def __init__(self, workdir: str, keep: int):
    if keep < 1:
      raise errors.ConfigError(f'keep_checkpoints={keep} must be at least 1')
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=False))

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: TrainState) -> None:
    """Saves (blocking); a no-op if `step` is already saved."""
    if step in self._manager.all_steps():
      return
    self._manager.save(step, args=ocp.args.StandardSave(_to_storable(state)))
    self._manager.wait_until_finished()

  def restore_latest(self, abstract_state: TrainState
                     ) -> Optional[tuple[int, TrainState]]:
    """The newest checkpoint that restores into `abstract_state`'s layout.

    `abstract_state` (from `jax.eval_shape`, shardings attached where needed)
    fixes shapes, dtypes and placement. None if there is no checkpoint.
    """
    steps = self.all_steps()
    if not steps:
      return None
    key_data = jax.eval_shape(jax.random.key_data, abstract_state.rng)
    target = abstract_state._replace(rng=jax.ShapeDtypeStruct(
        key_data.shape, key_data.dtype,
        sharding=getattr(abstract_state.rng, 'sharding', None)))
    failures = []
    for step in reversed(steps):
      try:
        restored = self._manager.restore(
            step, args=ocp.args.StandardRestore(target))
      except Exception as e:  # pylint: disable=broad-except
        failures.append(f'step {step}: {type(e).__name__}: {e}'.splitlines()[0])
        logging.warning('Checkpoint %s/%d cannot be restored (%s); trying '
                        'the one before.', self.directory, step, failures[-1])
        continue
      mismatch = _first_shape_mismatch(restored, target)
      if mismatch:
        failures.append(f'step {step}: {mismatch}')
        logging.warning('Checkpoint %s/%d does not fit this model (%s).',
                        self.directory, step, mismatch)
        continue
      return step, _from_storable(restored)
    raise CheckpointError(
        f'no checkpoint in {self.directory} can be restored: '
        + '; '.join(failures))

  def close(self) -> None:
    self._manager.close()
