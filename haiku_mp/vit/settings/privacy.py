"""DP-SGD on JAX Privacy (haiku_mp/vit/privacy/dp_sgd.py)."""

from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import setting


@fields.frozen
class PrivacySettings:
  """DP-SGD: clipping, noise, accounting and microbatches."""

  enabled: bool = setting(False, 'DP-SGD on or off.')
  l2_clip_norm: float = setting(
      1.0,
      "Each example's gradient is clipped to this norm.")
  noise_multiplier: float = setting(1.0, "The noise's std over l2_clip_norm.")
  target_epsilon: float = setting(
      0.0,
      "> 0: the noise multiplier that spends this epsilon in the run's "
      'steps (replaces noise_multiplier); 0: noise_multiplier as set.')
  delta: float = setting(
      1e-05,
      'The delta of the (epsilon, delta) guarantee reported.')
  microbatch_size: int = setting(
      32,
      'Examples per device whose per-example gradients exist at once (JAX '
      "Privacy's microbatching); 0: all of a device's batch. The "
      "reference ViT's 162 at once need 7.5 GB of temp on a CPU; 32 need "
      '1.7 GB, less than its ordinary step, and run faster there '
      '(BENCHMARKS.md).')
  padding_stddevs: float = setting(
      3.0,
      'A sampled batch is padded to batch_size + this many standard '
      'deviations of its size (rounded up to divide the devices and '
      'microbatches); a larger draw takes a larger shape (a compile).')


__all__ = ['PrivacySettings']
