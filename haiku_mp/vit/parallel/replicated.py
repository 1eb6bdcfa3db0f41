"""The strategies whose every device holds the whole state: `single` (one
device, `jax.jit`) and `pmap` (data parallel over the mesh's `batch`
axis)."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from haiku_mp import errors
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.parallel import strategy as strategy_lib


@functools.partial(jax.jit, static_argnums=(1, 2))
def _stacked(tree, n, layout):
  """Each leaf of `tree` `n` times along a new leading axis, laid out as
  `layout`."""
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
      jnp.broadcast_to(x, (n,) + x.shape), layout), tree)


@jax.jit
def _first_replica(tree):
  """Each leaf's first entry along its leading axis, on the leaf's device."""
  return jax.tree.map(lambda y: y[0], tree)


class Single(strategy_lib.Strategy):
  """One device, `jax.jit`."""

  name = 'single'

  def __init__(self, mesh, parts, rules=()):
    super().__init__(mesh, parts)
    if jax.process_count() > 1:
      raise errors.ConfigError(
          f'parallel.strategy=single cannot span {jax.process_count()} '
          'processes; use pmap or pjit')
    self._device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    self.train_step = jax.jit(self._train_step, donate_argnums=0)
    self.eval_step = jax.jit(self._eval_step)
    # Committed to the device, as a restored state is: a fresh and a resumed
    # run then lower the same program (one persistent-cache entry, not two).
    self._init = jax.jit(parts.init_state, out_shardings=self._device)

  def init_state(self):
    return self._init()

  def place_batch(self, batch):
    return jax.device_put(batch)

  def place_state(self, state):
    # Committed, as `init_state`'s and a restored state are: a state made
    # elsewhere (eagerly, say) then meets the same programs.
    return jax.device_put(state, self._device)

  @property
  def checkpoint_shardings(self):
    return self._device

  def abstract_inputs(self, host_batch):
    return self.abstract_state, strategy_lib.abstract(host_batch)


class Pmap(strategy_lib.Strategy):
  """Data parallel over the mesh's `batch` axis: a replicated state,
  per-device batches, gradients averaged before the finite check."""

  name = 'pmap'
  axis_name = sharding.BATCH

  def __init__(self, mesh, parts, rules=()):
    super().__init__(mesh, parts)
    if mesh.shape[sharding.MODEL] != 1:
      raise sharding.ShardingError(
          f'parallel.strategy=pmap is data parallel only: parallel.mesh_shape '
          f'must be (N, 1), got {tuple(mesh.devices.shape)}')
    devices = list(mesh.devices.flatten())
    local = [d for d in devices if d.process_index == jax.process_index()]
    self._n = len(local)
    self.train_step = jax.pmap(self._train_step, axis_name=self.axis_name,
                               donate_argnums=0, devices=devices)
    # Over several processes, pmap lowers for the global devices' shapes
    # (8 replicas) while each process calls with its own (4): its ahead-of-
    # time program refuses every call. Its own call compiles the same.
    self.compiles_ahead = jax.process_count() == 1
    self.eval_step = jax.pmap(self._eval_step, axis_name=self.axis_name,
                              devices=devices)
    # One copy per local device, laid out the way pmap returns its outputs,
    # made from the whole value on each of them.
    local_mesh = Mesh(np.array(local), (sharding.BATCH,))
    self._replicas = NamedSharding(local_mesh, P(sharding.BATCH))
    self._everywhere = NamedSharding(local_mesh, P())
    self._first = jax.sharding.SingleDeviceSharding(local[0])
    firsts = {}
    for d in devices:
      firsts.setdefault(d.process_index, d)
    self._one_per_process = NamedSharding(
        Mesh(np.array(list(firsts.values())), ('process',)), P())
    self._init = jax.jit(parts.init_state)

  def init_state(self):
    return self.place_state(self._init())

  def place_batch(self, batch):
    n = self._n
    return jax.tree.map(
        lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)

  def place_state(self, state):
    # The state sent to every local device, then stacked there: one program
    # for the whole state, where a broadcast per leaf compiled one per shape
    # (a tiny state on 8 CPU devices, the first time: 0.70 s, then 0.10 s).
    return _stacked(jax.device_put(state, self._everywhere), self._n,
                    self._replicas)

  def unreplicate(self, tree):
    # The first local replica as it lies on its device, its axis of one
    # dropped there: one program on that device for the whole tree. `y[0]`
    # would be a program on every device per leaf (a select and an
    # all-reduce), dozens of them back to back for a state, which fill
    # XLA:CPU's queues (in_flight.py); one program per leaf on the first
    # device compiled a slice and a squeeze per shape (a state's first
    # unreplicate on two CPU cores: 0.40 s, then 0.19 s as one program).
    local = _first_replica(
        jax.tree.map(lambda y: y.addressable_shards[0].data, tree))
    if jax.process_count() == 1:
      return local
    # Several processes: one global value, held once by each (a checkpoint
    # of it is then written once, not by every process).
    return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
        x.shape, self._one_per_process, [x]), local)

  def to_host(self, tree):
    # This process's first replica as it lies on its device (a view, no
    # slicing op), fetched, then its leading axis of one dropped on the host.
    local = jax.tree.map(lambda y: y.addressable_shards[0].data, tree)
    return jax.tree.map(lambda y: y[0], jax.device_get(local))

  @property
  def checkpoint_shardings(self):
    return self._first

  def abstract_inputs(self, host_batch):
    state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((self._n,) + x.shape, x.dtype),
        self.abstract_state)
    return state, strategy_lib.abstract(self.place_batch(host_batch))
