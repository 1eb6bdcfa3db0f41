"""DP-SGD gradients and accounting on JAX Privacy, with its precision rules.

JAX Privacy's guidance for mixed precision: parameters, per-example gradients
and activations may use any dtype strategy that is stable without privacy;
the clipped per-example gradients are summed in at least float32, and the
noise is added in at least float32. Here the per-example gradients come from
the policy's compute dtype (the model as configured), `jax_privacy.clipped_grad`
clips and sums them in float32, the Gaussian noise is one float32 draw for the
global batch from the step's key, and the sum is divided by the batch size the
accountant assumes. Accounting and calibration are JAX Privacy's.

Not yet wired into the train step and the config (the next part of the work).
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import jax_privacy
from jax_privacy import accounting

from haiku_mp import errors

# The noise search's tolerance: JAX Privacy's default (0.01 in sigma) left
# epsilon 1.6% under its target.
_CALIBRATION_TOLERANCE = 1e-4

# The train step's loss_fn: (params, rng, batch) -> (loss, metrics).
ExampleLoss = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


class DpSgd(NamedTuple):
  """The settings of one private step."""
  l2_clip_norm: float
  noise_multiplier: float
  # The expected batch size of the sampling the accountant assumes: the sum of
  # clipped gradients is divided by it (not by the examples actually drawn).
  batch_size: int
  microbatch_size: Optional[int] = None

  def check(self) -> 'DpSgd':
    if not self.l2_clip_norm > 0:
      raise errors.ConfigError(
          f'privacy.l2_clip_norm={self.l2_clip_norm} must be positive')
    if self.noise_multiplier < 0:
      raise errors.ConfigError(
          f'privacy.noise_multiplier={self.noise_multiplier} must be >= 0')
    if self.microbatch_size is not None and (
        self.microbatch_size <= 0 or self.batch_size % self.microbatch_size):
      raise errors.ConfigError(
          f'privacy.microbatch_size={self.microbatch_size} must divide the '
          f'batch size {self.batch_size}')
    return self


def clipped_sum(loss: ExampleLoss, settings: DpSgd):
  """`(params, rng, batch) -> (float32 sum of clipped per-example gradients,
  per-example gradient norms)`: each example's gradient in the model's own
  dtypes, clipped to `l2_clip_norm` and summed in float32 (JAX Privacy's
  rule 2). Each example gets its own dropout key."""
  grad_fn = jax_privacy.clipped_grad(
      lambda params, rng, batch: loss(params, rng, batch)[0], argnums=0, l2_clip_norm=settings.l2_clip_norm, batch_argnums=2,
      prng_argnum=1, microbatch_size=settings.microbatch_size,
      return_grad_norms=True, dtype=jnp.float32)

  def run(params, rng, batch):
    grads, aux = grad_fn(params, rng, batch)
    return grads, aux.grad_norms

  return run


def add_noise(summed, key: jax.Array, settings: DpSgd):
  """The clipped sum plus N(0, (sigma * C)^2) per coordinate, drawn in
  float32 (rule 3) from `key`, divided by the expected batch size."""
  # No noise is none even when C is infinite (0 * inf would be NaN).
  stddev = (settings.noise_multiplier * settings.l2_clip_norm
            if settings.noise_multiplier else 0.0)
  leaves, treedef = jax.tree.flatten(summed)
  keys = jax.random.split(key, len(leaves))
  noisy = [x.astype(jnp.float32) + stddev * jax.random.normal(
      k, x.shape, jnp.float32) for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, [x / settings.batch_size for x in noisy])


def dp_params(noise_multiplier: float, num_examples: int, batch_size: int,
              delta: float) -> accounting.DpParams:
  """DP-SGD with Poisson sampling of expected size `batch_size`."""
  return accounting.DpParams(noise_multipliers=noise_multiplier,
                             num_samples=num_examples, delta=delta,
                             batch_size=batch_size)


def _accountant() -> accounting.DpsgdTrainingAccountant:
  return accounting.DpsgdTrainingAccountant(accounting.PldAccountantConfig())


def epsilon(steps_taken: int, noise_multiplier: float, num_examples: int,
            batch_size: int, delta: float) -> float:
  """Epsilon at `delta` after `steps_taken` private updates (PLD accountant)."""
  if steps_taken == 0:
    return 0.0
  return float(_accountant().compute_epsilon(
      steps_taken, dp_params(noise_multiplier, num_examples, batch_size,
                             delta)))


def calibrate_noise(target_epsilon: float, steps: int, num_examples: int,
                    batch_size: int, delta: float) -> float:
  """The noise multiplier that spends `target_epsilon` in `steps` updates."""
  if not target_epsilon > 0:
    raise errors.ConfigError(
        f'privacy.target_epsilon={target_epsilon} must be positive')
  return float(accounting.calibrate_noise_multiplier(
      target_epsilon=target_epsilon, accountant=_accountant(),
      batch_sizes=batch_size, num_updates=steps, num_samples=num_examples,
      target_delta=delta, tol=_CALIBRATION_TOLERANCE))
