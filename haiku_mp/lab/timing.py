"""The lab's one clock: what a compiled train step costs (compile time,
memory analysis, step time), and the wall time of any compiled call.

A step works on abstract inputs (`jax.ShapeDtypeStruct` with shardings), so
measuring the reference model needs no real batch and allocates nothing but
the step.
"""

import dataclasses
import hashlib
import math
import resource
import time
from typing import Any, Optional

import jax
import numpy as np

from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import in_flight
from haiku_mp.vit.train import run_dir

_MEMORY_FIELDS = ('argument_size_in_bytes', 'output_size_in_bytes',
                  'temp_size_in_bytes', 'generated_code_size_in_bytes',
                  'alias_size_in_bytes')


def _per_device_bytes(tree, shardings) -> int:
  """Bytes one device holds of `tree` laid out by `shardings`."""
  leaves = jax.tree.leaves(tree)
  shards = jax.tree.leaves(shardings) if shardings is not None else [None] * len(
      leaves)
  total = 0
  for leaf, sharding in zip(leaves, shards):
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else (
        leaf.shape)
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def fingerprint(text: Optional[str]) -> Optional[str]:
  return text and hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """The reference train step compiled for one run's settings and layout."""
  experiment: experiment.Experiment
  compiled: Any  # Called as compiled(state, batch), donating the state.
  stats: dict[str, Any]  # compile_sec, memory analysis, per-device bytes.


def lower_train_step(exp: experiment.Experiment):
  """The train step lowered on abstract inputs (cheap: no XLA compilation)."""
  return exp.strategy.train_step.lower(*exp.abstract_inputs())


def compile_train_step(settings: settings_lib.Settings) -> CompiledStep:
  """Compiles the train step on abstract inputs and reads its memory analysis."""
  return compile_experiment(experiment.build_without_data(settings))


def compile_experiment(exp: experiment.Experiment,
                       lowered: Any = None) -> CompiledStep:
  """`compile_train_step` of a built experiment, from its `lowered` step if
  the caller already has it (`compile_sec` then excludes the lowering)."""
  settings, mesh = exp.settings, exp.mesh
  start = time.perf_counter()
  lowered = lowered or lower_train_step(exp)
  compiled = lowered.compile()
  compile_seconds = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  memory = {f: int(getattr(analysis, f, 0) or 0) for f in _MEMORY_FIELDS}
  # What the step needs at once: donated outputs reuse their arguments' bytes.
  memory['compiled_total_bytes'] = (
      memory['argument_size_in_bytes'] + memory['output_size_in_bytes'] -
      memory['alias_size_in_bytes'] + memory['temp_size_in_bytes'])
  abstract_state = exp.abstract_state
  shardings = exp.strategy.state_shardings
  per_device = dict(
      params_bytes=_per_device_bytes(
          abstract_state.params, shardings and shardings.params),
      opt_state_bytes=_per_device_bytes(
          abstract_state.opt_state, shardings and shardings.opt_state))
  stats = dict(strategy=exp.strategy.name,
               mesh_shape=mesh and list(mesh.devices.shape),
               batch_size=settings.batch_size,
               policy=settings.precision.policy,
               compile_sec=compile_seconds, **memory, **per_device,
               # Equal fingerprints: the same program (as lowered for XLA).
               program_sha256=fingerprint(lowered.as_text()))
  return CompiledStep(exp, compiled, stats)


def compiled_step_stats(settings: settings_lib.Settings) -> dict[str, Any]:
  """Compile time and per-device memory analysis of the train step."""
  return compile_train_step(settings).stats


def random_inputs(exp: experiment.Experiment):
  """The initial state and a fixed random batch, placed for the strategy."""
  return exp.strategy.init_state(), exp.strategy.place_batch(
      exp.example_batch(exp.settings.seed))


def seconds(fn, args, repeats: int) -> list[float]:
  """Wall time of each of `repeats` calls of `fn(*args)` (compiled already),
  each call waited for."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return times


def median_seconds(fn, args, repeats: int) -> float:
  """Median wall time of `fn(*args)` (compiled already), each call waited for."""
  return float(np.median(seconds(fn, args, repeats)))


def time_steps(step: CompiledStep, num_steps: int, warmup_steps: int = 1
               ) -> dict[str, Any]:
  """Median wall time of `num_steps` train steps on a fixed random batch.

  Each step is waited for (its loss read back), so a time is one whole step;
  the first `warmup_steps` are not counted.
  """
  batch_size = step.experiment.settings.batch_size
  state, batch = random_inputs(step.experiment)

  def one_step():
    nonlocal state
    state, step_metrics = step.compiled(state, batch)
    return step_metrics['loss']

  seconds(one_step, (), warmup_steps)
  system_start = resource.getrusage(resource.RUSAGE_SELF).ru_stime
  times = seconds(one_step, (), num_steps)
  system = resource.getrusage(resource.RUSAGE_SELF).ru_stime - system_start
  median = float(np.median(times))
  return dict(step_times_sec=times, median_step_sec=median,
              images_per_sec=batch_size / median,
              # The kernel's share (all threads): mapping memory, waking
              # threads; on XLA:CPU a large part of a big step.
              sys_cpu_sec_per_step=system / num_steps,
              device_peak_bytes=run_dir.peak_memory_bytes())


def dispatch_round(step, state, feed, steps: int, steps_in_flight: int):
  """(state, seconds per step) of `steps` compiled steps on `next(feed)`'s
  batches, dispatched as the trainer does: at most `steps_in_flight` ahead
  of the device, the last waited for at the end."""
  start = time.perf_counter()
  with in_flight.InFlight(steps_in_flight) as queue:
    for i in range(steps):
      state, metrics = step(state, next(feed))
      queue.push(i, metrics['loss'])
    queue.drain()
  return state, (time.perf_counter() - start) / steps
