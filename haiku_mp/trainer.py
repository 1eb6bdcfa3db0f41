"""`train_and_evaluate(config, workdir)`: the training loop.

Host and device meet only at log and eval points: between them the loop only
dispatches steps, and the metrics of each step stay on the device.
"""

import collections
import itertools
import os
import signal
import time
from typing import Any, Iterator, Optional

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
import ml_collections
import numpy as np

from haiku_mp import checkpoint as checkpoint_lib
from haiku_mp import errors
from haiku_mp import input_pipeline
from haiku_mp import loss_scaling
from haiku_mp import metrics as metrics_lib
from haiku_mp import model
from haiku_mp import optimizer as optimizer_lib
from haiku_mp import parallel as parallel_lib
from haiku_mp import sharding
from haiku_mp import tabulate
from haiku_mp import train_step as train_step_lib

# Means over a log window; the others are the window's last value.
_MEAN_METRICS = ('loss', 'accuracy', 'grad_norm')


def check_intervals(config: ml_collections.ConfigDict) -> None:
  for name in ('log_every_steps', 'eval_every_steps', 'checkpoint_every_steps',
               'keep_checkpoints'):
    if config[name] <= 0:
      raise errors.ConfigError(f'{name}={config[name]} must be positive')


def total_train_steps(config: ml_collections.ConfigDict) -> int:
  if config.num_train_steps > 0:
    return int(config.num_train_steps)
  examples = input_pipeline.num_train_examples(config.data)
  steps = int(config.num_epochs * (examples // config.batch_size))
  if steps <= 0:
    raise errors.ConfigError(
        f'num_epochs={config.num_epochs} with batch_size={config.batch_size} '
        'gives no training step')
  return steps


def _prefetch_to_device(batches: Iterator[Any], place, size: int = 2):
  """Keeps `size` batches in flight to the devices ahead of the step."""
  queue = collections.deque()
  for batch in batches:
    queue.append(place(batch))
    if len(queue) == size:
      yield queue.popleft()
  while queue:
    yield queue.popleft()


def _window_summary(window: list[dict[str, Any]]) -> dict[str, float]:
  """Host summary of the metrics of the steps since the last log point."""
  summary = {k: float(np.nanmean([m[k] for m in window]))
             for k in _MEAN_METRICS}
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


def _param_names(params) -> list[str]:
  """'module/path/param' per leaf, in the order of `jax.tree.leaves`."""
  return ['/'.join(str(getattr(k, 'key', k)) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


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


def _log_sharding_example(params) -> None:
  """Shows how one MLP kernel is laid out over the devices."""
  name = next((k for k in params if k.endswith('mlp_block/fc1')), None)
  if name is None:
    return
  kernel = params[name]['w']
  logging.info('%s/w %s sharded as %s:', name, kernel.shape,
               kernel.sharding.spec)
  jax.debug.visualize_array_sharding(kernel)


def _prepare_workdir(workdir: str, is_writer: bool) -> None:
  """Creates the workdir, or says in one line why it cannot be written."""
  if not is_writer:
    return
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, '.write_test')
    with open(probe, 'w'):
      pass
    os.remove(probe)
  except OSError as e:
    raise errors.ConfigError(f'--workdir={workdir} is not writable '
                             f'({e.strerror})') from None


class _Preemption:
  """SIGTERM on any process stops every process after the same step.

  One process checks its own flag after every step. Several decide together
  at log points, in a collective all of them take part in: a scheduler may
  signal only some of them, and one that stopped to save alone would leave the
  others waiting in the next step's collectives (and the save's barrier).
  """

  def __init__(self, log_every_steps: int):
    self._log_every_steps = log_every_steps
    self._signalled = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    self._signalled = True

  def stop_after(self, step: int) -> bool:
    """Whether to checkpoint and stop after `step` (the same on every process)."""
    if jax.process_count() == 1:
      return self._signalled
    if step % self._log_every_steps:
      return False
    flags = multihost_utils.process_allgather(np.int32(self._signalled))
    return bool(np.max(flags))

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)


def _log_line(step, total, summary, progress):
  return (f'step {step}/{total} [{100 * step / total:.0f}%] '
          f'loss {summary["loss"]:.4f} acc {summary["accuracy"]:.3f} '
          f'scale {summary["loss_scale"]:g} skipped {summary["skipped_steps"]} '
          f'| {progress["images_per_sec"]:.0f} img/s '
          f'| ETA {metrics_lib.format_duration(progress["eta_sec"])}')


def make_init_state(config: ml_collections.ConfigDict, forward,
                    optimizer, scaler: loss_scaling.LossScaler):
  """A no-argument function that builds the initial TrainState from the seed.

  It takes no arrays, so a strategy can run it under jit with the state's
  shardings as outputs (nothing is ever gathered on one device).
  """

  def init_state() -> train_step_lib.TrainState:
    init_rng, state_rng = jax.random.split(jax.random.key(config.seed))
    params = forward.init(init_rng, model.dummy_images(config.model), True)
    return train_step_lib.init_train_state(params, optimizer, scaler,
                                           state_rng)

  return init_state


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       mesh: Optional[Mesh] = None) -> dict[str, Any]:
  """Trains, evaluates on val periodically and on test at the end.

  `mesh` (from `sharding.make_mesh`) is needed by the `pmap` and `pjit`
  strategies. Everything that can be wrong with the config or the data is
  checked before anything is written to `workdir`. Returns the summary also
  written to `workdir/summary.json`.
  """
  check_intervals(config)
  if config.parallel.strategy != 'single' and mesh is None:
    raise errors.ConfigError(
        f'parallel.strategy={config.parallel.strategy} needs a device mesh')
  if config.parallel.strategy == 'single' and jax.process_count() > 1:
    raise errors.ConfigError(
        f'parallel.strategy=single cannot span {jax.process_count()} '
        'processes; use pmap or pjit')
  shard = input_pipeline.Shard.current()
  input_pipeline.local_batch_size(config.batch_size, shard)
  input_pipeline.check_available(config.data)
  forward, precision = model.build(config)
  scaler = loss_scaling.LossScaler.from_config(config.loss_scale)
  total_steps = total_train_steps(config)
  optimizer = optimizer_lib.make_optimizer(config, total_steps,
                                           precision.half_params)

  init_state = make_init_state(config, forward, optimizer, scaler)
  parallel = parallel_lib.make_parallel(config, mesh, forward, optimizer,
                                        scaler, init_state)

  is_writer = jax.process_index() == 0
  _prepare_workdir(workdir, is_writer)
  checkpointer = checkpoint_lib.Checkpointer(workdir, config.keep_checkpoints)
  abstract = sharding.with_shardings(jax.eval_shape(init_state),
                                     parallel.checkpoint_shardings)
  param_names = _param_names(abstract.params)
  restored = checkpointer.restore_latest(abstract)
  if restored is None:
    start_step, state = 0, parallel.init_state()
  else:
    start_step, state = restored
    state = parallel.place_state(state)
    logging.info('Resuming from %s at step %d.', checkpointer.directory,
                 start_step)
    if is_writer:
      metrics_lib.truncate_after(workdir, start_step)
  train_batches = input_pipeline.train_batches(config, shard, start_step)

  if is_writer:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=1, sort_keys=True) + '\n')
  logging.info('Devices: %s (process %d of %d), strategy %s, mesh %s',
               jax.devices(), jax.process_index(), jax.process_count(),
               parallel.strategy, mesh and dict(mesh.shape))
  logging.info('Modules:\n%s',
               tabulate.format_table(tabulate.module_rows(config, mesh)))
  if parallel.state_shardings is not None:
    _log_sharding_example(state.params)
  schedule = optimizer_lib.learning_rate_schedule(config, total_steps)

  writer = metrics_lib.MetricsWriter(workdir, enabled=is_writer,
                                     start_step=start_step)
  progress = metrics_lib.Progress(total_steps, config.batch_size, start_step)
  preempted = _Preemption(config.log_every_steps)
  start_time = time.perf_counter()
  eval_seconds = 0.0
  window = []
  last_val = {}

  def run_eval(split_name, split, step):
    nonlocal eval_seconds
    t = time.perf_counter()
    result = evaluate(parallel.eval_step, state.params,
                      _prefetch_to_device(
                          input_pipeline.eval_batches(config, split, shard),
                          parallel.place_batch), parallel.unreplicate)
    eval_seconds += time.perf_counter() - t
    writer.write(step, split_name, result)
    logging.info('%s at step %d: loss %.4f accuracy %.4f (%d examples)',
                 split_name, step, result['loss'], result['accuracy'],
                 result['num_examples'])
    return result

  batches = _prefetch_to_device(train_batches, parallel.place_batch)
  first_batch = next(batches)
  # Compiled ahead of the first step, so that every logged rate, the first
  # window's after a start or a resume included, excludes compilation.
  compile_start = time.perf_counter()
  train_step = parallel.train_step.lower(state, first_batch).compile()
  logging.info('Compiled the train step in %.1fs.',
               time.perf_counter() - compile_start)
  progress.reset_clock(start_step)
  batches = itertools.chain([first_batch], batches)
  for step in range(start_step + 1, total_steps + 1):
    state, step_metrics = train_step(state, next(batches))
    window.append(step_metrics)
    if step % config.log_every_steps == 0 or step == total_steps:
      host_window = jax.device_get([parallel.unreplicate(m) for m in window])
      summary = _window_summary(host_window)
      _log_overflows(host_window, step - len(window) + 1, param_names)
      window = []
      try:
        scaler.check(step, summary['loss_scale'],
                     int(host_window[-1]['consecutive_skips']),
                     summary['window_skipped_steps'])
      except loss_scaling.LossScaleError:
        writer.write(step, 'train', summary)
        writer.close()
        checkpointer.close()
        preempted.restore()
        raise
      rates = progress.update(step)
      summary.update(images_per_sec=rates['images_per_sec'],
                     learning_rate=float(schedule(step - 1)))
      writer.write(step, 'train', summary)
      logging.info(_log_line(step, total_steps, summary, rates))
    if step % config.eval_every_steps == 0 or step == total_steps:
      last_val = run_eval('val', config.data.val_split, step)
      progress.reset_clock(step)
    stop = step < total_steps and preempted.stop_after(step)
    if (step % config.checkpoint_every_steps == 0 or step == total_steps or
        stop):
      writer.flush()  # What the checkpoint covers is on disk before it.
      checkpointer.save(step, parallel.unreplicate(state))
      progress.reset_clock(step)  # Rates exclude saving, as evaluation.
    if stop:
      logging.warning('SIGTERM: saved a checkpoint at step %d; stopping. '
                      'Run the same command to resume.', step)
      writer.close()
      checkpointer.close()
      preempted.restore()
      return dict(preempted_at_step=step)
  preempted.restore()
  checkpointer.close()

  test = run_eval('test', config.data.test_split, total_steps)
  skipped = int(parallel.unreplicate(state.skipped_steps))
  summary = dict(
      test_accuracy=test['accuracy'], test_loss=test['loss'],
      val_accuracy=last_val.get('accuracy'), val_loss=last_val.get('loss'),
      steps=total_steps, skipped_steps=skipped,
      final_loss_scale=float(parallel.unreplicate(state.loss_scale.scale)),
      train_time_sec=time.perf_counter() - start_time - eval_seconds,
      eval_time_sec=eval_seconds,
      images_per_sec=progress.mean_images_per_sec,
      peak_memory_bytes=metrics_lib.peak_memory_bytes(),
      devices=[str(d) for d in jax.devices()],
      strategy=parallel.strategy,
      mesh_shape=mesh and list(mesh.devices.shape),
      precision_policy=config.precision.policy,
      loss_scale_kind=config.loss_scale.kind)
  writer.close()
  if is_writer:
    metrics_lib.write_json(os.path.join(workdir, 'summary.json'), summary)
  logging.info('Summary: %s', summary)
  return summary
