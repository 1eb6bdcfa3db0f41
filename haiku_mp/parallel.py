"""Training strategies: `single` device, `pmap` data parallel, `pjit` mesh.

A `Parallel` bundles what differs between them: where the state lives, how a
process-local host batch becomes device input, the compiled steps, and how a
metric is read back. The trainer is the same for all three.
"""

import dataclasses
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import optax

from haiku_mp import loss_scaling
from haiku_mp import sharding
from haiku_mp import train_step as train_step_lib

STRATEGIES = ('single', 'pmap', 'pjit')


@dataclasses.dataclass(frozen=True)
class Parallel:
  """The strategy-specific half of a training loop."""
  strategy: str
  mesh: Optional[Mesh]
  # Builds the initial TrainState on the devices, laid out for the strategy.
  init_state: Callable[[], train_step_lib.TrainState]
  place_batch: Callable[[dict[str, np.ndarray]], dict[str, jax.Array]]
  train_step: Callable[..., Any]
  eval_step: Callable[..., Any]
  # Maps a replicated device value (metric, state field) to a single one.
  unreplicate: Callable[[Any], Any]
  # Where a restored (unreplicated) state is loaded (a tree or a prefix), and
  # how it then becomes the strategy's state.
  checkpoint_shardings: Any
  place_state: Callable[[train_step_lib.TrainState], train_step_lib.TrainState]
  state_shardings: Optional[train_step_lib.TrainState] = None

  @property
  def batch_devices(self) -> int:
    """Devices the global batch is split over."""
    if self.mesh is None:
      return 1
    return self.mesh.shape[sharding.BATCH]


def check_batch(name: str, batch_size: int, num_shards: int) -> None:
  if batch_size % num_shards:
    raise sharding.ShardingError(
        f'{name}={batch_size} is not divisible by the {num_shards} devices '
        "of the mesh's 'batch' axis")


def _single(train_step, eval_step, init_state):
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return Parallel(
      strategy='single', mesh=None, init_state=jax.jit(init_state),
      place_batch=jax.device_put,
      train_step=jax.jit(train_step, donate_argnums=0),
      eval_step=jax.jit(eval_step), unreplicate=lambda x: x,
      checkpoint_shardings=device, place_state=lambda x: x)


def _pmap(mesh, loss_fn, forward, optimizer, scaler, init_state):
  if mesh.shape[sharding.MODEL] != 1:
    raise sharding.ShardingError(
        f'parallel.strategy=pmap is data parallel only: parallel.mesh_shape '
        f'must be (N, 1), got {tuple(mesh.devices.shape)}')
  devices = list(mesh.devices.flatten())
  local = [d for d in devices if d.process_index == jax.process_index()]
  n = len(local)
  train_step = jax.pmap(
      train_step_lib.make_train_step(loss_fn, optimizer, scaler,
                                     axis_name=sharding.BATCH),
      axis_name=sharding.BATCH, donate_argnums=0, devices=devices)
  eval_step = jax.pmap(
      train_step_lib.make_eval_step(forward, axis_name=sharding.BATCH),
      axis_name=sharding.BATCH, devices=devices)

  # One copy per local device, laid out the way pmap returns its outputs.
  replicas = NamedSharding(Mesh(np.array(local), (sharding.BATCH,)),
                           P(sharding.BATCH))

  def replicate(state):
    return jax.tree.map(lambda x: jax.device_put(
        jnp.broadcast_to(x, (n,) + x.shape), replicas), state)

  def place_batch(batch):
    return jax.tree.map(
        lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)

  return Parallel(
      strategy='pmap', mesh=mesh,
      init_state=lambda: replicate(jax.jit(init_state)()),
      place_batch=place_batch, train_step=train_step, eval_step=eval_step,
      unreplicate=lambda x: jax.tree.map(lambda y: y[0], x),
      checkpoint_shardings=jax.sharding.SingleDeviceSharding(local[0]),
      place_state=replicate)


def _pjit(mesh, train_step, eval_step, init_state, config, optimizer):
  rules = sharding.parse_rules(config.parallel.sharding_rules)
  rules += sharding.DEFAULT_RULES
  state = jax.eval_shape(init_state)
  specs = sharding.param_specs(state.params, rules, mesh)
  state_sh = sharding.state_shardings(state, specs, optimizer, mesh)
  batch_sh = NamedSharding(mesh, P(sharding.BATCH))
  replicated = NamedSharding(mesh, P())
  compiled_train = jax.jit(
      train_step, in_shardings=(state_sh, batch_sh),
      out_shardings=(state_sh, replicated), donate_argnums=0)
  metrics_sh = dict(loss=replicated, accuracy=replicated,
                    num_examples=replicated, logits=batch_sh)
  compiled_eval = jax.jit(eval_step, in_shardings=(state_sh.params, batch_sh),
                          out_shardings=metrics_sh)

  def place_batch(batch):
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(batch_sh, x), batch)

  # Computed in place: no process holds the whole state on one device.
  sharded_init = jax.jit(init_state, out_shardings=state_sh)
  return Parallel(
      strategy='pjit', mesh=mesh, init_state=sharded_init,
      place_batch=place_batch, train_step=compiled_train,
      eval_step=compiled_eval, unreplicate=lambda x: x,
      checkpoint_shardings=state_sh, place_state=lambda x: x,
      state_shardings=state_sh)


def make_parallel(config: ml_collections.ConfigDict, mesh: Optional[Mesh],
                  forward: hk.Transformed,
                  optimizer: optax.GradientTransformation,
                  scaler: loss_scaling.LossScaler,
                  init_state: Callable[[], train_step_lib.TrainState]
                  ) -> Parallel:
  """The strategy `config.parallel.strategy` on `mesh` (None for `single`)."""
  strategy = config.parallel.strategy
  if strategy not in STRATEGIES:
    raise sharding.ShardingError(
        f'parallel.strategy: unknown strategy {strategy!r}; expected one of '
        f'{STRATEGIES}')
  loss_fn = train_step_lib.make_classification_loss(forward)
  if strategy == 'single':
    parallel = _single(
        train_step_lib.make_train_step(loss_fn, optimizer, scaler),
        train_step_lib.make_eval_step(forward), init_state)
  elif strategy == 'pmap':
    parallel = _pmap(mesh, loss_fn, forward, optimizer, scaler, init_state)
  else:
    parallel = _pjit(
        mesh, train_step_lib.make_train_step(loss_fn, optimizer, scaler),
        train_step_lib.make_eval_step(forward), init_state, config, optimizer)
  check_batch('batch_size', config.batch_size, parallel.batch_devices)
  check_batch('eval_batch_size', config.eval_batch_size,
              parallel.batch_devices)
  return parallel
