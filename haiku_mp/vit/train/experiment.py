"""The one place that turns a run's settings into its parts.

The trainer, the benchmark, tabulate, every lab experiment and the tests ask
`build`; nothing else checks settings against what they build, makes the
device mesh, or puts precision, forward, loss, optimizer, loss scaling,
initial state and strategy together, so what is measured is what is
trained.
"""

import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional, Sequence

from absl import logging
import haiku as hk
import jax
from jax.sharding import Mesh
import numpy as np
import optax

from haiku_mp import errors
from haiku_mp.advisor import placement
from haiku_mp.model import interception
from haiku_mp.model import policies
from haiku_mp.update import loss_scaling
from haiku_mp.update import moving_average
from haiku_mp.update import schedule as schedule_lib
from haiku_mp.update import optimizer as optimizer_lib
from haiku_mp.update import classification
from haiku_mp.update import gradients as gradients_lib
from haiku_mp.update import losses
from haiku_mp.update import train_state
from haiku_mp.update import step as step_lib
from haiku_mp.vit.data import augment
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.data import sampling
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.parallel import strategies
from haiku_mp.vit.parallel import strategy as strategy_lib
from haiku_mp.vit.parallel import wire_dtypes
from haiku_mp.vit.privacy import dp_sgd
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import checks


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Everything a run of one set of settings needs."""
  settings: settings_lib.Settings
  # The ('batch', 'model') mesh `settings.parallel` asks for; None for
  # 'single'.
  mesh: Optional[Mesh]
  precision: policies.Precision
  # Every module call of one forward pass (path, class, policy, dtypes).
  module_calls: list[interception.ModuleCall]
  forward: hk.Transformed
  loss_fn: losses.LossFn
  # (key, uint8 batch[, axis_name]) -> the batch the model trains on: the
  # augmentation and mixing the train step runs first.
  train_inputs: step_lib.TrainInputs
  # The train split's size, all processes; None where nothing needed it
  # (`num_train_steps` given, no DP-SGD, real data, no `check_data`), so none
  # was read, or where the data has no metadata (tfds.testing.mock_data).
  num_train_examples: Optional[int]
  total_steps: int
  schedule: optax.Schedule
  # The params' moving average's decay per step (0: none), as ema_decay or
  # ema_horizon set it.
  ema_decay: float
  optimizer: optax.GradientTransformation
  scaler: loss_scaling.LossScaler
  # DP-SGD's settings (noise calibrated, batch padding), or None.
  privacy: Optional[dp_sgd.DpSgd]
  # A no-argument function that builds the initial TrainState from the seed.
  init_state: Callable[[], train_state.TrainState]
  abstract_state: train_state.TrainState  # jax.ShapeDtypeStruct leaves.
  strategy: strategy_lib.Strategy
  # With precision.low_bit.modules='auto', each Linear's choice and why.
  low_bit_choices: tuple[placement.Choice, ...] = ()

  @property
  def param_names(self) -> list[str]:
    """'module/path/param' per trained parameter (fp8 amax histories left
    out), in the `jax.tree.leaves` order of their gradients."""
    _, trained = train_state.split_fp8(self.abstract_state.params)
    return [sharding.param_name(path) for path, _ in
            jax.tree_util.tree_flatten_with_path(trained)[0]]

  @property
  def train_batch_size(self) -> int:
    """The global batch's shape: DP-SGD's padded Poisson batch, or
    `batch_size`."""
    if self.privacy is None:
      return self.settings.batch_size
    return self.privacy.padded_batch_size

  def example_batch(self, seed: int = 0) -> dict[str, np.ndarray]:
    """A random global train batch of the step's shape (already normalized
    model inputs); under DP-SGD `batch_size` rows of it sampled, the padding
    where a real draw of that size has it."""
    batch = pipeline.random_batch(self.settings.model,
                                        self.train_batch_size, seed)
    if self.privacy is not None:
      sampled = np.arange(self.settings.batch_size)
      batch['mask'] = (sampling.pad(sampled, self.privacy) >= 0).astype(
          np.float32)
    return batch

  def abstract_inputs(self) -> tuple[Any, Any]:
    """Abstract (state, batch) of the train step, in the strategy's layout."""
    return self.strategy.abstract_inputs(self.example_batch())

  # What a run of this experiment does beyond ordinary training (DP-SGD's
  # sampling and accounting) is asked of it here, so the loop never branches.

  def train_batches(self, split: pipeline.Split, shard: pipeline.Shard,
                    start_step: int) -> Iterator[dict[str, np.ndarray]]:
    """This process's uint8 train batches from `start_step` on: drawn by
    index, or DP-SGD's padded Poisson samples."""
    if self.privacy is None:
      return pipeline.train_batches(self.settings.seed,
                                    self.settings.batch_size, split, shard,
                                    start_step)
    return pipeline.private_train_batches(
        self.settings.seed, split, shard, self.privacy, self.total_steps,
        start_step)

  def eval_batches(self, split: pipeline.Split, shard: pipeline.Shard
                   ) -> Iterator[dict[str, np.ndarray]]:
    """This process's padded uint8 batches covering its part of `split`."""
    return pipeline.eval_batches(self.settings.eval_batch_size, split, shard)

  def load_splits(self) -> pipeline.Splits:
    """The train, val and test splits in memory, checked against the model
    and the batch size."""
    return pipeline.load(self.settings.data, self.settings.model,
                         self.settings.seed, self.settings.batch_size)

  @property
  def mean_metrics(self) -> tuple[str, ...]:
    """The train step's metrics a log window averages."""
    ordinary = ('loss', 'accuracy', 'grad_norm', 'updates_lost')
    return ordinary + (() if self.privacy is None else dp_sgd.MEAN_METRICS)

  def log_fields(self, step: int, skipped_steps: int) -> dict[str, float]:
    """What the logs show at `step` beside the metrics: under DP-SGD
    {'epsilon': spent by the steps taken up to it} (a skipped step released
    nothing); else {}."""
    if self.privacy is None:
      return {}
    return dict(epsilon=self.privacy.epsilon(step - skipped_steps))

  def summary_fields(self, steps: int, skipped_steps: int) -> dict[str, Any]:
    """What summary.json adds for this experiment (DP-SGD's guarantee)."""
    if self.privacy is None:
      return {}
    return self.privacy.summary(steps, skipped_steps)

  def describe(self) -> list[str]:
    """Lines for a run's start beyond the model's (the moving average,
    DP-SGD's settings, the state's bytes per device, communication)."""
    lines = []
    if self.ema_decay > 0:
      steps = 1 / (1 - self.ema_decay)
      lines.append(f'Moving average: decay {self.ema_decay:.6g} per step, '
                   f'a time constant of {steps:,.0f} steps '
                   f'({steps / self.total_steps:.0%} of the run\'s '
                   f'{self.total_steps:,}), evaluated beside the params')
    off_step = augment.mixing_off_step(self.settings.data, self.total_steps)
    if off_step is not None:
      lines.append(f'Mixing: off from step {off_step:,} of '
                   f'{self.total_steps:,} (the last '
                   f'{self.settings.data.mixing_off_share:.0%} of the run '
                   'trains on whole examples)')
    if self.privacy is not None:
      lines.append(self.privacy.describe(self.total_steps))
    return lines + self.low_bit_lines() + self.strategy.describe()

  def low_bit_lines(self) -> list[str]:
    """modules='auto': the choice for each Linear and why
    (`forward_lib.choice_lines`)."""
    return forward_lib.choice_lines(
        self.settings.precision.low_bit, self.low_bit_choices,
        self.precision.policy.compute_dtype)


