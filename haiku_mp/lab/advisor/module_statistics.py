"""The advisor's statistics pass on the ViT: every module's output, the
gradient flowing into it and its params' gradients over real batches, a
train step between them (`gather_statistics`), and what the pass costs
against the config's own train step (`cost`).
"""

import time
from typing import Any, Callable, Optional

import jax

from haiku_mp.advisor import measurement
from haiku_mp.advisor import probes
from haiku_mp.lab import timing
from haiku_mp.lab import variants
from haiku_mp.vit import settings as settings_schema
from haiku_mp.vit.train import experiment


def module_classes(exp: experiment.Experiment) -> dict[str, str]:
  """Each module path called (in call order) -> its class name."""
  return {c.path: c.class_name for c in exp.module_calls
          if c.method == '__call__'}


def gather_statistics(exp: experiment.Experiment, state, inputs,
                      log: Callable[[str], None],
                      loss_fn: Optional[probes.LossFn] = None):
  """Statistics over `inputs`, a train step between batches.

  Returns (modules, loss scales seen, the statistics function, the state
  after the steps; `state` itself is donated to them). `loss_fn`
  (default: the experiment's) is what is differentiated; a test plants
  faults through it.
  """
  classes = module_classes(exp)
  stats = probes.statistics_fn(loss_fn or exp.loss_fn, classes)
  # As the train steps leave it: every batch's statistics one program,
  # whichever way `state` was made.
  state = exp.strategy.place_state(state)
  totals = measurement.Totals()
  scales = []
  key = jax.random.key(exp.settings.seed + 1)
  for i, batch in enumerate(inputs):
    start = time.perf_counter()
    scales.append(float(state.loss_scale.scale))
    totals.add(*stats.fn(state.params, jax.random.fold_in(key, i), batch,
                         scales[-1]))
    if i + 1 < len(inputs):
      state, _ = exp.strategy.train_step(state, exp.strategy.place_batch(batch))
    log(f'advise: batch {i + 1}/{len(inputs)} measured (loss scale '
        f'{scales[-1]:g}, {time.perf_counter() - start:.1f} s)')
  return totals.modules(classes, stats.aliases), scales, stats, state


def _time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # Compiles, or warms up.
  return timing.median_seconds(fn, (), repeats)


def cost(settings: settings_schema.Settings, stats: probes.StatisticsFn,
         state, batch, repeats: int) -> dict[str, Any]:
  """The statistics pass against the config's own train step (its
  precision, one device), on the same batch, in this process."""
  settings = variants.on_one_device(settings)
  step = timing.compile_experiment(
      experiment.build_without_data(settings))
  step_state = step.experiment.strategy.init_state()
  placed = step.experiment.strategy.place_batch(batch)

  def train():
    nonlocal step_state
    step_state, metrics = step.compiled(step_state, placed)
    return metrics['loss']

  key = jax.random.key(0)
  # The scale as `measure` passed it (a Python float): the same program, not
  # a second compile for a strongly typed float32.
  scale = float(state.loss_scale.scale)
  stats_sec = _time(lambda: stats.fn(state.params, key, batch, scale), repeats)
  train_sec = _time(train, repeats)
  return dict(statistics_pass_sec=stats_sec, train_step_sec=train_sec,
              ratio=stats_sec / train_sec, batch_size=settings.batch_size,
              train_step_policy=settings.precision.policy)
