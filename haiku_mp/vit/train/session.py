"""One session of a run (fresh, or resumed from its newest checkpoint),
opened in an ExitStack: the resources it owns (the signal handlers, the
checkpointer, the in-flight watch, the metrics writer), where it stands (the
step it started from, the state, the last val metrics), its saves and
evaluations, and the run's summary at the end. `loop` drives it, step by
step.
"""

import contextlib
from typing import Any, Iterator, TypeVar

from absl import logging
import jax

from haiku_mp.model import meta_params
from haiku_mp.update import moving_average
from haiku_mp.update import train_state
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.train import checkpoint
from haiku_mp.vit.train import console
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import in_flight
from haiku_mp.vit.train import interruption
from haiku_mp.vit.train import run_dir


# A run's resources closed on leaving its ExitStack, the first failure kept.

_Resource = TypeVar('_Resource')


@contextlib.contextmanager
def closed_on_exit(resource: _Resource) -> Iterator[_Resource]:
  """Closes `resource` on leaving the block. Leaving on an error, an error
  of the closing itself is dropped: the first failure is the one reported
  (a full disk that failed a save fails the checkpoints' and the metrics'
  closing too, and would replace the save's error with theirs)."""
  try:
    yield resource
  except BaseException:
    try:
      resource.close()
    except Exception:  # pylint: disable=broad-except
      logging.debug('Closing %s after an error failed too.', resource,
                    exc_info=True)
    raise
  resource.close()


def _restore_or_init(exp, checkpointer, workdir: str, is_writer: bool):
  """(start step, state, run record): the newest checkpoint that restores
  (newer ones that do not are set aside, to be saved again), or step 0."""
  strategy = exp.strategy
  abstract = sharding.with_shardings(exp.abstract_state,
                                     strategy.checkpoint_shardings)
  restored = checkpointer.restore_latest(abstract,
                                         set_aside_unrestorable=True)
  if restored is None:
    if is_writer:  # A run stopped before its first checkpoint: redone.
      run_dir.truncate_after(workdir, 0)
    return 0, strategy.init_state(), {}
  start_step, state = restored
  console.info('Resuming from %s at step %d.', checkpointer.directory,
                     start_step)
  if is_writer:
    run_dir.truncate_after(workdir, start_step)
  return (start_step, strategy.place_state(state),
          checkpointer.run_record(start_step))


def _ema_params(state: train_state.TrainState):
  """The params' moving average with the run's fp8 amax histories (which
  the optimizer, and so the average, never holds), or None."""
  ema = moving_average.ema_params(state.opt_state)
  if ema is None:
    return None
  return meta_params.merge_meta(ema, train_state.split_fp8(state.params)[0])


