"""The loop benchmark: does the training loop run as fast as its step?

For each compute dtype, in one process and in alternating rounds:
- `loop`: the trainer itself (`loop.train_and_evaluate`, not a copy of its
  loop) for `steps` steps in a fresh workdir, on the config's data source;
  its images/s is that of its log windows after the first, as the run logs
  them (its clock stops for compiling, evaluating and saving): a loop's
  steady pace. The first window also pays for starting (the batch thread
  filling its queue, first allocations), once per run: the whole round's
  images/s is `loop_whole_round_images_per_sec`;
- `step`: the same compiled train step (the trainer's program: uint8 batch,
  augmentation on the device) dispatched `steps` times on one batch already on
  the device, and waited for once at the end: what the device can do.
`loop_over_step` is the ratio of the median rounds. The loop's
`host_ms_per_step` says where its host time went (waiting for a batch, in
the step call) when it falls short.
"""

import tempfile
from typing import Any, Callable, Sequence

import numpy as np

from haiku_mp.lab import compare
from haiku_mp.lab import hardware
from haiku_mp.lab import run_plots
from haiku_mp.lab import timing
from haiku_mp.lab import variants
from haiku_mp.vit.data import pipeline
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import console
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import loop

# The loop should keep the device this busy (issue target, a benchmark's).
TARGET_LOOP_OVER_STEP = 0.90
RATIO_FIELDS = ('loop_images_per_sec', 'step_images_per_sec')


