"""The input pipeline benchmark: does the data ever make the device wait?

Measured in one process, on the config's own data source and train step:
- `host_images_per_sec`: the host's part, batch indices and uint8 gathers;
- `augment_images_per_sec`: the device's part alone (the config's
  augmentation, normalization and mixing), jitted on a batch already there;
  `augment_share_of_step`: its time per batch over the train step's;
- `pipeline_images_per_sec`: both in sequence, each batch moved to the device
  and augmented before the next is read (no overlap: a lower bound);
- the same compiled train step run on one fixed batch already on the device
  (`device_batch`: no pipeline, as `launch.benchmark` measures) and fed batch
  by batch by the pipeline, with the trainer's prefetch (`pipeline_fed`), in
  alternating rounds. `fed_slowdown` is how much slower the fed step is.
"""

import time
from typing import Any

import jax
import numpy as np

from haiku_mp.lab import hardware
from haiku_mp.lab import timing
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.data import prefetch
from haiku_mp.vit.train import experiment

# Targets of the pipeline: images/s over the step's, and the fed step's
# slowdown against the step on a device batch.
TARGET_PIPELINE_OVER_STEP = 20.0
TARGET_FED_SLOWDOWN = 0.05
# The augmentation's time per batch over the reference step's.
TARGET_AUGMENT_SHARE = 0.05


def _images_per_sec(fn, batch_size: int, repeats: int) -> float:
  """Images/s of `fn()` (which handles one batch and waits for it)."""
  fn()  # Compiles, or warms up.
  return batch_size * repeats / sum(timing.seconds(fn, (), repeats))


def run(settings: settings_lib.Settings, steps: int, rounds: int = 3,
        repeats: int = 20) -> dict[str, Any]:
  """The figures above for `settings` (their data source, batch and
  strategy)."""
  exp = experiment.build(settings)
  strategy = exp.strategy
  load_start = time.perf_counter()
  splits = exp.load_splits()
  load_seconds = time.perf_counter() - load_start
  shard = pipeline.Shard.current()
  batches = exp.train_batches(splits.train, shard, 0)
  local_batch = pipeline.local_batch_size(settings.batch_size, shard)

  host = _images_per_sec(lambda: next(batches), local_batch, repeats)
  augment_fn = jax.jit(exp.train_inputs)
  key = jax.random.key(settings.seed)
  device_batch = jax.device_put(next(batches))
  on_device = _images_per_sec(
      lambda: jax.block_until_ready(augment_fn(key, device_batch)),
      local_batch, repeats)
  through_pipeline = _images_per_sec(
      lambda: jax.block_until_ready(
          augment_fn(key, jax.device_put(next(batches)))),
      local_batch, repeats)

  state = strategy.init_state()
  fixed = strategy.place_batch(next(batches))
  step = strategy.train_step.lower(state, fixed).compile()
  with prefetch.DevicePrefetch(batches, strategy.place_batch,
                               settings.data.prefetch_batches) as fed:
    feeds = dict(device_batch=iter(lambda: fixed, None), pipeline_fed=fed)
    # Warm-up.
    state, _ = timing.dispatch_round(step, state, feeds['device_batch'], 1,
                                     settings.steps_in_flight)
    seconds = {name: [] for name in feeds}
    for _ in range(rounds):
      for name, feed in feeds.items():
        state, per_step = timing.dispatch_round(
            step, state, feed, steps, settings.steps_in_flight)
        seconds[name].append(per_step)
  step_time = {name: float(np.median(s)) for name, s in seconds.items()}
  step_images = settings.batch_size / step_time['device_batch']
  slowdown = step_time['pipeline_fed'] / step_time['device_batch'] - 1
  augment_share = (local_batch / on_device) / step_time['device_batch']
  return dict(
      **hardware.describe(),
      source=settings.data.source,
      policy=settings.precision.policy,
      batch_size=settings.batch_size,
      augment=settings.data.augment,
      augment_policy=settings.data.policy if settings.data.augment else None,
      strategy=strategy.name,
      train_examples=len(splits.train.labels),
      load_sec=load_seconds,
      host_images_per_sec=host,
      augment_images_per_sec=on_device,
      augment_share_of_step=augment_share,
      pipeline_images_per_sec=through_pipeline,
      steps_per_round=steps,
      rounds=rounds,
      step_time_s=step_time,
      step_times_s=seconds,
      step_images_per_sec=step_images,
      pipeline_over_step=through_pipeline / step_images,
      fed_slowdown=slowdown,
      targets=dict(
          pipeline_over_step=TARGET_PIPELINE_OVER_STEP,
          pipeline_over_step_met=through_pipeline / step_images
          >= TARGET_PIPELINE_OVER_STEP,
          fed_slowdown=TARGET_FED_SLOWDOWN,
          fed_slowdown_met=slowdown <= TARGET_FED_SLOWDOWN,
          augment_share_of_step=TARGET_AUGMENT_SHARE,
          augment_share_of_step_met=augment_share <= TARGET_AUGMENT_SHARE))
