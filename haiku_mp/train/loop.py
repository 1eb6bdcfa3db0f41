"""`train_and_evaluate(config, workdir)`: the training loop.

Host and device meet only at log and eval points: between them the loop only
dispatches steps, and the metrics of each step stay on the device.
"""

import contextlib
import itertools
import json
import os
import signal
import time
from typing import Any, Optional

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
import ml_collections
import numpy as np

from haiku_mp.train import checkpoint as checkpoint_lib
from haiku_mp.train import compilation_cache
from haiku_mp.train import config_checks
from haiku_mp import errors
from haiku_mp.train import experiment
from haiku_mp.data import pipeline
from haiku_mp.train import metrics as metrics_lib
from haiku_mp.train import optimizer as optimizer_lib
from haiku_mp.parallel import sharding
from haiku_mp.model import module_table

# Means over a log window; the others are the window's last value. DP-SGD's
# steps also report the sampled batch's size and its examples' gradients.
_MEAN_METRICS = ('loss', 'accuracy', 'grad_norm')
_PRIVATE_MEAN_METRICS = ('num_examples', 'example_grad_norm',
                         'clipped_fraction')
# The module table a run writes into its workdir.
MODULES_FILE = 'modules.txt'


def _mean_of_kept(values) -> float:
  """The mean of the values that are not NaN; NaN, without numpy's warning,
  when a whole window of steps was skipped."""
  values = np.asarray(values, np.float64)
  kept = values[~np.isnan(values)]
  return float(kept.mean()) if kept.size else float('nan')


def _window_summary(window: list[dict[str, Any]], private: bool = False
                    ) -> dict[str, float]:
  """Host summary of the metrics of the steps since the last log point."""
  means = _MEAN_METRICS + (_PRIVATE_MEAN_METRICS if private else ())
  summary = {k: _mean_of_kept([m[k] for m in window]) for k in means}
  last = window[-1]
  summary['loss_scale'] = float(last['loss_scale'])
  summary['skipped_steps'] = int(last['skipped_steps'])
  summary['window_skipped_steps'] = int(
      sum(not bool(m['grads_finite']) for m in window))
  return summary


def _log_overflows(window, first_step: int, param_names: list[str],
                   most: int = 5) -> None:
  """Names the parameters whose gradients were not finite at skipped steps."""
  for i, m in enumerate(window):
    if bool(m['grads_finite']):
      continue
    bad = [n for n, flag in zip(param_names, m['nonfinite_grads']) if flag]
    more = f' and {len(bad) - most} more' if len(bad) > most else ''
    logging.warning('step %d skipped (loss scale %g): non-finite gradients in '
                    '%s%s', first_step + i, float(m['loss_scale']),
                    ', '.join(bad[:most]), more)


def evaluate(eval_step, params, batches, unreplicate=lambda x: x
             ) -> dict[str, float]:
  """Loss and accuracy over every (unpadded) example of `batches`.

  `eval_step` returns metrics over the whole global batch, so the result
  covers every process's examples.
  """
  totals = None
  for batch in batches:
    out = eval_step(params, batch)
    out = unreplicate({k: out[k] for k in ('loss', 'accuracy',
                                           'num_examples')})
    n = out['num_examples']
    sums = dict(loss=out['loss'] * n, accuracy=out['accuracy'] * n,
                num_examples=n)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  n = float(totals['num_examples'])
  return dict(loss=float(totals['loss']) / n,
              accuracy=float(totals['accuracy']) / n, num_examples=int(n))


