"""`train_and_evaluate(settings, workdir)`: the training loop.

Host and device meet only at log and eval points: between them the loop only
dispatches steps, and the metrics of each step stay on the device.
"""

import contextlib
import itertools
import os
import time
from typing import Any, Callable, NamedTuple, Optional

from absl import logging
import jax

from haiku_mp import errors
from haiku_mp.vit.data import prefetch
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import compilation
from haiku_mp.vit.train import console
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import in_flight
from haiku_mp.vit.train import interruption
from haiku_mp.vit.train import overview
from haiku_mp.vit.train import run_dir
from haiku_mp.vit.train import session as session_lib


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


def _settle(session: session_lib.Session, hooks: Hooks, finished, step: int):
  """Waits for every step in flight (up to `step`); the (label, metrics) of
  the newest finished step: the last of those, or `finished` if none was in
  flight."""
  done = session.steps.drain()
  hooks.finished(step)
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
                 **exp.log_fields(step, summary['skipped_steps']))
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


def _train_batches(session: session_lib.Session):
  """The batches from the run's start step on, each tagged with the
  processes' stop requests as it is placed, and the train step compiled for
  the first of them (off the clock)."""
  exp = session.exp
  strategy = exp.strategy
  local_batch_shards = strategy.batch_devices // jax.process_count()
  tag = lambda batch: session.interruption.tag(batch, strategy.place_batch,
                                               local_batch_shards)
  batches = session.stack.enter_context(prefetch.DevicePrefetch(
      exp.train_batches(session.splits.train, session.shard,
                        session.start_step),
      strategy.place_batch, exp.settings.data.prefetch_batches))
  first = next(batches)
  train_step = compilation.CompiledSteps(strategy)
  train_step.compile(session.state, tag(first))
  # The schedule (run at every log point) compiles now, not on the clock.
  session.learning_rate(session.start_step)
  return map(tag, itertools.chain([first], batches)), train_step


def _train(session: session_lib.Session,
           hooks: Hooks) -> Optional[dict[str, Any]]:
  """The steps from the run's start to its end, with the log, eval and save
  points, each step dispatched through `hooks`; `{'preempted_at_step': N,
  'signal': NAME}` if a signal stopped it, else None."""
  exp = session.exp
  settings, total_steps = exp.settings, exp.total_steps
  if session.start_step >= total_steps:
    return None
  batches, train_step = _train_batches(session)
  session.progress.start(session.start_step)
  # The steps since the last log point: those whose metrics are on the host
  # (from the checkpoint the run resumed from, or fetched for a save), then
  # those still on the device.
  fetched, window, finished = session.log_window, [], None
  for step in range(session.start_step + 1, total_steps + 1):
    # Between log points the host only dispatches, and waits for the step
    # steps_in_flight back: no device value is read.
    before_batch = time.perf_counter()
    batch = next(batches)
    before_step = time.perf_counter()
    session.state, step_metrics = hooks.dispatch(train_step, session.state,
                                                 batch)
    session.progress.host_time(before_step - before_batch,
                               time.perf_counter() - before_step)
    window.append(step_metrics)
    finished = session.steps.push(f'step {step}', step_metrics)
    # Steps finish in order: all but those still in flight have.
    hooks.finished(step - len(session.steps))
    if _due(step, settings.log_every_steps, total_steps):
      # The window, waited for.
      finished = _settle(session, hooks, finished, step)
      _log_window(exp, fetched, window, step, session.writer,
                  session.progress, session.learning_rate)
      fetched, window = [], []
      # A save written meanwhile: logged, or its error.
      session.checkpointer.poll()
    if _due(step, settings.eval_every_steps, total_steps):
      # Evaluation waits for the steps still queued.
      finished = _settle(session, hooks, finished, step)
      with _clock_stopped(session.progress, step):
        session.evaluate_val(step)
    stop = step < total_steps and session.interruption.stop_after(
        finished and finished[1])
    if _due(step, settings.checkpoint_every_steps, total_steps) or stop:
      finished = _settle(session, hooks, finished, step)
      with _clock_stopped(session.progress, step):
        # The steps since the last log point go into the checkpoint: a run
        # resumed from it logs the window an uninterrupted run does.
        fetched, window = _on_host(exp, fetched, window), []
        # The files written before a stop.
        session.save(step, fetched, wait=stop)
    if stop:
      # The signal this process received, or another process's.
      received = session.interruption.received or 'SIGTERM'
      logging.warning('%s', interruption.stop_line(received, step))
      return dict(preempted_at_step=step, signal=received)
  return None


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
    session = session_lib.Session(stack, exp, splits, workdir, is_writer,
                                  hooks.wait)
    overview.log_startup(exp, session.state, workdir, is_writer,
                            log_module_table)
    stopped = _train(session, hooks)
    if stopped is not None:
      return stopped
    summary = session.summary()
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
