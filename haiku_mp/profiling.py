"""What a compiled train step costs: compile time, memory analysis, step time.

Works on abstract inputs (`jax.ShapeDtypeStruct` with shardings), so measuring
the reference model needs no real batch and allocates nothing but the step.
"""

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


def _abstract_inputs(config, parallel, init_state):
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


def compiled_step_stats(config: ml_collections.ConfigDict,
                        mesh: Optional[Mesh]) -> dict[str, Any]:
  """Compile time and per-device memory analysis of the train step."""
  parallel, init_state = build(config, mesh)
  state, batch = _abstract_inputs(config, parallel, init_state)
  start = time.perf_counter()
  lowered = parallel.train_step.lower(state, batch)
  compiled = lowered.compile()
  compile_seconds = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  memory = {f: int(getattr(analysis, f, 0) or 0) for f in _MEMORY_FIELDS}
  abstract_state = jax.eval_shape(init_state)
  shardings = parallel.state_shardings
  per_device = dict(
      params_bytes=_per_device_bytes(
          abstract_state.params, shardings and shardings.params),
      opt_state_bytes=_per_device_bytes(
          abstract_state.opt_state, shardings and shardings.opt_state))
  return dict(strategy=parallel.strategy,
              mesh_shape=mesh and list(mesh.devices.shape),
              batch_size=config.batch_size,
              policy=config.precision.policy,
              compile_sec=compile_seconds, **memory, **per_device)