def total_train_steps(settings: settings_lib.Settings,
                      num_train_examples: int) -> int:
  """`num_train_steps`, or `num_epochs` over the train split."""
  if settings.num_train_steps > 0:
    return int(settings.num_train_steps)
  steps = int(settings.num_epochs *
              (num_train_examples // settings.batch_size))
  if steps <= 0:
    raise errors.ConfigError(
        f'num_epochs={settings.num_epochs} with batch_size='
        f'{settings.batch_size} gives no training step')
  return steps


def on_synthetic_data(settings: settings_lib.Settings
                      ) -> settings_lib.Settings:
  """`settings` on synthetic data, for what reads no dataset (the lab, the
  benchmark, tabulate): no TensorFlow, no data dir; the schedule's length is
  then that of the synthetic train set, which changes no shape and no cost."""
  return settings_lib.replace(settings, data=dict(source='synthetic'))


def build_without_data(settings: settings_lib.Settings) -> Experiment:
  """`build` for what measures and reads no dataset (the lab, the benchmark,
  tabulate): on synthetic data."""
  return build(on_synthetic_data(settings))


def _init_state_fn(settings, forward, optimizer, scaler):
  """Takes no arrays, so a strategy can run it under jit with the state's
  shardings as outputs (nothing is ever gathered on one device)."""

  def init_state() -> train_state.TrainState:
    init_rng, state_rng = jax.random.split(jax.random.key(settings.seed))
    images = forward_lib.dummy_images(settings.model)
    params = forward.init(init_rng, images, True)
    return train_state.init_train_state(params, optimizer, scaler,
                                           state_rng)

  return init_state


def build(settings: settings_lib.Settings, *,
          devices: Optional[Sequence[jax.Device]] = None,
          total_steps: Optional[int] = None,
          check_data: bool = False) -> Experiment:
  """The run `settings` describe, on `devices` (all of them by default).

  `settings_lib.parse` checked each field and the rules between them. Builds
  what the settings describe first, once each (the precision, the sharding
  rules, the loss scaler: a bad policy, rule or scale is named now), and
  checks the settings against them (`checks`: run here and nowhere else),
  then that the batches split over the mesh's devices and the processes.
  With `check_data` (the trainer's), or where the schedule or DP-SGD needs
  the train split's size, it then checks that the data is there (a
  DataError names what is missing; a TFDS download runs here where
  `data.download` allows one). `total_steps` (the learning-rate schedule's
  length) defaults to the settings'. Compiles nothing and writes nothing.
  """
  precision = forward_lib.precision_from_config(settings)
  checks.check(settings, precision)
  rules = sharding.rules(settings.parallel)
  # Its arguments were held to the library's rules when parsed.
  scaler = loss_scaling.LossScaler.from_config(settings.loss_scale)
  mesh = sharding.mesh_for(settings.parallel, devices)
  batch_devices = 1 if mesh is None else mesh.shape[sharding.BATCH]
  checks.check_batches(settings, batch_devices, jax.process_count())
  needs_size = ((total_steps is None and settings.num_train_steps <= 0) or
                settings.privacy.enabled or settings.data.source == 'synthetic')
  num_train_examples = (pipeline.check_available(settings.data)
                        if check_data or needs_size else None)
  precision, calls, choices = forward_lib.checked_precision(
      settings, precision, batch_devices)
  forward = forward_lib.make_forward(settings.model, precision,
                                     remat=settings.remat)
  if total_steps is None:
    total_steps = total_train_steps(settings, num_train_examples)
  if settings.warmup_steps >= total_steps:
    # Valid (a run may stop early on purpose), but rarely meant.
    logging.warning(
        'warmup_steps=%d is not shorter than the run\'s %d steps: the '
        'learning rate rises for the whole run and never decays',
        settings.warmup_steps, total_steps)
  schedule = schedule_lib.learning_rate_schedule(
      settings.learning_rate, settings.warmup_steps, total_steps)
  ema_decay = moving_average.ema_decay_for(settings.ema_decay,
                                           settings.ema_horizon, total_steps)
  optimizer = optimizer_lib.make_optimizer(
      schedule, weight_decay=settings.weight_decay,
      grad_clip_norm=settings.grad_clip_norm, ema_decay=ema_decay,
      half_params=precision.half_params,
      param_update=settings.precision.param_update,
      mu_dtype=settings.precision.mu_dtype,
      nu_dtype=settings.precision.nu_dtype,
      moment_block_size=settings.precision.moment_block_size)
  init_state = _init_state_fn(settings, forward, optimizer, scaler)
  # The steps' forward: where the step names the batch axis (pmap, and the
  # shard_map of pjit and fsdp over more than one device), fp8 scales from
  # every replica's amaxes.
  step_forward = forward
  names_axis = settings.parallel.strategy == 'pmap' or (
      settings.parallel.strategy in ('pjit', 'fsdp') and
      not settings.privacy.enabled and batch_devices > 1)
  if names_axis and precision.low_bit is not None:
    step_forward = forward_lib.make_forward(
        settings.model, precision.under_pmap(sharding.BATCH),
        remat=settings.remat)
  loss_fn = classification.make_classification_loss(step_forward,
                                              settings.label_smoothing)
  communication = None if settings.privacy.enabled else (
      wire_dtypes.Communication(
          settings.parallel.gather_dtype, settings.parallel.reduce_dtype,
          precision.policy.compute_dtype,
          frozenset(c.path for c in calls
                    if precision.runs_low_bit(c.class_name, c.path))))
  private = dp_sgd.from_config(
      settings.privacy, settings.batch_size, num_train_examples, total_steps,
      batch_devices=batch_devices,
      num_processes=jax.process_count()) if settings.privacy.enabled else None
  gradients = (gradients_lib.scaled_gradients(loss_fn, scaler)
               if private is None else
               dp_sgd.make_gradients(loss_fn, scaler, private))
  train_inputs = functools.partial(augment.train_inputs, settings.data,
                                   num_classes=settings.model.num_classes,
                                   total_steps=total_steps)
  strategy = strategies.make_strategy(
      settings.parallel.strategy, mesh, strategy_lib.StepParts(
          # The eval step's: under pmap it names the axis too; pjit's and
          # fsdp's is a plain jit, whose forward names none.
          step_forward if settings.parallel.strategy == 'pmap' else forward,
          optimizer, scaler, init_state,
          train_inputs=train_inputs,
          eval_inputs=functools.partial(augment.eval_inputs, settings.data),
          gradients=gradients, communication=communication),
      rules=rules)
  return Experiment(
      settings=settings, mesh=mesh,
      precision=precision, module_calls=calls,
      forward=forward, loss_fn=loss_fn, train_inputs=train_inputs,
      num_train_examples=num_train_examples, total_steps=total_steps,
      schedule=schedule, ema_decay=ema_decay, optimizer=optimizer,
      scaler=scaler, privacy=private, init_state=init_state,
      abstract_state=strategy.abstract_state, strategy=strategy,
      low_bit_choices=tuple(choices))