def _check_workdir(workdir: str) -> None:
  """Says in one line why `workdir` could not be made or written, before the
  data is loaded (a wrong path costs a second, not a load), and creates
  nothing: the data may still turn out unusable."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.ConfigError(f'--workdir={workdir} is a file, not a directory')
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise errors.ConfigError(f'--workdir={workdir} is not writable (Not a '
                             f'directory: {existing})')
  if not os.access(existing, os.W_OK | os.X_OK):
    raise errors.ConfigError(f'--workdir={workdir} is not writable '
                             f'(Permission denied: {existing})')


def _prepare_workdir(workdir: str) -> None:
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


class _Interruption:
  """SIGTERM or a first Ctrl-C on any process stops every process after the
  same step, with a checkpoint; a second Ctrl-C stops at once, unsaved.

  One process checks its own flag after every step. Several decide together
  at log points, in a collective all of them take part in: a scheduler may
  signal only some of them, and one that stopped to save alone would leave the
  others waiting in the next step's collectives (and the save's barrier).
  A context manager: the previous handlers are back on every exit path.
  """

  _SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, log_every_steps: int):
    self._log_every_steps = log_every_steps
    self.received = None  # The name of the first signal, e.g. 'SIGINT'.
    self._previous = {}

  def __enter__(self):
    for signum in self._SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _handle(self, signum, frame):
    del frame
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt('a second Ctrl-C: stopped at once, without '
                              'saving; the newest checkpoint is kept')
    if self.received is None:
      self.received = signal.Signals(signum).name
    if signum == signal.SIGINT:
      logging.warning('Ctrl-C: finishing this step, then saving a checkpoint '
                      '(Ctrl-C again stops at once, without saving).')

  def stop_after(self, step: int) -> bool:
    """Whether to checkpoint and stop after `step` (the same on every process)."""
    if jax.process_count() == 1:
      return self.received is not None
    if step % self._log_every_steps:
      return False
    flags = multihost_utils.process_allgather(
        np.int32(self.received is not None))
    return bool(np.max(flags))


def _log_line(step, total, summary, progress):
  epsilon = (f'eps {summary["epsilon"]:.2f} ' if 'epsilon' in summary
             else '')
  return (f'step {step}/{total} [{100 * step / total:.0f}%] '
          f'loss {summary["loss"]:.4f} acc {summary["accuracy"]:.3f} '
          f'scale {summary["loss_scale"]:g} skipped {summary["skipped_steps"]} '
          f'{epsilon}| {progress["images_per_sec"]:.0f} img/s '
          f'| ETA {metrics_lib.format_duration(progress["eta_sec"])}')


def _epsilon(exp, step: int, skipped_steps: int) -> dict[str, float]:
  """{'epsilon': spent after the steps taken up to `step`} under DP-SGD (the
  skipped ones released nothing), else {}."""
  if exp.privacy is None:
    return {}
  return dict(epsilon=exp.privacy.epsilon(step - skipped_steps))


def _due(step: int, every: int, total: int) -> bool:
  """Whether `step` is an `every`-th step or the last one."""
  return step % every == 0 or step == total


def log_startup(exp: experiment.Experiment, state, workdir: str,
                is_writer: bool, log_module_table: bool = False) -> None:
  """The devices, one line about the model (the whole module table in
  `workdir/modules.txt`, and logged with `log_module_table`) and, when
  sharded, one kernel's layout."""
  strategy = exp.strategy
  logging.info('Devices: %s (process %d of %d), strategy %s, mesh %s',
               jax.devices(), jax.process_index(), jax.process_count(),
               strategy.name, exp.mesh and dict(exp.mesh.shape))
  rows = module_table.module_rows(exp)
  table = module_table.format_table(rows)
  path = os.path.join(workdir, MODULES_FILE)
  if is_writer:
    with open(path, 'w') as f:
      f.write(table + '\n')
  logging.info('%s; every module: %s', module_table.summary_line(
      rows, exp.config.precision.overrides), path)
  if log_module_table:
    logging.info('Modules:\n%s', table)
  if exp.privacy is not None:
    dp = exp.privacy
    logging.info(
        'DP-SGD: clip %g, noise multiplier %.4g%s; Poisson sampling of '
        'expected batch %d of %d examples (q=%.3g), padded to %d, microbatch '
        '%s; epsilon %.4g at delta %g after all %d steps', dp.l2_clip_norm,
        dp.noise_multiplier, ' (calibrated)' if exp.config.privacy.target_epsilon
        else '', dp.batch_size, dp.num_examples, dp.sampling_probability,
        dp.padded_batch_size, dp.microbatch_size or 'none',
        dp.epsilon(exp.total_steps), dp.delta, exp.total_steps)
  if strategy.state_shardings is None:
    return
  name = next((k for k in state.params if k.endswith('mlp_block/fc1')), None)
  if name is not None:
    kernel = state.params[name]['w']
    logging.info('%s/w %s sharded as %s:', name, kernel.shape,
                 kernel.sharding.spec)
    jax.debug.visualize_array_sharding(kernel)