class Session:
  """One session of a run: its experiment and data, the resources owned by
  the ExitStack it is opened in (the signal handlers, the checkpointer, the
  in-flight watch, the metrics writer, later the batches), and where it
  stands: the step it started from, the state, the last val metrics."""

  def __init__(self, stack: contextlib.ExitStack, exp: experiment.Experiment,
               splits: pipeline.Splits, workdir: str, is_writer: bool,
               wait: in_flight.Wait):
    """`wait(metrics)` blocks until a step's metrics are ready (the loop's
    hook)."""
    self.exp, self.splits, self.stack = exp, splits, stack
    settings = exp.settings
    # The learning rate each log line reports: one small program, where the
    # schedule's ops run eagerly were seven, each compiled in every process.
    self.learning_rate = jax.jit(exp.schedule)
    self.shard = pipeline.Shard.current()
    self.interruption = stack.enter_context(interruption.Interruption())
    self.checkpointer = stack.enter_context(
        closed_on_exit(
            checkpoint.Checkpointer(workdir, settings.keep_checkpoints)))
    self.on_stall = in_flight.exit_on_stall(
        f'The newest checkpoint in {self.checkpointer.directory} is whole: '
        'run the same command to resume (--config.stall_timeout_sec='
        f'{settings.stall_timeout_sec:g} is how long a step may take).')
    # At most steps_in_flight steps ahead of the devices, every wait watched.
    self.steps = stack.enter_context(in_flight.InFlight(
        settings.steps_in_flight, settings.stall_timeout_sec, self.on_stall,
        wait))
    self.start_step, self.state, record = _restore_or_init(
        exp, self.checkpointer, workdir, is_writer)
    if is_writer:
      run_dir.record_config(exp.settings, workdir, self.start_step)
    self.writer = stack.enter_context(
        closed_on_exit(
            run_dir.MetricsWriter(
                workdir, enabled=is_writer, start_step=self.start_step)))
    self.progress = console.Progress(exp.total_steps, settings.batch_size,
                                          self.start_step, record)
    self.evaluator = in_flight.Evaluator(exp, splits, self.shard, self.writer,
                                          self.progress, self.on_stall)
    self.last_val = record.get('last_val', {})
    self.last_val_ema = record.get('last_val_ema', {})
    # The steps between the last log point and the checkpoint resumed from
    # (none in older checkpoints): the first log window starts with them.
    self.log_window = run_dir.window_from_record(
        record.get('log_window', []))

  def evaluate_val(self, step: int) -> None:
    """Val metrics of the params (with what the experiment logs beside
    them) and of their moving average, if kept."""
    exp, state = self.exp, self.state
    skipped_steps = int(exp.strategy.unreplicate(state.skipped_steps))
    self.last_val = self.evaluator('val', step, state.params,
                                   **exp.log_fields(step, skipped_steps))
    ema = _ema_params(state)
    if ema is not None:
      self.last_val_ema = self.evaluator('val', step, ema, label='val_ema')

  def save(self, step: int, log_window: list[dict[str, Any]],
           wait: bool) -> None:
    """A checkpoint of the state at `step`, with the run record (which keeps
    `log_window`, the host metrics of the steps since the last log point);
    returns once the state is off the device (the files are written while
    training goes on) unless `wait`."""
    self.writer.flush()  # What the checkpoint covers is on disk before it.
    self.checkpointer.save(
        step, self.exp.strategy.unreplicate(self.state),
        dict(
            self.progress.record(),
            last_val=self.last_val,
            last_val_ema=self.last_val_ema,
            log_window=run_dir.window_record(log_window)))
    if wait:
      self.checkpointer.wait()

  def summary(self) -> dict[str, Any]:
    """The finished run's results (test and last val, of the params and of
    their moving average), its costs and its settings: summary.json."""
    exp, state = self.exp, self.state
    strategy, total_steps = exp.strategy, exp.total_steps
    test = self.evaluator('test', total_steps, state.params)
    ema = _ema_params(state)
    ema_summary = {}
    if ema is not None:
      test_ema = self.evaluator('test', total_steps, ema, label='test_ema')
      ema_summary = dict(
          ema_test_accuracy=test_ema['accuracy'],
          ema_test_loss=test_ema['loss'],
          ema_val_accuracy=self.last_val_ema.get('accuracy'),
          ema_val_loss=self.last_val_ema.get('loss'))
    skipped_steps = int(strategy.unreplicate(state.skipped_steps))
    progress = self.progress
    return dict(
        test_accuracy=test['accuracy'], test_loss=test['loss'],
        val_accuracy=self.last_val.get('accuracy'),
        val_loss=self.last_val.get('loss'),
        steps=total_steps,
        skipped_steps=skipped_steps,
        final_loss_scale=float(strategy.unreplicate(state.loss_scale.scale)),
        train_time_sec=progress.train_seconds,
        eval_time_sec=progress.eval_seconds,
        images_per_sec=progress.mean_images_per_sec,
        host_ms_per_step=progress.host_ms_per_step(),
        peak_memory_bytes=run_dir.peak_memory_bytes(),
        devices=[str(d) for d in jax.devices()],
        strategy=strategy.name,
        mesh_shape=exp.mesh and list(exp.mesh.devices.shape),
        precision_policy=exp.settings.precision.policy,
        loss_scale_kind=exp.scaler.kind,
        **ema_summary,
        **exp.summary_fields(total_steps, skipped_steps))
