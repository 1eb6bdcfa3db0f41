"""Training strategies: `single` device, `pmap` data parallel, `pjit` mesh,
`fsdp` (pjit with the parameters and optimizer state split over `batch`).

The strategy named `pjit` (the config value `parallel.strategy='pjit'`, kept
for the commands and checkpoints that name it) is plain `jax.jit` with
NamedShardings on its inputs and outputs: `pjit` and `jit` are one API since
JAX 0.4.

Every strategy is a `Strategy` built the same way, `Cls(mesh, parts, rules)`,
and answers the same questions: where the state lives, how a process-local
host batch becomes device input, what the compiled steps are, what abstract
inputs they take, how a replicated value is read back. Callers never branch on
a strategy's name.
"""

import abc
import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from haiku_mp import errors
from haiku_mp.model import meta_params
from haiku_mp.update import classification
from haiku_mp.update import gradients as gradients_lib
from haiku_mp.update import loss_scaling
from haiku_mp.update import step as step_lib
from haiku_mp.update import train_state
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.parallel import stop_request
from haiku_mp.vit.parallel import wire_dtypes as communication_lib

TrainState = train_state.TrainState


class StepParts(NamedTuple):
  """What a strategy compiles its steps from: the forward, the optimizer, loss
  scaling, the initial state, the inputs' preparation and the gradients."""
  forward: hk.Transformed
  optimizer: optax.GradientTransformation
  scaler: loss_scaling.LossScaler
  # A no-argument function that builds the initial TrainState (jittable).
  init_state: Callable[[], TrainState]
  # Host batch -> model inputs, inside the compiled steps (augmentation).
  train_inputs: step_lib.TrainInputs
  eval_inputs: classification.EvalInputs
  # The train step's gradients: ordinary, or DP-SGD's.
  gradients: gradients_lib.GradientsFn
  # The precision of the collectives, for gradients that take a
  # DataParallel (ordinary ones); None: float32 reductions as the gradients
  # make them (DP-SGD's), under jit over the mesh as the compiler places them.
  communication: Optional[communication_lib.Communication] = None


class Strategy(abc.ABC):
  """The strategy-specific half of a training loop."""

  name: str
  # The mapped axis the steps average gradients and metrics over (pmap), or
  # None (jit: XLA partitions the global computation itself).
  axis_name: Optional[str] = None
  # The state's shardings over the mesh (pjit), or None.
  state_shardings: Optional[TrainState] = None
  # Whether `train_step.lower(state, batch).compile()` makes a program that
  # calls with this process's (state, batch) accept.
  compiles_ahead: bool = True
  # XLA options the train step is compiled with (_compiler_options), for a
  # caller that compiles it with options of its own.
  compiler_options: Optional[dict[str, str]] = None

  def __init__(self, mesh: Optional[Mesh], parts: StepParts,
               rules: Sequence[tuple[str, str]] = ()):
    """`rules`: (parameter pattern, spec) pairs, for a strategy that shards
    parameters (`sharding.rules`)."""
    self.mesh = mesh
    self.communication = parts.communication
    # The initial state's shapes and dtypes (jax.ShapeDtypeStruct leaves).
    self.abstract_state = jax.eval_shape(parts.init_state)
    # The steps, built here once; each strategy only wraps them (jit, pmap,
    # jit with shardings).
    self._train_step = stop_request.with_stop_request(
        step_lib.make_train_step(
            None, parts.optimizer, parts.scaler, axis_name=self.axis_name,
            inputs=parts.train_inputs,
            gradients_fn=self._gradients(parts, rules)),
        self.axis_name)
    self._eval_step = classification.make_eval_step(
        parts.forward, axis_name=self.axis_name, inputs=parts.eval_inputs)

  def _gradients(self, parts: StepParts,
                 rules: Sequence[tuple[str, str]]) -> gradients_lib.GradientsFn:
    """The train step's gradients as this strategy runs them. `rules`:
    (parameter pattern, spec) pairs, read by a strategy that shards
    parameters."""
    del rules
    if self.axis_name is None or parts.communication is None:
      return parts.gradients
    parallel = parts.communication.data_parallel()

    def gradients(loss_scale, params, rng, batch, axis_name):
      del axis_name  # self.axis_name, which `parallel` names.
      return parts.gradients(loss_scale, params, rng, batch, parallel)

    return gradients

  def describe(self) -> list[str]:
    """Lines for the run's start: what each device holds, and what its
    collectives carry."""
    if self.communication is None or self.batch_devices == 1:
      return []
    return [self.communication.describe(gathers=False)]

  @property
  def batch_devices(self) -> int:
    """Devices the global batch is split over."""
    return 1 if self.mesh is None else self.mesh.shape[sharding.BATCH]

  @abc.abstractmethod
  def init_state(self) -> TrainState:
    """The initial TrainState on the devices, laid out for the strategy."""

  @abc.abstractmethod
  def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """A process-local host batch as the steps' input."""

  @abc.abstractmethod
  def place_state(self, state: TrainState) -> TrainState:
    """A restored (unreplicated) state as the strategy's state."""

  def unreplicate(self, tree: Any) -> Any:
    """A replicated device value (metric, state field) as a single one."""
    return tree

  def to_host(self, tree: Any) -> Any:
    """Replicated device values (metrics of many steps) as host values, in
    one `device_get`: every copy starts before the first is waited for, and
    no device op runs."""
    return jax.device_get(tree)

  @property
  @abc.abstractmethod
  def checkpoint_shardings(self) -> Any:
    """Where a restored state is loaded (a tree of shardings or a prefix)."""

  @abc.abstractmethod
  def abstract_inputs(self, host_batch: dict[str, np.ndarray]
                      ) -> tuple[Any, Any]:
    """Abstract (state, batch) in the layout `train_step` expects, for a
    global batch shaped as `host_batch` (NumPy arrays)."""

  # (state, batch) -> (state, metrics), donating the state.
  train_step: Callable[..., Any]
  eval_step: Callable[..., Any]  # (params, batch) -> metrics.


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class Single(Strategy):
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
    return self.abstract_state, _abstract(host_batch)