def _restore_or_init(exp, checkpointer, workdir: str, is_writer: bool):
  """(start step, state, run record): the newest checkpoint that restores
  (newer ones that do not are set aside, to be saved again), or step 0."""
  strategy = exp.strategy
  abstract = sharding.with_shardings(exp.abstract_state,
                                     strategy.checkpoint_shardings)
  restored = checkpointer.restore_latest(abstract,
                                         set_aside_unrestorable=True)
  if restored is None:
    return 0, strategy.init_state(), {}
  start_step, state = restored
  logging.info('Resuming from %s at step %d.', checkpointer.directory,
               start_step)
  if is_writer:
    metrics_lib.truncate_after(workdir, start_step)
  return (start_step, strategy.place_state(state),
          checkpointer.run_record(start_step))


def _config_text(config: ml_collections.ConfigDict) -> str:
  return config.to_json_best_effort(indent=1, sort_keys=True) + '\n'


# Settings that change how a run gets its programs, not what it computes: a
# finished run is the same run whatever they say.
_NOT_THE_RUN = (compilation_cache.SETTING,)


def _same_run(config_json: str, config: ml_collections.ConfigDict) -> bool:
  try:
    saved = json.loads(config_json)
  except ValueError:
    return False
  now = json.loads(_config_text(config))
  for setting in _NOT_THE_RUN:
    saved.pop(setting, None)
    now.pop(setting, None)
  return saved == now


def finished_summary(config: ml_collections.ConfigDict, workdir: str
                     ) -> Optional[dict[str, Any]]:
  """The summary of the run `config` already finished in `workdir`, if it
  did: its summary.json, the same config.json, and the final checkpoint."""
  try:
    with open(os.path.join(workdir, 'config.json')) as f:
      same_config = _same_run(f.read(), config)
    with open(os.path.join(workdir, 'summary.json')) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  final = os.path.join(workdir, 'checkpoints', str(summary.get('steps')))
  if same_config and isinstance(summary, dict) and os.path.isdir(final):
    return summary
  return None


class _Evaluator:
  """Evaluates on a split, logs and writes the result, keeps the time spent."""

  def __init__(self, exp, splits, shard, writer, progress):
    self._exp, self._splits, self._shard = exp, splits, shard
    self._writer, self._progress = writer, progress

  def __call__(self, split_name: str, step: int, params,
               label: Optional[str] = None, **extra) -> dict[str, float]:
    """The split's metrics, written with `extra` ones (DP-SGD's epsilon) as
    the split `label` (default: its name; 'val_ema' for the params' moving
    average)."""
    label = label or split_name
    exp = self._exp
    start = time.perf_counter()
    with pipeline.DevicePrefetch(
        pipeline.eval_batches(exp.config,
                                    getattr(self._splits, split_name),
                                    self._shard),
        exp.strategy.place_batch, exp.config.data.prefetch_batches) as batches:
      result = dict(evaluate(exp.strategy.eval_step, params, batches,
                             exp.strategy.unreplicate), **extra)
    self._progress.eval_seconds += time.perf_counter() - start
    self._writer.write(step, label, result)
    logging.info('%s at step %d: loss %.4f accuracy %.4f (%d examples)',
                 label, step, result['loss'], result['accuracy'],
                 result['num_examples'])
    return result


class _CompiledSteps:
  """The train step compiled ahead of a step of each batch shape it meets, so
  that every logged rate, the first window's after a start or a resume
  included, excludes compilation. Ordinary training meets one shape; DP-SGD
  another in the rare step whose Poisson draw outgrows the padded batch."""

  def __init__(self, strategy):
    self._strategy = strategy
    self._compiled = {}

  def compile(self, state, batch):
    shapes = tuple(sorted((k, v.shape) for k, v in batch.items()))
    if shapes not in self._compiled:
      start = time.perf_counter()
      lowered = self._strategy.train_step.lower(state, batch)
      lowered_at = time.perf_counter()
      with compilation_cache.hits() as hits:
        self._compiled[shapes] = lowered.compile()
      end = time.perf_counter()
      # Tracing and lowering run every time; XLA's compile is what the
      # persistent compilation cache saves.
      logging.info('Compiled the train step for a batch of %d in %.1fs '
                   '(tracing and lowering %.1fs, XLA %.1fs%s).',
                   batch['label'].size, end - start, lowered_at - start,
                   end - lowered_at,
                   ', loaded from the compilation cache' if hits else '')
    return self._compiled[shapes]

  def __call__(self, state, batch):
    return self.compile(state, batch)(state, batch)


