"""DP-SGD on JAX Privacy, with its precision rules.

JAX Privacy's guidance for mixed precision: parameters, per-example gradients
and activations may use any dtype strategy that is stable without privacy;
the clipped per-example gradients are summed in at least float32, and the
noise is added in at least float32. Here each example's gradient comes from
the model as configured (its compute dtype), is unscaled (loss scaling) and
clipped in float32; `jax_privacy.clipped_grad` sums the clipped gradients in
float32; the Gaussian noise (`jax_privacy.noise_addition`) is one float32
draw for the global batch from the step's key (the same under every
strategy); the noisy sum is divided by the expected batch size of the
Poisson sampling the accountant assumes.
Batches are Poisson samples (JAX Privacy's batch selection), padded to a
fixed shape; accounting and calibration are JAX Privacy's (PLD accountant).
jax-privacy is imported where it is used: ordinary training never loads it
(nor dp-accounting and scipy, 4 s of imports), so it runs where it is not
installed.

A step whose per-example gradients are not all finite (float16 overflow) is
skipped exactly as a step of ordinary training is: clipping runs with
`nan_safe=False`, so a non-finite example leaves NaN in the sum instead of
being silently zeroed, and the train step's finite check skips the update.
Such a step releases no noisy gradient, and the accountant counts only the
steps taken. Whether a step was skipped depends on the data, though, and the
loss scale that follows too; the epsilon reported does not cover that signal
(with dynamic loss scaling, skips are a handful per run).
"""

import math
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.update import keys as keys_lib
from haiku_mp.update import loss_scaling
from haiku_mp.vit.settings import PrivacySettings

# The noise search's tolerance: JAX Privacy's default (0.01 in sigma) left
# epsilon 1.6% under its target.
_CALIBRATION_TOLERANCE = 1e-4

# The train step's loss_fn: (params, rng, batch) -> (loss, metrics).
ExampleLoss = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


class DpSgd(NamedTuple):
  """The settings of a private run, as its steps and its accountant use them."""
  l2_clip_norm: float
  noise_multiplier: float
  # The expected size of the Poisson-sampled batch: the accountant's batch
  # size, and what the sum of clipped gradients is divided by.
  batch_size: int
  num_examples: int  # The training set the batches are sampled from.
  delta: float
  # The fixed shape a sampled batch is padded to (a multiple of it, in the
  # rare step that samples more).
  padded_batch_size: int
  # Examples of the global batch whose per-example gradients exist at once
  # (JAX Privacy's microbatching); None: all of them.
  microbatch_size: Optional[int] = None
  # Whether `noise_multiplier` was calibrated to a target epsilon.
  calibrated: bool = False

  @property
  def sampling_probability(self) -> float:
    return self.batch_size / self.num_examples

  def epsilon(self, steps_taken: int) -> float:
    return epsilon(steps_taken, self.noise_multiplier, self.num_examples,
                   self.batch_size, self.delta)

  def describe(self, total_steps: int) -> str:
    """One line for a run's start: the settings and the whole run's cost."""
    return (f'DP-SGD: clip {self.l2_clip_norm:g}, noise multiplier '
            f'{self.noise_multiplier:.4g}'
            f'{" (calibrated)" if self.calibrated else ""}; Poisson sampling '
            f'of expected batch {self.batch_size} of {self.num_examples} '
            f'examples (q={self.sampling_probability:.3g}), padded to '
            f'{self.padded_batch_size}, microbatch '
            f'{self.microbatch_size or "none"}; epsilon '
            f'{self.epsilon(total_steps):.4g} at delta {self.delta:g} after '
            f'all {total_steps} steps')

  def summary(self, steps: int, skipped_steps: int) -> dict[str, Any]:
    """The guarantee and settings for a run's summary.json; a skipped step
    released nothing."""
    return dict(
        epsilon=self.epsilon(steps - skipped_steps), delta=self.delta,
        noise_multiplier=self.noise_multiplier,
        l2_clip_norm=self.l2_clip_norm, private_steps=steps - skipped_steps,
        sampling=f'poisson (expected batch {self.batch_size} of '
        f'{self.num_examples}, padded to {self.padded_batch_size})')


