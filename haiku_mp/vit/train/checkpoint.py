"""TrainState checkpoints with orbax: atomic saves, keep-last-K, safe restore.

orbax writes each checkpoint to a temporary directory and renames it when it
is complete, so a process killed mid-save leaves no checkpoint that restores
wrongly. A checkpoint that cannot be restored (truncated, or from a model of
another shape) is skipped with a warning for the one before it; the trainer
then sets it aside (renamed, never deleted) so that the step can be saved
again. If none restores, the run stops with an error naming the directory.
A save that fails (a full disk) is one error naming the step and the last
good checkpoint. PRNG keys are stored as their raw key data. What orbax's
threads print after a failed write is theirs to print: the library leaves
the process's hooks and loggers alone (`launch/failed_saves.py` quiets them
for the commands).

Each step holds two orbax items: `default`, the TrainState, and `run`, a small
JSON record of the run so far (its train and eval time, and the metrics of
the steps since the last log point), so that a run resumed any number of
times still reports figures for the whole run, and logs the windows an
uninterrupted run does.
Checkpoints without a `run` item (older ones) restore with an empty record.
"""

import dataclasses
import os
import re
import time
from typing import Any, Callable, NamedTuple, Optional, Union

from absl import logging
import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from haiku_mp import errors
from haiku_mp.update import train_state
from haiku_mp.vit.train import console


TrainState = train_state.TrainState
# The suffix of a step directory that could not be restored and was set aside.
UNRESTORABLE = '.unrestorable'
_STATE, _RUN = 'default', 'run'


class CheckpointError(errors.ConfigError):
  """No usable checkpoint where one is expected; names the directory."""


class _WithoutModelState(NamedTuple):
  """A TrainState as a model without Haiku state stores it: the fields
  checkpoints held before `TrainState.model_state`, so that those restore
  and new ones are the same."""
  step: Any
  params: Any
  opt_state: Any
  loss_scale: Any
  rng: Any
  skipped_steps: Any


def _storable(state: TrainState) -> Union[TrainState, _WithoutModelState]:
  """`state` as orbax stores it (`rng` already as key data): without its
  `model_state` when that is empty."""
  if state.model_state:
    return state
  return _WithoutModelState(*state[:len(_WithoutModelState._fields)])


def _to_storable(state: TrainState) -> Union[TrainState, _WithoutModelState]:
  return _storable(state._replace(rng=jax.random.key_data(state.rng)))


def _from_storable(stored: Union[TrainState, _WithoutModelState]
                   ) -> TrainState:
  """Keys come from `jax.random.key`: the default implementation."""
  state = (stored if isinstance(stored, TrainState)
           else TrainState(*stored, model_state={}))
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
  if not stored:
    return 'its metadata is missing or unreadable'
  for name, shape in wanted.items():
    if name not in stored:
      return f'it has no {name}'
    if stored[name] != shape:
      return (f'{name} has shape {stored[name]}, this model expects {shape}')
  extra = sorted(set(stored) - set(wanted))
  return f'it has {extra[0]}, which this model lacks' if extra else None


def _describe(error: BaseException) -> str:
  """One short line for an exception out of orbax or TensorStore, whose
  messages can run over many lines and end in a bound method's repr."""
  text = ' '.join(str(error).split())
  os_error = re.search(r':\s*([^:\[]+?)\s*\[os_error_code', text)
  if os_error:  # TensorStore's write error: the OS's reason says it all.
    return os_error.group(1)
  # orbax's read error ends "See full TensorStore details: <the array's
  # spec>": the array it could not read is the detail worth a line.
  array = re.findall(r"'path': '([^/'][^']*?)/?'", text)
  if array and 'error while reading array' in text:
    return f'its array {array[-1]} cannot be read: damaged or cut short'
  for cut in (' <bound method', ' [source locations'):
    text = text.split(cut)[0]
  text = text[:160].rstrip(' ,:;')
  return f'{type(error).__name__}: {text}' if text else type(error).__name__


def _set_aside(path: str) -> str:
  """Renames `path` to the first free `path.unrestorable[-N]`."""
  target, n = path + UNRESTORABLE, 1
  while os.path.exists(target):
    n += 1
    target = f'{path}{UNRESTORABLE}-{n}'
  os.rename(path, target)
  return target


@dataclasses.dataclass
class _Write:
  """A save whose files are still being written in the background."""
  step: int
  start: float  # The clock when it started.
  blocking_sec: float = 0.0  # How long it held the loop.


