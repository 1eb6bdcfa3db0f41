"""DP-SGD on JAX Privacy (haiku_mp/vit/privacy/dp_sgd.py)."""

import math

from haiku_mp import errors
from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import setting


def _range(ok, valid: str) -> fields.Check:
  """DP-SGD's range of a setting, whether or not it is on; the message
  shows the value as Python prints it (`privacy.delta=2.0 must be ...`)."""
  return fields.worded(ok, lambda value: f'={value} must be {valid}')


@fields.frozen
class PrivacySettings:
  """DP-SGD: clipping, noise, accounting and microbatches."""

  enabled: bool = setting(False, 'DP-SGD on or off.')
  l2_clip_norm: float = setting(
      1.0,
      "Each example's gradient is clipped to this norm.",
      check=_range(lambda n: n > 0, 'positive'))
  noise_multiplier: float = setting(
      1.0, "The noise's std over l2_clip_norm.",
      check=_range(lambda n: n >= 0, '>= 0'))
  target_epsilon: float = setting(
      0.0,
      "> 0: the noise multiplier that spends this epsilon in the run's "
      'steps (replaces noise_multiplier); 0: noise_multiplier as set.',
      check=_range(lambda e: e >= 0 and math.isfinite(e),
                   '>= 0 (0: use privacy.noise_multiplier)'))
  delta: float = setting(
      1e-05,
      'The delta of the (epsilon, delta) guarantee reported.',
      check=_range(lambda d: 0 < d < 1, 'in (0, 1)'))
  microbatch_size: int = setting(
      32,
      'Examples per device whose per-example gradients exist at once (JAX '
      "Privacy's microbatching); 0: all of a device's batch. The "
      "reference ViT's 162 at once need 7.5 GB of temp on a CPU; 32 need "
      '1.7 GB, less than its ordinary step, and run faster there '
      '(BENCHMARKS.md).',
      check=_range(lambda m: m >= 0,
                   '>= 0 (0: every example of a device at once)'))
  padding_stddevs: float = setting(
      3.0,
      'A sampled batch is padded to batch_size + this many standard '
      'deviations of its size (rounded up to divide the devices and '
      'microbatches); a larger draw takes a larger shape (a compile).',
      check=_range(lambda s: s >= 0, '>= 0'))

  def check_rules(self, path: str) -> None:
    """Noise hides a gradient only where the clipping bounds it."""
    noisy = self.noise_multiplier > 0 or self.target_epsilon > 0
    if math.isinf(self.l2_clip_norm) and noisy:
      raise errors.ConfigError(
          f'{path}l2_clip_norm=inf bounds no gradient, so no noise can hide '
          'one: set a finite clip norm, or noise_multiplier=0 and '
          'target_epsilon=0 for per-example gradients without privacy')


__all__ = ['PrivacySettings']