class Pmap(Strategy):
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
    # One copy per local device, laid out the way pmap returns its outputs.
    self._replicas = NamedSharding(Mesh(np.array(local), (sharding.BATCH,)),
                                   P(sharding.BATCH))
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
    n = self._n
    return jax.tree.map(lambda x: jax.device_put(
        jnp.broadcast_to(x, (n,) + x.shape), self._replicas), state)

  def unreplicate(self, tree):
    # The first local replica as it lies on its device, its axis of one
    # dropped there: a one-device program per leaf. `y[0]` would be a program
    # on every device per leaf (a select and an all-reduce), dozens of them
    # back to back for a state, which fill XLA:CPU's queues (in_flight.py).
    local = jax.tree.map(lambda y: y.addressable_shards[0].data[0], tree)
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
    return state, _abstract(self.place_batch(host_batch))


class Pjit(Strategy):
  """`jax.jit` with NamedShardings over the ('batch', 'model') mesh: the
  batch split on `batch`, kernels split on `model` by the sharding rules.
  The gradients are computed under `shard_map` over `batch` (the `model`
  axis left to the compiler), so that their reduction is written, in the
  dtype `parallel.reduce_dtype` says, not placed by the compiler."""

  name = 'pjit'

  def _specs(self, rules):
    """Each parameter's PartitionSpec (fp8 histories included), and the
    dimension split over `batch` of each trained one (None: none)."""
    specs = sharding.param_specs(self.abstract_state.params, rules, self.mesh)
    _, trained = train_state.split_fp8(specs)
    return specs, jax.tree.map(lambda _: None, trained,
                               is_leaf=lambda x: isinstance(x, P))

  def _gradients(self, parts, rules):
    self._param_specs, self._dims = self._specs(rules)
    if parts.communication is None or self.batch_devices == 1:
      # Placed by the compiler: DP-SGD's, or a mesh with one device on
      # 'batch', where nothing is reduced.
      return parts.gradients
    _, trained = train_state.split_fp8(self.abstract_state.params)
    parallel = parts.communication.data_parallel(self._dims, trained)
    is_spec = lambda x: isinstance(x, P)
    specs = jax.tree.map(sharding.batch_part, self._param_specs,
                         is_leaf=is_spec)
    local = functools.partial(_local_gradients, parts.gradients, parallel)
    sharded = jax.shard_map(
        local, mesh=self.mesh,
        in_specs=(P(), specs, P(), P(sharding.BATCH)),
        out_specs=(specs, P(), P()), axis_names={sharding.BATCH},
        # Replicated params' gradients are reduced by DataParallel itself.
        check_vma=False)

    def gradients(loss_scale, params, rng, batch, axis_name):
      del axis_name  # None under jit: the shard_map names the axis.
      return sharded(loss_scale, params, rng, batch)

    return gradients

  def __init__(self, mesh, parts, rules=()):
    super().__init__(mesh, parts, rules)
    _, trained_specs = train_state.split_fp8(self._param_specs)
    self.state_shardings = sharding.state_shardings(
        self.abstract_state, self._param_specs, trained_specs,
        parts.optimizer, mesh)
    self._batch = NamedSharding(mesh, P(sharding.BATCH))
    replicated = NamedSharding(mesh, P())
    self.compiler_options = _compiler_options(parts.communication)
    self.train_step = jax.jit(
        self._train_step, in_shardings=(self.state_shardings, self._batch),
        out_shardings=(self.state_shardings, replicated), donate_argnums=0,
        compiler_options=self.compiler_options)
    metrics = dict(loss=replicated, accuracy=replicated,
                   num_examples=replicated, logits=self._batch)
    self.eval_step = jax.jit(
        self._eval_step,
        in_shardings=(self.state_shardings.params, self._batch),
        out_shardings=metrics)
    # Computed in place: no process holds the whole state on one device.
    self._init = jax.jit(parts.init_state, out_shardings=self.state_shardings)

  def init_state(self):
    return self._init()

  def place_batch(self, batch):
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self._batch, x),
        batch)

  def place_state(self, state):
    return state

  @property
  def checkpoint_shardings(self):
    return self.state_shardings

  def abstract_inputs(self, host_batch):
    state = sharding.with_shardings(self.abstract_state, self.state_shardings)
    return state, _abstract(host_batch)

  def _dim_leaves(self) -> list[Optional[int]]:
    """The dimension split over `batch` of each trained parameter."""
    return jax.tree.leaves(self._dims, is_leaf=lambda x: x is None)

  def _whole_params(self) -> list[Any]:
    """The trained parameters (abstract) that no device splits over
    `batch`."""
    _, abstract = train_state.split_fp8(self.abstract_state.params)
    return [v for v, d in zip(jax.tree.leaves(abstract), self._dim_leaves())
            if d is None]

  def describe(self):
    held, whole = sharding.bytes_per_device(self.abstract_state,
                                            self.state_shardings)
    lines = [f'Per device: {_mb(held)} of the state\'s {_mb(whole)} '
             f'({held / whole:.3f} of it)']
    gathers = len(self._whole_params()) < len(self._dim_leaves())
    if self.communication is not None and self.batch_devices > 1:
      lines.append(self.communication.describe(gathers=gathers))
    return lines


