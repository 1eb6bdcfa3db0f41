"""The strategies that lay the state out over the ('batch', 'model') mesh:
`pjit` (`jax.jit` with NamedShardings; `pjit` and `jit` are one API since
JAX 0.4, the name kept for the commands and checkpoints that use it) and
`fsdp` (pjit with the parameters and optimizer state split over `batch`
too)."""

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from haiku_mp import errors
from haiku_mp.model import meta_params
from haiku_mp.update import train_state
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.parallel import strategy as strategy_lib


class Pjit(strategy_lib.Strategy):
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
    return state, strategy_lib.abstract(host_batch)

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
