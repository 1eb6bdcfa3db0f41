"""`train_and_evaluate(settings, workdir)`: the training loop.

Host and device meet only at log and eval points: between them the loop only
dispatches steps, and the metrics of each step stay on the device.
"""

import contextlib
import itertools
import os
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional, TypeVar

from absl import logging
import jax

from haiku_mp import errors
from haiku_mp.model import meta_params
from haiku_mp.update import moving_average
from haiku_mp.update import train_state
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.data import prefetch
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import checkpoint
from haiku_mp.vit.train import compilation
from haiku_mp.vit.train import console
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import in_flight
from haiku_mp.vit.train import interruption
from haiku_mp.vit.train import overview
from haiku_mp.vit.train import run_dir

def _call(step, state, batch):
  return step(state, batch)


def _ignore(step: int) -> None:
  del step


class Hooks(NamedTuple):
  """Where the loop's traffic with the device can be seen (by a tracer, or a
  test of what the host does between log points). `dispatch(step, state,
  batch)` runs one compiled train step and returns its (state, metrics) as
  the loop will hold them; `wait(metrics)` blocks until a step's metrics
  are ready, and returns them; `finished(step)` is told the newest train
  step known finished, after each step is dispatched (a many-process run's
  parent names it if a process is lost)."""
  dispatch: Callable[[Callable, Any, Any], tuple[Any, Any]] = _call
  wait: in_flight.Wait = jax.block_until_ready
  finished: Callable[[int], None] = _ignore


def _due(step: int, every: int, total: int) -> bool:
  """Whether `step` is an `every`-th step or the last one."""
  return step % every == 0 or step == total


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


def _settle(run: '_Run', finished, step: int):
  """Waits for every step in flight (up to `step`); the (label, metrics) of
  the newest finished step: the last of those, or `finished` if none was in
  flight."""
  done = run.steps.drain()
  run.hooks.finished(step)
  return done[-1] if done else finished


def _on_host(exp, fetched, window):
  """The host metrics of the steps since the last log point: those already
  `fetched` (for a checkpoint, or from the one the run resumed from), then
  those of `window`, still on the device, in one transfer."""
  return [*fetched, *(exp.strategy.to_host(window) if window else [])]


def _log_window(exp, fetched, window, step, writer, progress,
                learning_rate) -> None:
  """Summarizes the steps since the last log point (`fetched`: those whose
  metrics are on the host already; `window`: the others): logs, writes, and
  stops the run (after writing) when the loss scale says it diverged."""
  host_window = _on_host(exp, fetched, window)
  summary = run_dir.window_summary(host_window, exp.mean_metrics)
  console.log_overflows(host_window, step - len(host_window) + 1,
                              exp.param_names)
  rates = progress.update(step)
  summary.update(images_per_sec=rates['images_per_sec'],
                 learning_rate=float(learning_rate(step - 1)),
                 **exp.spent(step, summary['skipped_steps']))
  try:
    exp.scaler.check(step, summary['loss_scale'],
                     int(host_window[-1]['consecutive_skips']),
                     summary['window_skipped_steps'])
  except errors.ArgumentError as error:
    raise error.named(prefix='loss_scale.') from None
  finally:
    writer.write(step, 'train', summary)
  console.info(
      console.log_line(step, exp.total_steps, summary, rates))


@contextlib.contextmanager
def _clock_stopped(progress: console.Progress, step: int):
  """Work inside the block (evaluation, a save) is left out of the rates."""
  progress.stop(step)
  yield
  progress.start(step)


class _Run:
  """One run: its experiment and data, the resources owned by the ExitStack
  it is opened in (the signal handlers, the checkpointer, the in-flight watch,
  the metrics writer, later the batches), and where it stands: the step it
  started from, the state, the last val metrics."""

  def __init__(self, stack: contextlib.ExitStack, exp: experiment.Experiment,
               splits: pipeline.Splits, workdir: str, is_writer: bool,
               hooks: Hooks):
    self.exp, self.splits, self.stack, self.hooks = exp, splits, stack, hooks
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
        hooks.wait))
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
    """Val metrics of the params (with DP-SGD's epsilon spent) and of their
    moving average, if kept."""
    exp, state = self.exp, self.state
    self.last_val = self.evaluator('val', step, state.params, **exp.spent(
        step, int(exp.strategy.unreplicate(state.skipped_steps))))
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


