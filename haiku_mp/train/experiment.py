"""The one place that turns a config (and a device mesh) into a run's parts.

The trainer, the benchmark, tabulate, every lab experiment and the tests ask
`build`; nothing else puts precision, forward, loss, optimizer, loss scaling,
initial state and strategy together, so what is measured is what is trained.
"""

import copy
import dataclasses
import functools
from typing import Any, Callable, Optional

from absl import logging
import haiku as hk
import jax
from jax.sharding import Mesh
import ml_collections
import numpy as np
import optax

from haiku_mp.data import augment
from haiku_mp.train import config_checks
from haiku_mp import errors
from haiku_mp.data import pipeline
from haiku_mp.train import loss_scaling
from haiku_mp.model import forward as forward_lib
from haiku_mp.train import optimizer as optimizer_lib
from haiku_mp.parallel import strategies
from haiku_mp.model import policies
from haiku_mp.privacy import dp_sgd
from haiku_mp.parallel import sharding
from haiku_mp.train import step as step_lib


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Everything a run of one config on one mesh needs."""
  config: ml_collections.ConfigDict
  mesh: Optional[Mesh]
  precision: policies.Precision
  # Every module call of one forward pass (path, class, policy, dtypes).
  module_calls: list[policies.ModuleCall]
  forward: hk.Transformed
  loss_fn: step_lib.LossFn
  # (key, uint8 batch[, axis_name]) -> the batch the model trains on: the
  # augmentation and mixing the train step runs first.
  train_inputs: step_lib.TrainInputs
  total_steps: int
  schedule: optax.Schedule
  optimizer: optax.GradientTransformation
  scaler: loss_scaling.LossScaler
  # DP-SGD's settings (noise calibrated, batch padding), or None.
  privacy: Optional[dp_sgd.DpSgd]
  # A no-argument function that builds the initial TrainState from the seed.
  init_state: Callable[[], step_lib.TrainState]
  abstract_state: step_lib.TrainState  # jax.ShapeDtypeStruct leaves.
  strategy: strategies.Strategy

  @property
  def param_names(self) -> list[str]:
    """'module/path/param' per parameter, in `jax.tree.leaves` order."""
    return [sharding.param_name(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(self.abstract_state.params)[0]]

  @property
  def train_batch_size(self) -> int:
    """The global batch's shape: DP-SGD's padded Poisson batch, or
    `batch_size`."""
    if self.privacy is None:
      return self.config.batch_size
    return self.privacy.padded_batch_size

  def example_batch(self, seed: int = 0) -> dict[str, np.ndarray]:
    """A random global train batch of the step's shape (already normalized
    model inputs); under DP-SGD `batch_size` rows of it sampled, the padding
    where a real draw of that size has it."""
    batch = pipeline.random_batch(self.config.model,
                                        self.train_batch_size, seed)
    if self.privacy is not None:
      sampled = np.arange(self.config.batch_size)
      batch['mask'] = (dp_sgd.pad(sampled, self.privacy) >= 0).astype(
          np.float32)
    return batch

  def abstract_inputs(self) -> tuple[Any, Any]:
    """Abstract (state, batch) of the train step, in the strategy's layout."""
    return self.strategy.abstract_inputs(self.example_batch())


def total_train_steps(config: ml_collections.ConfigDict) -> int:
  """`num_train_steps`, or `num_epochs` over the train split."""
  if config.num_train_steps > 0:
    return int(config.num_train_steps)
  examples = pipeline.num_train_examples(config.data)
  steps = int(config.num_epochs * (examples // config.batch_size))
  if steps <= 0:
    raise errors.ConfigError(
        f'num_epochs={config.num_epochs} with batch_size={config.batch_size} '
        'gives no training step')
  return steps


def on_synthetic_data(config: ml_collections.ConfigDict
                      ) -> ml_collections.ConfigDict:
  """`config` on synthetic data, for what reads no dataset (the lab, the
  benchmark, tabulate): no TensorFlow, no data dir; the schedule's length is
  then that of the synthetic train set, which changes no shape and no cost."""
  config = copy.deepcopy(config)
  config.data.source = 'synthetic'
  return config


def build_without_data(config: ml_collections.ConfigDict) -> Experiment:
  """`build` for what measures and reads no dataset (the lab, the benchmark,
  tabulate): on synthetic data, on the mesh `config.parallel` describes."""
  config = on_synthetic_data(config)
  return build(config, sharding.mesh_for(config.parallel))


def _init_state_fn(config, forward, optimizer, scaler):
  """Takes no arrays, so a strategy can run it under jit with the state's
  shardings as outputs (nothing is ever gathered on one device)."""

  def init_state() -> step_lib.TrainState:
    init_rng, state_rng = jax.random.split(jax.random.key(config.seed))
    params = forward.init(init_rng, forward_lib.dummy_images(config.model), True)
    return step_lib.init_train_state(params, optimizer, scaler,
                                           state_rng)

  return init_state


def build(config: ml_collections.ConfigDict, mesh: Optional[Mesh] = None,
          total_steps: Optional[int] = None) -> Experiment:
  """The run `config` describes on `mesh` (None for the `single` strategy).

  `total_steps` (the learning-rate schedule's length) defaults to the
  config's; it reads the train split's size when `num_train_steps` is -1.
  Checks every setting, override and parallel setting; compiles nothing.
  """
  config_checks.check(config)
  precision, calls = forward_lib.checked_precision(config)
  forward = forward_lib.make_forward(config.model, precision,
                                   remat=config.remat)
  if total_steps is None:
    total_steps = total_train_steps(config)
  if config.warmup_steps >= total_steps:
    # Valid (a run may stop early on purpose), but rarely meant.
    logging.warning(
        'warmup_steps=%d is not shorter than the run\'s %d steps: the '
        'learning rate rises for the whole run and never decays',
        config.warmup_steps, total_steps)
  optimizer = optimizer_lib.make_optimizer(config, total_steps,
                                           precision.half_params)
  scaler = loss_scaling.LossScaler.from_config(config.loss_scale)
  init_state = _init_state_fn(config, forward, optimizer, scaler)
  loss_fn = step_lib.make_classification_loss(forward,
                                                    config.label_smoothing)
  private = dp_sgd.from_config(
      config, pipeline.num_train_examples(config.data), total_steps,
      batch_devices=1 if mesh is None else mesh.shape[sharding.BATCH],
      num_processes=jax.process_count()) if config.privacy.enabled else None
  gradients = (functools.partial(step_lib.gradients, loss_fn, scaler)
               if private is None else
               dp_sgd.make_gradients(loss_fn, scaler, private))
  train_inputs = functools.partial(augment.train_inputs, config.data,
                                   num_classes=config.model.num_classes)
  strategy = strategies.make_strategy(config, mesh, strategies.Model(
      forward, loss_fn, optimizer, scaler, init_state,
      train_inputs=train_inputs,
      eval_inputs=functools.partial(augment.eval_inputs, config.data),
      gradients=gradients))
  return Experiment(
      config=config, mesh=mesh, precision=precision, module_calls=calls,
      forward=forward, loss_fn=loss_fn, train_inputs=train_inputs,
      total_steps=total_steps,
      schedule=optimizer_lib.learning_rate_schedule(config, total_steps),
      optimizer=optimizer, scaler=scaler, privacy=private,
      init_state=init_state,
      abstract_state=strategy.abstract_state, strategy=strategy)