def _train_batches(exp, splits, shard, start_step):
  """This process's train batches on their way to the devices, made by a
  background thread (a context manager)."""
  config = exp.config
  if exp.privacy is None:
    batches = pipeline.train_batches(config, splits.train, shard,
                                           start_step)
  else:
    batches = pipeline.private_train_batches(
        config, splits.train, shard, exp.privacy, exp.total_steps, start_step)
  return pipeline.DevicePrefetch(
      batches, exp.strategy.place_batch, config.data.prefetch_batches)


def _privacy_summary(exp, steps: int, skipped_steps: int) -> dict[str, Any]:
  """DP-SGD's guarantee and settings for summary.json, or {}."""
  if exp.privacy is None:
    return {}
  dp = exp.privacy
  return dict(_epsilon(exp, steps, skipped_steps), delta=dp.delta,
              noise_multiplier=dp.noise_multiplier,
              l2_clip_norm=dp.l2_clip_norm, private_steps=steps - skipped_steps,
              sampling=f'poisson (expected batch {dp.batch_size} of '
              f'{dp.num_examples}, padded to {dp.padded_batch_size})')


def _log_window(exp, window, step, writer, progress) -> None:
  """Summarizes the steps since the last log point: logs, writes, and stops
  the run (after writing) when the loss scale says it diverged."""
  host_window = exp.strategy.to_host(window)  # One transfer.
  summary = _window_summary(host_window, exp.privacy is not None)
  _log_overflows(host_window, step - len(window) + 1, exp.param_names)
  rates = progress.update(step)
  summary.update(images_per_sec=rates['images_per_sec'],
                 learning_rate=float(exp.schedule(step - 1)),
                 **_epsilon(exp, step, summary['skipped_steps']))
  try:
    exp.scaler.check(step, summary['loss_scale'],
                     int(host_window[-1]['consecutive_skips']),
                     summary['window_skipped_steps'])
  finally:
    writer.write(step, 'train', summary)
  logging.info(_log_line(step, exp.total_steps, summary, rates))