def loop_config(settings: settings_lib.Settings, steps: int
                ) -> settings_lib.Settings:
  """`settings` as one loop round runs it: `steps` steps, evaluated and saved
  only at the end (neither is in a run's images/s), logged as configured.
  Its warm-up is cut to half the round (the schedule's shape costs nothing;
  a warm-up as long as the run is only warned about)."""
  return settings_lib.replace(
      settings, num_train_steps=steps, eval_every_steps=steps,
      checkpoint_every_steps=steps,
      warmup_steps=min(settings.warmup_steps, steps // 2))


def steady_images_per_sec(events: Sequence[dict[str, Any]], batch_size: int
                          ) -> float:
  """Images/s over the train log windows after the first, from a run's
  metrics.jsonl events (each window's steps over its seconds)."""
  train = [e for e in events if e.get('split') == 'train']
  if len(train) < 2:
    raise ValueError('a steady pace needs two log windows or more')
  steps = seconds = 0.0
  for before, window in zip(train, train[1:]):
    n = window['step'] - before['step']
    steps += n
    seconds += n * batch_size / window['images_per_sec']
  return steps * batch_size / seconds


def _loop_round(settings: settings_lib.Settings) -> dict[str, Any]:
  with tempfile.TemporaryDirectory() as workdir, console.quietly():
    summary = loop.train_and_evaluate(settings, workdir)
    events = run_plots.read_metrics(workdir)
  if 'preempted_at_step' in summary:
    # SIGTERM or Ctrl-C stopped the trainer: the benchmark stops with it,
    # in one line (the entry point's exit for an interruption).
    raise KeyboardInterrupt(
        f'{summary["signal"]} in a --loop round (step '
        f'{summary["preempted_at_step"]}): the benchmark stopped before its '
        'figures')
  return dict(images_per_sec=steady_images_per_sec(events, settings.batch_size),
              whole_round_images_per_sec=summary['images_per_sec'],
              host_ms_per_step=summary['host_ms_per_step'])


class _StepRounds:
  """The trainer's train step compiled for the config's first batch, run on
  that batch already on the device."""

  def __init__(self, settings: settings_lib.Settings):
    exp = experiment.build(settings)
    splits = exp.load_splits()
    host_batch = next(exp.train_batches(splits.train,
                                        pipeline.Shard.current(), 0))
    self._batch = exp.strategy.place_batch(host_batch)
    self._state = exp.strategy.init_state()
    self._step = exp.strategy.train_step.lower(self._state,
                                               self._batch).compile()
    self._batch_size = settings.batch_size
    self._steps_in_flight = settings.steps_in_flight
    self.round(1)  # Warm-up: the first call pays for allocations.

  def round(self, steps: int) -> float:
    """Images/s of `steps` steps dispatched back to back, as the trainer
    does (steps_in_flight ahead), the last waited for."""
    self._state, seconds = timing.dispatch_round(
        self._step, self._state, iter(lambda: self._batch, None), steps,
        self._steps_in_flight)
    return self._batch_size / seconds


def _row(settings: settings_lib.Settings, steps: int, loop_rounds: list,
         step_rounds: list) -> dict[str, Any]:
  """The figures above from one config's rounds."""
  loop_ips = [r['images_per_sec'] for r in loop_rounds]
  median = int(np.argsort(loop_ips)[len(loop_ips) // 2])
  loop_images = float(np.median(loop_ips))
  step_images = float(np.median(step_rounds))
  return dict(
      **hardware.describe(),
      dtype=variants.variant_name(settings),
      policy=settings.precision.policy,
      source=settings.data.source,
      strategy=settings.parallel.strategy,
      batch_size=settings.batch_size,
      steps_in_flight=settings.steps_in_flight,
      log_every_steps=settings.log_every_steps,
      steps_per_round=steps,
      rounds=len(loop_rounds),
      loop_images_per_sec=loop_images,
      step_images_per_sec=step_images,
      loop_over_step=loop_images / step_images,
      loop_rounds_images_per_sec=loop_ips,
      loop_whole_round_images_per_sec=float(np.median(
          [r['whole_round_images_per_sec'] for r in loop_rounds])),
      step_rounds_images_per_sec=step_rounds,
      # The median loop round's.
      host_ms_per_step=loop_rounds[median]['host_ms_per_step'],
      step_ms=1e3 * settings.batch_size / step_images,
      target=TARGET_LOOP_OVER_STEP,
      target_met=loop_images / step_images >= TARGET_LOOP_OVER_STEP)


def run_configs(configs: Sequence[settings_lib.Settings],
                names: Sequence[str], steps: int, rounds: int = 3,
                log: Callable[[str], None] = lambda line: None) -> list[dict]:
  """The figures above for each of `configs`, their rounds alternating (each
  round runs every config once), so that a machine that slows or speeds up
  during the run weighs on them all alike."""
  looped = [loop_config(c, steps) for c in configs]
  step = [_StepRounds(c) for c in looped]
  loop_rounds = [[] for _ in configs]
  step_rounds = [[] for _ in configs]
  for i in range(rounds):
    for j, settings in enumerate(looped):
      loop_rounds[j].append(_loop_round(settings))
      step_rounds[j].append(step[j].round(steps))
      name = f'{names[j]} ' if names[j] else ''
      log(f'{name}round {i + 1}/{rounds}: loop '
          f'{loop_rounds[j][-1]["images_per_sec"]:.0f} img/s, step '
          f'{step_rounds[j][-1]:.0f} img/s')
  return [_row(c, steps, loop_rounds[j], step_rounds[j])
          for j, c in enumerate(configs)]


def run(settings: settings_lib.Settings, steps: int, rounds: int = 3,
        log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
  """The figures above for `settings` (their dtype, data source and
  strategy)."""
  return run_configs([settings], [''], steps, rounds, log)[0]


def run_dtypes(settings: settings_lib.Settings, dtypes: Sequence[str],
               steps: int, rounds: int = 3,
               log: Callable[[str], None] = lambda line: None,
               steps_in_flight: Sequence[int] = ()) -> list[dict]:
  """The figures per compute dtype (and per `steps_in_flight` value, the
  settings' own if none), each with its loop's and its step's images/s as
  ratios to the first row's (`vs_first`): a run's speed-up from half
  precision next to its step's, or what the host's bound on steps ahead of
  the device costs."""
  configs, names = [], []
  for dtype in dtypes:
    for limit in steps_in_flight or [settings.steps_in_flight]:
      variant = settings_lib.replace(
          variants.in_compute_dtype(settings, dtype), steps_in_flight=limit)
      configs.append(variant)
      names.append(f'{dtype} steps_in_flight={limit}' if steps_in_flight
                   else dtype)
  rows = run_configs(configs, names, steps, rounds, log)
  compare.add_ratios(rows, 'vs_first', RATIO_FIELDS,
                     is_base=lambda r: r is rows[0])
  return rows
