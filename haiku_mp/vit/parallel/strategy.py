"""The interface every training strategy answers (`Strategy`), and what it
compiles its steps from (`StepParts`).

Every strategy is built the same way, `Cls(mesh, parts, rules)`, and answers
the same questions: where the state lives, how a process-local host batch
becomes device input, what the compiled steps are, what abstract inputs they
take, how a replicated value is read back. Callers never branch on a
strategy's name.
"""

import abc
from typing import Any, Callable, NamedTuple, Optional, Sequence

import haiku as hk
import jax
from jax.sharding import Mesh
import numpy as np
import optax

from haiku_mp.update import loss_scaling
from haiku_mp.update import classification
from haiku_mp.update import gradients as gradients_lib
from haiku_mp.update import train_state
from haiku_mp.update import step as step_lib
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.parallel import stop_request
from haiku_mp.vit.parallel import wire_dtypes

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
  communication: Optional[wire_dtypes.Communication] = None


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


def abstract(tree):
  """`tree`'s leaves as jax.ShapeDtypeStructs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
