"""TrainState checkpoints with orbax: atomic saves, keep-last-K, safe restore.

orbax writes each checkpoint to a temporary directory and renames it when it
is complete, so a process killed mid-save leaves no checkpoint that restores
wrongly. A checkpoint that cannot be restored (truncated, or from a model of
another shape) is skipped with a warning for the one before it; if none
restores, the run stops with an error naming the directory. PRNG keys are
stored as their raw key data.
"""

import os
import time
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


def _name(path) -> str:
  """orbax's name of a leaf: attribute, key or index names joined by '.'."""
  return '.'.join(str(getattr(k, 'name', getattr(k, 'key', getattr(k, 'idx', k))))
                  for k in path)


def _shapes(tree) -> dict[str, tuple[int, ...]]:
  return {_name(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _first_mismatch(stored: dict, wanted: dict) -> Optional[str]:
  """Where a checkpoint's arrays differ from the model's, if anywhere."""
  for name, shape in wanted.items():
    if name not in stored:
      return f'it has no {name}'
    if stored[name] != shape:
      return (f'{name} has shape {stored[name]}, this model expects {shape}')
  extra = sorted(set(stored) - set(wanted))
  return f'it has {extra[0]}, which this model lacks' if extra else None


class Checkpointer:
  """Saves and restores `TrainState`s under `workdir/checkpoints`."""

  def __init__(self, workdir: str, keep: int):
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
    start = time.perf_counter()
    self._manager.save(step, args=ocp.args.StandardSave(_to_storable(state)))
    self._manager.wait_until_finished()
    logging.info('Saved checkpoint %s/%d (%.1fs).', self.directory, step,
                 time.perf_counter() - start)

  def restore_latest(self, abstract_state: TrainState,
                     max_step: Optional[int] = None
                     ) -> Optional[tuple[int, TrainState]]:
    """The newest checkpoint (at or before `max_step`, if given) that
    restores into `abstract_state`'s layout.

    `abstract_state` (from `jax.eval_shape`, shardings attached where needed)
    fixes shapes, dtypes and placement. None if there is no checkpoint.
    """
    steps = [s for s in self.all_steps() if max_step is None or s <= max_step]
    if not steps:
      return None
    key_data = jax.eval_shape(jax.random.key_data, abstract_state.rng)
    target = abstract_state._replace(rng=jax.ShapeDtypeStruct(
        key_data.shape, key_data.dtype,
        sharding=getattr(abstract_state.rng, 'sharding', None)))
    wanted = _shapes(target)
    failures = []
    for step in reversed(steps):
      path = os.path.join(self.directory, str(step), 'default')
      try:
        metadata = ocp.StandardCheckpointer().metadata(path)
        tree = getattr(metadata, 'item_metadata', metadata)
        problem = _first_mismatch(_shapes(getattr(tree, 'tree', tree)), wanted)
        if problem is None:
          restored = self._manager.restore(
              step, args=ocp.args.StandardRestore(target))
      except Exception as e:  # pylint: disable=broad-except
        problem = f'{type(e).__name__}: {e}'.splitlines()[0][:200]
      if problem is None:
        return step, _from_storable(restored)
      failures.append(f'step {step}: {problem}')
      logging.warning('Checkpoint %s/%d cannot be restored (%s); trying the '
                      'one before.', self.directory, step, problem)
    raise CheckpointError(
        f'no checkpoint in {self.directory} can be restored: '
        + '; '.join(failures))

  def close(self) -> None:
    self._manager.close()
