"""What a compiled train step costs: compile time, memory analysis, step time.

Works on abstract inputs (`jax.ShapeDtypeStruct` with shardings), so measuring
the reference model needs no real batch and allocates nothing but the step.
"""

import dataclasses
import hashlib
import math
import time
from typing import Any, Optional

import jax
from jax.sharding import Mesh
import ml_collections
import numpy as np

from haiku_mp import loss_scaling
from haiku_mp import model
from haiku_mp import optimizer as optimizer_lib
from haiku_mp import parallel as parallel_lib
from haiku_mp import sharding
from haiku_mp import trainer

_MEMORY_FIELDS = ('argument_size_in_bytes', 'output_size_in_bytes',
                  'temp_size_in_bytes', 'generated_code_size_in_bytes',
                  'alias_size_in_bytes')


def build(config: ml_collections.ConfigDict, mesh: Optional[Mesh]):
  """The `Parallel` for `config` and a function that makes its initial state."""
  forward, precision = model.build(config)
  optimizer = optimizer_lib.make_optimizer(config, 1000, precision.half_params)
  scaler = loss_scaling.LossScaler.from_config(config.loss_scale)

  init_state = trainer.make_init_state(config, forward, optimizer, scaler)
  return parallel_lib.make_parallel(config, mesh, forward, optimizer, scaler,
                                    init_state), init_state


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


def abstract_inputs(config, parallel, init_state):
  """Abstract (state, batch) in the layout the strategy's step expects."""
  state = jax.eval_shape(init_state)
  size = config.model.image_size
  batch = dict(
      image=np.zeros((config.batch_size, size, size, 3), np.float32),
      label=np.zeros((config.batch_size,), np.int32))
  if parallel.strategy == 'pmap':
    n = jax.local_device_count()
    state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype), state)
    batch = parallel.place_batch(batch)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         batch)
  elif parallel.strategy == 'pjit':
    state = sharding.with_shardings(state, parallel.state_shardings)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         batch)
  return state, batch


def device_peak_bytes() -> Optional[int]:
  """The largest peak bytes in use of the local devices; None where unknown (CPU)."""
  peaks = [(d.memory_stats() or {}).get('peak_bytes_in_use')
           for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None


def fingerprint(text: Optional[str]) -> Optional[str]:
  return text and hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class CompiledStep:
  """The reference train step compiled for one config and layout."""
  parallel: parallel_lib.Parallel
  compiled: Any  # Called as compiled(state, batch), donating the state.
  stats: dict[str, Any]  # compile_sec, memory analysis, per-device bytes.


def compile_train_step(config: ml_collections.ConfigDict,
                       mesh: Optional[Mesh]) -> CompiledStep:
  """Compiles the train step on abstract inputs and reads its memory analysis."""
  parallel, init_state = build(config, mesh)
  state, batch = abstract_inputs(config, parallel, init_state)
  start = time.perf_counter()
  lowered = parallel.train_step.lower(state, batch)
  compiled = lowered.compile()
  compile_seconds = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  memory = {f: int(getattr(analysis, f, 0) or 0) for f in _MEMORY_FIELDS}
  # What the step needs at once: donated outputs reuse their arguments' bytes.
  memory['compiled_total_bytes'] = (
      memory['argument_size_in_bytes'] + memory['output_size_in_bytes'] -
      memory['alias_size_in_bytes'] + memory['temp_size_in_bytes'])
  abstract_state = jax.eval_shape(init_state)
  shardings = parallel.state_shardings
  per_device = dict(
      params_bytes=_per_device_bytes(
          abstract_state.params, shardings and shardings.params),
      opt_state_bytes=_per_device_bytes(
          abstract_state.opt_state, shardings and shardings.opt_state))
  stats = dict(strategy=parallel.strategy,
               mesh_shape=mesh and list(mesh.devices.shape),
               batch_size=config.batch_size,
               policy=config.precision.policy,
               compile_sec=compile_seconds, **memory, **per_device,
               # Equal fingerprints: the same program (as lowered for XLA).
               program_sha256=fingerprint(lowered.as_text()))
  return CompiledStep(parallel, compiled, stats)


def compiled_step_stats(config: ml_collections.ConfigDict,
                        mesh: Optional[Mesh]) -> dict[str, Any]:
  """Compile time and per-device memory analysis of the train step."""
  return compile_train_step(config, mesh).stats


def random_inputs(config: ml_collections.ConfigDict,
                  parallel: parallel_lib.Parallel):
  """The initial state and a fixed random batch, placed for the strategy."""
  rng = np.random.default_rng(config.seed)
  size = config.model.image_size
  host_batch = dict(
      image=rng.standard_normal((config.batch_size, size, size, 3),
                                np.float32),
      label=rng.integers(0, config.model.num_classes, config.batch_size,
                         dtype=np.int32))
  return parallel.init_state(), parallel.place_batch(host_batch)


def time_steps(config: ml_collections.ConfigDict, step: CompiledStep,
               num_steps: int, warmup_steps: int = 1) -> dict[str, Any]:
  """Median wall time of `num_steps` train steps on a fixed random batch.

  Each step is waited for (its loss read back), so a time is one whole step;
  the first `warmup_steps` are not counted.
  """
  state, batch = random_inputs(config, step.parallel)
  times = []
  for i in range(warmup_steps + num_steps):
    start = time.perf_counter()
    state, metrics = step.compiled(state, batch)
    jax.block_until_ready(metrics['loss'])
    if i >= warmup_steps:
      times.append(time.perf_counter() - start)
  median = float(np.median(times))
  return dict(step_times_sec=times, median_step_sec=median,
              images_per_sec=config.batch_size / median,
              device_peak_bytes=device_peak_bytes())