def _train_batches(run: _Run):
  """The batches from the run's start step on, each tagged with the
  processes' stop requests as it is placed, and the train step compiled for
  the first of them (off the clock)."""
  exp = run.exp
  strategy = exp.strategy
  local_batch_shards = strategy.batch_devices // jax.process_count()
  tag = lambda batch: run.interruption.tag(batch, strategy.place_batch,
                                           local_batch_shards)
  batches = run.stack.enter_context(prefetch.DevicePrefetch(
      exp.train_batches(run.splits.train, run.shard, run.start_step),
      strategy.place_batch, exp.settings.data.prefetch_batches))
  first = next(batches)
  train_step = compilation.CompiledSteps(strategy)
  train_step.compile(run.state, tag(first))
  # The schedule (run at every log point) compiles now, not on the clock.
  run.learning_rate(run.start_step)
  return map(tag, itertools.chain([first], batches)), train_step


def _train(run: _Run) -> Optional[dict[str, Any]]:
  """The steps from the run's start to its end, with the log, eval and save
  points; `{'preempted_at_step': N, 'signal': NAME}` if a signal stopped it,
  else None."""
  exp = run.exp
  settings, total_steps = exp.settings, exp.total_steps
  if run.start_step >= total_steps:
    return None
  batches, train_step = _train_batches(run)
  run.progress.start(run.start_step)
  # The steps since the last log point: those whose metrics are on the host
  # (from the checkpoint the run resumed from, or fetched for a save), then
  # those still on the device.
  fetched, window, finished = run.log_window, [], None
  for step in range(run.start_step + 1, total_steps + 1):
    # Between log points the host only dispatches, and waits for the step
    # steps_in_flight back: no device value is read.
    before_batch = time.perf_counter()
    batch = next(batches)
    before_step = time.perf_counter()
    run.state, step_metrics = run.hooks.dispatch(train_step, run.state, batch)
    run.progress.host_time(before_step - before_batch,
                           time.perf_counter() - before_step)
    window.append(step_metrics)
    finished = run.steps.push(f'step {step}', step_metrics)
    # Steps finish in order: all but those still in flight have.
    run.hooks.finished(step - len(run.steps))
    if _due(step, settings.log_every_steps, total_steps):
      finished = _settle(run, finished, step)  # The window, waited for.
      _log_window(exp, fetched, window, step, run.writer, run.progress,
                  run.learning_rate)
      fetched, window = [], []
      run.checkpointer.poll()  # A save written meanwhile: logged, or its error.
    if _due(step, settings.eval_every_steps, total_steps):
      # Evaluation waits for the steps still queued.
      finished = _settle(run, finished, step)
      with _clock_stopped(run.progress, step):
        run.evaluate_val(step)
    stop = step < total_steps and run.interruption.stop_after(
        finished and finished[1])
    if _due(step, settings.checkpoint_every_steps, total_steps) or stop:
      finished = _settle(run, finished, step)
      with _clock_stopped(run.progress, step):
        # The steps since the last log point go into the checkpoint: a run
        # resumed from it logs the window an uninterrupted run does.
        fetched, window = _on_host(exp, fetched, window), []
        run.save(step, fetched, wait=stop)  # The files written before a stop.
    if stop:
      received = run.interruption.received or 'SIGTERM'  # Or another process's.
      logging.warning('%s', interruption.stop_line(received, step))
      return dict(preempted_at_step=step, signal=received)
  return None