def _stop_line(signal_name: str, step: int) -> str:
  by = 'Ctrl-C (SIGINT)' if signal_name == 'SIGINT' else signal_name
  return (f'{by}: saved a checkpoint at step {step}; stopping. Run the same '
          'command to resume.')


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       mesh: Optional[Mesh] = None,
                       log_module_table: bool = False) -> dict[str, Any]:
  """Trains, evaluates on val periodically and on test at the end.

  `mesh` (from `sharding.make_mesh`) is needed by the `pmap` and `pjit`
  strategies. Everything that can be wrong with the config or the data is
  checked before anything is written to `workdir`; a run this config has
  already finished there is left as it is. Returns the summary also written
  to `workdir/summary.json`, or `{'preempted_at_step': N, 'signal': NAME}`
  after a SIGTERM or a Ctrl-C (SIGINT). The writer, the checkpointer and the
  signal handlers are owned by one ExitStack, so every exit (the end,
  divergence, a signal, any exception) closes and restores them.
  """
  config_checks.check(config)
  shard = pipeline.Shard.current()
  pipeline.local_batch_size(config.batch_size, shard)
  finished = finished_summary(config, workdir)
  if finished is not None:
    logging.info('This run is complete (step %d of %d): nothing to do. Its '
                 'summary: %s', finished['steps'], finished['steps'],
                 os.path.join(workdir, 'summary.json'))
    return finished
  pipeline.check_available(config.data)
  exp = experiment.build(config, mesh)
  strategy, total_steps = exp.strategy, exp.total_steps
  is_writer = jax.process_index() == 0
  if is_writer:
    _check_workdir(workdir)
  load_start = time.perf_counter()
  splits = pipeline.load(config)
  logging.info('Data (%s): %s in memory in %.1fs.', config.data.source,
               ', '.join(f'{name} {len(split.labels)}' for name, split in
                         zip(splits._fields, splits)), time.perf_counter() -
               load_start)
  if is_writer:
    _prepare_workdir(workdir)
  with contextlib.ExitStack() as stack:
    interruption = stack.enter_context(_Interruption(config.log_every_steps))
    checkpointer = stack.enter_context(contextlib.closing(
        checkpoint_lib.Checkpointer(workdir, config.keep_checkpoints)))
    start_step, state, record = _restore_or_init(exp, checkpointer, workdir,
                                                 is_writer)
    if is_writer:
      with open(os.path.join(workdir, 'config.json'), 'w') as f:
        f.write(_config_text(config))
    log_startup(exp, state, workdir, is_writer, log_module_table)
    writer = stack.enter_context(contextlib.closing(metrics_lib.MetricsWriter(
        workdir, enabled=is_writer, start_step=start_step)))
    progress = metrics_lib.Progress(total_steps, config.batch_size, start_step,
                                    record)
    evaluator = _Evaluator(exp, splits, shard, writer, progress)
    last_val = record.get('last_val', {})
    last_val_ema = record.get('last_val_ema', {})
    if start_step < total_steps:
      batches = stack.enter_context(_train_batches(exp, splits, shard,
                                                   start_step))
      first = next(batches)
      train_step = _CompiledSteps(strategy)
      train_step.compile(state, first)
      batches = itertools.chain([first], batches)
      # The schedule's ops (run at every log point) compile now, not on the
      # clock.
      exp.schedule(start_step)
      progress.start(start_step)
    window = []
    for step in range(start_step + 1, total_steps + 1):
      # Between log points the host only dispatches: no device value is read.
      before_batch = time.perf_counter()
      batch = next(batches)
      before_step = time.perf_counter()
      state, step_metrics = train_step(state, batch)
      progress.host_time(before_step - before_batch,
                         time.perf_counter() - before_step)
      window.append(step_metrics)
      if _due(step, config.log_every_steps, total_steps):
        _log_window(exp, window, step, writer, progress)
        window = []
        checkpointer.poll()  # A save written meanwhile: logged, or its error.
      if _due(step, config.eval_every_steps, total_steps):
        # Rates exclude evaluation, and evaluation the steps still queued.
        state = jax.block_until_ready(state)
        progress.stop(step)
        last_val = evaluator('val', step, state.params, **_epsilon(
            exp, step, int(strategy.unreplicate(state.skipped_steps))))
        ema = optimizer_lib.ema_params(state.opt_state)
        if ema is not None:
          last_val_ema = evaluator('val', step, ema, label='val_ema')
        progress.start(step)
      stop = step < total_steps and interruption.stop_after(step)
      if _due(step, config.checkpoint_every_steps, total_steps) or stop:
        state = jax.block_until_ready(state)
        progress.stop(step)  # Rates exclude saving.
        writer.flush()  # What the checkpoint covers is on disk before it.
        # Returns once the state is off the device; the files are written
        # while training goes on, except before a stop.
        checkpointer.save(step, strategy.unreplicate(state),
                          dict(progress.record(), last_val=last_val,
                               last_val_ema=last_val_ema))
        if stop:
          checkpointer.wait()
        progress.start(step)
      if stop:
        received = interruption.received or 'SIGTERM'  # Or another process's.
        logging.warning('%s', _stop_line(received, step))
        return dict(preempted_at_step=step, signal=received)

    test = evaluator('test', total_steps, state.params)
    ema = optimizer_lib.ema_params(state.opt_state)
    ema_summary = {}
    if ema is not None:
      test_ema = evaluator('test', total_steps, ema, label='test_ema')
      ema_summary = dict(
          ema_test_accuracy=test_ema['accuracy'],
          ema_test_loss=test_ema['loss'],
          ema_val_accuracy=last_val_ema.get('accuracy'))
    skipped_steps = int(strategy.unreplicate(state.skipped_steps))
    summary = dict(
        test_accuracy=test['accuracy'], test_loss=test['loss'],
        val_accuracy=last_val.get('accuracy'), val_loss=last_val.get('loss'),
        steps=total_steps,
        skipped_steps=skipped_steps,
        final_loss_scale=float(strategy.unreplicate(state.loss_scale.scale)),
        train_time_sec=progress.train_seconds,
        eval_time_sec=progress.eval_seconds,
        images_per_sec=progress.mean_images_per_sec,
        host_ms_per_step=progress.host_ms_per_step(),
        peak_memory_bytes=metrics_lib.peak_memory_bytes(),
        devices=[str(d) for d in jax.devices()],
        strategy=strategy.name,
        mesh_shape=mesh and list(mesh.devices.shape),
        precision_policy=config.precision.policy,
        loss_scale_kind=config.loss_scale.kind,
        **ema_summary,
        **_privacy_summary(exp, total_steps, skipped_steps))
  if is_writer:
    metrics_lib.write_json(os.path.join(workdir, 'summary.json'), summary)
  logging.info('Summary: %s', summary)
  return summary