class Checkpointer:
  """Saves and restores `TrainState`s under `workdir/checkpoints`."""

  def __init__(self, workdir: str, keep: int, *,
               clock: Callable[[], float] = time.perf_counter,
               ready: Callable[[Any], Any] = jax.block_until_ready):
    """`clock` times the saves for the log; `ready` waits for the state's
    steps still queued on the device (a test's own, to see the order)."""
    self._clock, self._ready = clock, ready
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, 'checkpoints')
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={_STATE: ocp.StandardCheckpointHandler(),
                       _RUN: ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=True))
    self._in_flight: Optional[_Write] = None

  def all_steps(self) -> list[int]:
    self.wait()
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: TrainState,
           run: Optional[dict[str, Any]] = None) -> None:
    """Starts saving `state` and the JSON-ready `run` record (a no-op if
    `step` is already saved); returns once the state is copied off the
    device, its files written in the background (orbax's async save) while
    training goes on. `poll` or `wait` finishes it.

    The time logged is the save's own: `state` is made ready first, so the
    steps still queued on the device are not counted. A failed write raises
    `errors.RunError` naming the workdir, the step and the last good
    checkpoint, from this call or from the `poll` or `wait` that finds it.
    """
    if step in self._manager.all_steps():
      return
    self.wait()
    state = self._ready(state)
    start = self._clock()
    self._in_flight = _Write(step, start)
    try:
      self._manager.save(step, args=ocp.args.Composite(**{
          _STATE: ocp.args.StandardSave(_to_storable(state)),
          _RUN: ocp.args.JsonSave(run or {})}))
    except Exception as e:  # pylint: disable=broad-except
      self._failed(e)
    self._in_flight.blocking_sec = self._clock() - start

  def _failed(self, error: Exception):
    step = self._in_flight.step
    self._in_flight = None
    last = max((s for s in self._manager.all_steps() if s != step),
               default=None)
    raise errors.RunError(
        f'--workdir={self.workdir}: could not save the checkpoint of step '
        f'{step} ({_describe(error)}); the last good checkpoint is '
        + (f'step {last}' if last is not None else 'none')
        + '. Free space (or fix the cause) and run the same command to '
        'resume.') from None

  def wait(self) -> None:
    """Waits for the save in flight, if any (before a stop: the checkpoint
    is then on disk); logs it, or raises its failure."""
    if self._in_flight is None:
      return
    write = self._in_flight
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as e:  # pylint: disable=broad-except
      self._failed(e)
    self._in_flight = None
    # Found done at a log point: the write took at most this long.
    console.info(
        'Saved checkpoint %s/%d (off the device in %.2fs, its files '
        'written in the background within %.1fs).', self.directory,
        write.step, write.blocking_sec, self._clock() - write.start)

  def poll(self) -> None:
    """`wait` if the save in flight is done (free: no wait, no device op)."""
    if self._in_flight is not None and not (
        self._manager.is_saving_in_progress()):
      self.wait()

  def run_record(self, step: int) -> dict[str, Any]:
    """The `run` record saved with `step`; {} for checkpoints without one."""
    self.wait()
    if not os.path.isdir(os.path.join(self.directory, str(step), _RUN)):
      return {}
    restored = self._manager.restore(step, args=ocp.args.Composite(
        **{_RUN: ocp.args.JsonRestore()}))
    return dict(restored[_RUN] or {})

  def _problem(self, step: int, target: TrainState
               ) -> tuple[Optional[str], Optional[TrainState]]:
    """(None, state) if `step` restores into `target`, else (why not, None)."""
    try:
      metadata = self._manager.item_metadata(step)
      tree = metadata.get(_STATE) if metadata is not None else None
      problem = _first_mismatch(
          _shapes(getattr(tree, 'tree', tree) or {}), _shapes(target))
      if problem is not None:
        return problem, None
      restored = self._manager.restore(step, args=ocp.args.Composite(
          **{_STATE: ocp.args.StandardRestore(target)}))
      return None, restored[_STATE]
    except Exception as e:  # pylint: disable=broad-except
      logging.vlog(1, 'Checkpoint %s/%d: %s', self.directory, step, e)
      return f'unreadable: {_describe(e)}', None

  def restore_latest(self, abstract_state: TrainState,
                     max_step: Optional[int] = None,
                     set_aside_unrestorable: bool = False
                     ) -> Optional[tuple[int, TrainState]]:
    """The newest checkpoint (at or before `max_step`, if given) that
    restores into `abstract_state`'s layout.

    `abstract_state` (from `jax.eval_shape`, shardings attached where needed)
    fixes shapes, dtypes and placement. None if there is no checkpoint. With
    `set_aside_unrestorable` (a run that will save over those steps again),
    the newer step directories that failed are renamed `STEP.unrestorable`.
    """
    steps = [s for s in self.all_steps() if max_step is None or s <= max_step]
    if not steps:
      return None
    key_data = jax.eval_shape(jax.random.key_data, abstract_state.rng)
    target = _storable(abstract_state._replace(rng=jax.ShapeDtypeStruct(
        key_data.shape, key_data.dtype,
        sharding=getattr(abstract_state.rng, 'sharding', None))))
    failures = []
    for step in reversed(steps):
      problem, restored = self._problem(step, target)
      if problem is None:
        if set_aside_unrestorable and failures:
          self._set_aside([s for s, _ in failures])
        return step, _from_storable(restored)
      failures.append((step, problem))
      logging.warning('Checkpoint %s/%d cannot be restored (%s); trying the '
                      'one before.', self.directory, step, problem)
    raise CheckpointError(
        f'no checkpoint in {self.directory} can be restored ('
        + '; '.join(f'step {s}: {p}' for s, p in failures)
        + f'). Move {self.directory} aside (or delete it) to train this run '
        'again from step 0, or give another --workdir; --verbosity=1 logs '
        "TensorStore's full errors")

  def _set_aside(self, steps: list[int]) -> None:
    """Renames the step directories (process 0; every process waits for it)
    and has orbax forget them, so that those steps can be saved again."""
    if jax.process_index() == 0:
      for step in steps:
        moved = _set_aside(os.path.join(self.directory, str(step)))
        logging.warning('Set the unrestorable checkpoint of step %d aside as '
                        '%s; it will be saved again.', step, moved)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('haiku_mp: checkpoints set aside')
    self._manager.reload()

  def close(self) -> None:
    """Waits for the save in flight (raising its failure), then closes.

    orbax's own closing waits for its metadata writes, which fail too when
    the save did (a full disk): the save's error is the one raised, not a
    second one from orbax.
    """
    failure = None
    try:
      self.wait()
    except errors.RunError as e:
      failure = e
    try:
      self._manager.close()
    except Exception as e:  # pylint: disable=broad-except
      if failure is None:
        failure = errors.RunError(
            f'--workdir={self.workdir}: could not finish writing the '
            f'checkpoints in {self.directory} ({_describe(e)}). Free space '
            '(or fix the cause) and run the same command to resume.')
    if failure is not None:
      raise failure