def _summary(run: _Run) -> dict[str, Any]:
  """The finished run's results (test and last val, of the params and of
  their moving average), its costs and its settings: summary.json."""
  exp, state = run.exp, run.state
  strategy, total_steps = exp.strategy, exp.total_steps
  test = run.evaluator('test', total_steps, state.params)
  ema = _ema_params(state)
  ema_summary = {}
  if ema is not None:
    test_ema = run.evaluator('test', total_steps, ema, label='test_ema')
    ema_summary = dict(
        ema_test_accuracy=test_ema['accuracy'], ema_test_loss=test_ema['loss'],
        ema_val_accuracy=run.last_val_ema.get('accuracy'),
        ema_val_loss=run.last_val_ema.get('loss'))
  skipped_steps = int(strategy.unreplicate(state.skipped_steps))
  progress = run.progress
  return dict(
      test_accuracy=test['accuracy'], test_loss=test['loss'],
      val_accuracy=run.last_val.get('accuracy'),
      val_loss=run.last_val.get('loss'),
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


def unfinished(settings: settings_lib.Settings, workdir: str
               ) -> Optional[dict[str, Any]]:
  """What to check of `workdir` before a run is built: given on every
  process, writable by the writing one (before the data is looked for: a
  download, perhaps). Returns the summary of a run of these settings already
  finished there (logged, and left as it is), else None."""
  run_dir.check_given(workdir)  # On every process: no run without one.
  finished = run_dir.finished_summary(settings, workdir)
  if finished is not None:
    console.info(
        'This run is complete (step %d of %d): nothing to '
        'do. Its summary: %s', finished['steps'], finished['steps'],
        os.path.join(workdir, run_dir.SUMMARY_FILE))
    return finished
  if jax.process_index() == 0:
    run_dir.check_writable(workdir)
  return None


def train(exp: experiment.Experiment, workdir: str,
          log_module_table: bool = False,
          hooks: Hooks = Hooks()) -> dict[str, Any]:
  """Trains the built run `exp` in `workdir` (checked by `unfinished`),
  evaluates on val periodically and on test at the end.

  Returns the summary also written to `workdir/summary.json`, or
  `{'preempted_at_step': N, 'signal': NAME}` after a SIGTERM or a Ctrl-C
  (SIGINT). `hooks` see each step's dispatch and each wait for one. The
  writer, the checkpointer and the signal handlers are owned by one
  ExitStack, so every exit (the end, divergence, a signal, any exception)
  closes and restores them.
  """
  is_writer = jax.process_index() == 0
  setting = exp.settings.compilation_cache_dir
  with contextlib.ExitStack() as stack:
    overview.log_compilation_cache(
        stack.enter_context(compilation.used(setting)), setting)
    splits = overview.load_data(exp)
    if is_writer:
      run_dir.prepare(workdir)
    run = _Run(stack, exp, splits, workdir, is_writer, hooks)
    overview.log_startup(exp, run.state, workdir, is_writer,
                            log_module_table)
    stopped = _train(run)
    if stopped is not None:
      return stopped
    summary = _summary(run)
  path = os.path.join(workdir, run_dir.SUMMARY_FILE)
  if is_writer:
    run_dir.write_json(path, summary)
  console.info('%s', console.summary_line(summary, path))
  return summary


def train_and_evaluate(settings: settings_lib.Settings, workdir: str,
                       log_module_table: bool = False,
                       hooks: Hooks = Hooks(),
                       on_built: Callable[[], None] = lambda: None
                       ) -> dict[str, Any]:
  """`train` of the run `settings` describe: everything that can be wrong
  with the workdir, the settings or the data is checked (`unfinished`,
  `experiment.build`) before anything is written to `workdir`; a run of
  these settings already finished there is left as it is (its summary
  returned). `on_built` runs once the run is built, before it trains
  (`launch.train` logs the config there: a bad setting's line stands
  alone)."""
  finished = unfinished(settings, workdir)
  if finished is not None:
    return finished
  exp = experiment.build(settings, check_data=True)
  on_built()
  return train(exp, workdir, log_module_table, hooks)


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