class Fsdp(Pjit):
  """`pjit` with every parameter and its optimizer state split over `batch`
  as well (FSDP, ZeRO-3), on a dimension the axis divides: each step
  all-gathers the parameters in `parallel.gather_dtype` and reduce-scatters
  the gradients in `parallel.reduce_dtype`."""

  name = 'fsdp'

  def __init__(self, mesh, parts, rules=()):
    if parts.communication is None:
      raise errors.ConfigError(
          'parallel.strategy=fsdp gathers parameters in its own step; '
          'DP-SGD (privacy.enabled) computes its gradients otherwise: use '
          'pjit or pmap')
    super().__init__(mesh, parts, rules)

  def _specs(self, rules):
    specs, _ = super()._specs(rules)
    histories, trained = train_state.split_fp8(specs)
    _, abstract = train_state.split_fp8(self.abstract_state.params)
    trained, dims = sharding.fsdp_specs(abstract, trained, self.mesh)
    return meta_params.merge_meta(trained, histories), dims

  def describe(self):
    lines = super().describe()
    left = self._whole_params()
    if left:
      size = sum(sharding.nbytes(v) for v in left)
      lines.append(
          f'FSDP: {len(left)} parameters ({_mb(size)}) stay whole on every '
          f'device: no dimension of theirs divides by the '
          f'{self.batch_devices} devices of \'batch\'')
    return lines


def _compiler_options(communication) -> Optional[dict[str, str]]:
  """XLA:CPU's `all-reduce-promotion` pass aborts the process ("Invalid
  binary instruction opcode copy") on a half-precision all-reduce or
  reduce-scatter inside a shard_map that leaves the `model` axis to the
  compiler. Without it, XLA:CPU's float normalization widens the reduction
  as it does its other half collectives; the program as partitioned keeps
  the half dtype (what a GPU runs)."""
  half = (communication is not None and
          jnp.dtype(communication.reduce()) != jnp.float32)
  if half and jax.default_backend() == 'cpu':
    return {'xla_disable_hlo_passes': 'all-reduce-promotion'}
  return None


def _local_gradients(gradients, parallel, loss_scale, params, rng, batch):
  """One replica's part of the gradients, inside the shard_map."""
  return gradients(loss_scale, params, rng, batch, parallel)


def _mb(size: int) -> str:
  """As the state layout's line writes bytes (haiku_mp/update/state_layout.py)."""
  return f'{size / 1e6:.2f} MB'


STRATEGIES = {cls.name: cls for cls in (Single, Pmap, Pjit, Fsdp)}


def make_strategy(name: str, mesh: Optional[Mesh], parts: StepParts,
                  rules: Sequence[tuple[str, str]] = ()) -> Strategy:
  """The strategy `name` (`parallel.strategy`) on `mesh` (None for
  `single`); `rules` place the parameters of a strategy that shards them."""
  errors.check_choice('parallel.strategy', name, STRATEGIES)
  if name != 'single' and mesh is None:
    raise errors.ConfigError(f'parallel.strategy={name} needs a device mesh')
  return STRATEGIES[name](mesh, parts, rules)