# Metrics a private step adds, averaged over a log window: the sampled batch's
# size and its examples' gradients.
MEAN_METRICS = ('num_examples', 'example_grad_norm', 'clipped_fraction')


def padded_batch_size(batch_size: int, num_examples: int, stddevs: float,
                      multiple: int) -> int:
  """The expected Poisson batch size plus `stddevs` of its standard
  deviations, rounded up to a multiple of `multiple`."""
  q = batch_size / num_examples
  size = math.ceil(batch_size + stddevs * math.sqrt(num_examples * q * (1 - q)))
  return -(-size // multiple) * multiple


def from_config(privacy: PrivacySettings, batch_size: int,
                num_examples: int, total_steps: int, batch_devices: int,
                num_processes: int = 1) -> DpSgd:
  """`privacy` (the config's) as a run of expected batch `batch_size` on
  `batch_devices` data-parallel devices uses it. With `target_epsilon` > 0
  the noise multiplier is calibrated to spend it in `total_steps`. The
  settings' ranges were checked when they were parsed
  (`PrivacySettings`)."""
  if batch_size > num_examples:
    raise errors.ConfigError(
        f'batch_size={batch_size} (the expected Poisson batch) is '
        f'larger than the {num_examples} training examples')
  microbatch = privacy.microbatch_size * batch_devices or None
  multiple = math.lcm(microbatch or batch_devices, num_processes)
  noise = float(privacy.noise_multiplier)
  if privacy.target_epsilon > 0:
    noise = calibrate_noise(privacy.target_epsilon, total_steps, num_examples,
                            batch_size, privacy.delta)
  return DpSgd(
      l2_clip_norm=float(privacy.l2_clip_norm), noise_multiplier=noise,
      batch_size=int(batch_size), num_examples=int(num_examples),
      delta=float(privacy.delta),
      padded_batch_size=padded_batch_size(batch_size, num_examples,
                                          privacy.padding_stddevs, multiple),
      microbatch_size=microbatch, calibrated=privacy.target_epsilon > 0)


def add_noise(summed, key: jax.Array, settings: DpSgd):
  """The clipped sum plus N(0, (sigma * C)^2) per coordinate, drawn in
  float32 (rule 3) by JAX Privacy's Gaussian privatizer from `key`, divided
  by the expected batch size.

  The privatizer is made afresh from each step's key (a split of the train
  state's rng) instead of carrying its own key as state: the draw is then the
  same under every strategy and resumes with the checkpoint, and independent
  noise needs no other state.
  """
  from jax_privacy import noise_addition  # pylint: disable=g-import-not-at-top
  # No noise is none even when C is infinite (0 * inf would be NaN).
  stddev = (settings.noise_multiplier * settings.l2_clip_norm
            if settings.noise_multiplier else 0.0)
  summed = jax.tree.map(lambda x: x.astype(jnp.float32), summed)
  privatizer = noise_addition.gaussian_privatizer(
      stddev=stddev, prng_key=key, dtype=jnp.float32)
  noisy, _ = privatizer.update(summed, privatizer.init(summed))
  return jax.tree.map(lambda x: x / settings.batch_size, noisy)


def _axis_size(axis_name: Optional[str]) -> int:
  return 1 if axis_name is None else jax.lax.psum(1, axis_name)


def _psum(tree, axis_name: Optional[str]):
  return tree if axis_name is None else jax.lax.psum(tree, axis_name)


def make_gradients(loss_fn: ExampleLoss, scaler: loss_scaling.LossScaler,
                   settings: DpSgd):
  """The private counterpart of `train_step.gradients`:
  `(loss_scale, params, rng, batch, axis_name) -> (grads, loss, metrics)`.

  `batch` is a padded Poisson sample: `mask` is 1 for a sampled example and 0
  for padding. Each example's gradient of its own scaled loss (its own
  dropout key, the same under every strategy) is computed with the params
  seen as float32 (the model casts them to its dtypes as usual, so the
  gradient is float32 whatever the params' storage), unscaled, clipped to C
  and summed in float32; the sums of all replicas are added, then one float32
  noise draw from `rng` (the same on every replica) and the division by the
  expected batch size. Metrics cover the sampled examples of every replica.
  """

  def gradients(loss_scale, params, rng, batch, axis_name=None):
    if not isinstance(axis_name, (str, type(None))):
      raise TypeError('DP-SGD sums its clipped gradients in float32 over a '
                      'named axis; it takes an axis name, not '
                      f'{type(axis_name).__name__}')
    dropout_key, noise_key = jax.random.split(rng)
    real = batch['mask'].astype(jnp.float32)
    examples = {k: v for k, v in batch.items() if k != 'mask'}
    # Raw key bits: microbatching reshapes its batch arguments in Fortran
    # order, which typed key arrays do not support.
    keys = jax.random.key_data(
        keys_lib.example_keys(dropout_key, real.shape[0], axis_name))

    def scaled_example_loss(params32, key, example):
      params_as_stored = jax.tree.map(lambda p, s: p.astype(s.dtype),
                                      params32, params)
      loss, aux = loss_fn(params_as_stored, jax.random.wrap_key_data(key[0]),
                          example)
      return scaler.scale(loss_scale, loss), (loss, aux['accuracy'])

    import jax_privacy  # pylint: disable=g-import-not-at-top
    microbatch = settings.microbatch_size
    if microbatch is not None:
      microbatch //= _axis_size(axis_name)
    clipped_sum = jax_privacy.clipped_grad(
        scaled_example_loss, has_aux=True, l2_clip_norm=settings.l2_clip_norm,
        batch_argnums=(1, 2), return_grad_norms=True,
        pre_clipping_transform=lambda g: scaler.unscale(loss_scale, g),
        microbatch_size=microbatch, nan_safe=False, dtype=jnp.float32)
    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    summed, out = clipped_sum(params32, keys, examples,
                              is_padding_example=real == 0)
    losses, correct = out.aux
    norms = out.grad_norms / loss_scale.scale  # Before clipping, unscaled.
    sums = _psum(dict(
        grads=summed, loss=jnp.sum(losses * real),
        accuracy=jnp.sum(correct * real), num_examples=jnp.sum(real),
        example_grad_norm=jnp.sum(norms * real),
        clipped_fraction=jnp.sum((norms > settings.l2_clip_norm) * real)),
                 axis_name)
    count = jnp.maximum(sums['num_examples'], 1.0)
    metrics = {k: sums[k] / count for k in
               ('accuracy', 'example_grad_norm', 'clipped_fraction')}
    metrics['num_examples'] = sums['num_examples']
    grads = add_noise(sums['grads'], noise_key, settings)
    return grads, sums['loss'] / count, metrics

  return gradients


def dp_params(noise_multiplier: float, num_examples: int, batch_size: int,
              delta: float):
  """DP-SGD with Poisson sampling of expected size `batch_size`."""
  from jax_privacy import accounting  # pylint: disable=g-import-not-at-top
  return accounting.DpParams(noise_multipliers=noise_multiplier,
                             num_samples=num_examples, delta=delta,
                             batch_size=batch_size)


def _accountant():
  from jax_privacy import accounting  # pylint: disable=g-import-not-at-top
  return accounting.DpsgdTrainingAccountant(accounting.PldAccountantConfig())


def epsilon(steps_taken: int, noise_multiplier: float, num_examples: int,
            batch_size: int, delta: float) -> float:
  """Epsilon at `delta` after `steps_taken` private updates (PLD accountant)."""
  if steps_taken == 0:
    return 0.0
  if noise_multiplier == 0:
    return float('inf')
  return float(_accountant().compute_epsilon(
      steps_taken, dp_params(noise_multiplier, num_examples, batch_size,
                             delta)))


def calibrate_noise(target_epsilon: float, steps: int, num_examples: int,
                    batch_size: int, delta: float) -> float:
  """The noise multiplier that spends `target_epsilon` in `steps` updates."""
  if not target_epsilon > 0:
    raise errors.ConfigError(
        f'privacy.target_epsilon={target_epsilon} must be positive')
  from jax_privacy import accounting  # pylint: disable=g-import-not-at-top
  return float(accounting.calibrate_noise_multiplier(
      target_epsilon=target_epsilon, accountant=_accountant(),
      batch_sizes=batch_size, num_updates=steps, num_samples=num_examples,
      target_delta=delta, tol=_CALIBRATION_TOLERANCE))
