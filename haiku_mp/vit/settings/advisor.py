"""The precision advisor's thresholds (haiku_mp/advisor/): the one
settings class of `config.advisor`, each limit checked where it is
declared, and given to the library as the thresholds it describes."""

from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import setting

# Shares of a tensor's values or blocks, and errors relative to its norm:
# each in [0, 1] (1 lets everything pass).
_SHARE = fields.between(0, 1)


@fields.frozen
class AdvisorSettings:
  """What each format may cost a tensor before the advisor keeps it wider."""

  max_relative_error: float = setting(
      0.01,
      'What a format may cost an output or gradient, relative to its '
      "norm: rounding (bfloat16's own is ~0.2%, float16's ~0.02%) or, for "
      'float16 gradients at a loss scale, the values left below its '
      'normal range.',
      check=_SHARE)
  max_overflow_share: float = setting(
      0.0,
      "Share of an output's values that may overflow float16 (65504).",
      check=_SHARE)
  loss_scale_headroom: float = setting(
      1.0,
      "The window's top leaves the largest gradient measured this factor "
      'below 65504. 1: the largest scale the batches seen allow, where '
      'dynamic loss scaling settles (it probes one power of two above now '
      "and then); 2 leaves a run's larger gradients room, for a static "
      'scale.',
      check=fields.at_least(1))
  init_steps: int = setting(
      200,
      'From init, float32 training steps taken before measuring: a '
      'zero-initialized head passes almost no gradient back at first (the '
      "CPU-sized ViT's window was [2^21, 2^24] over its first 8 steps, "
      '[2^11, 2^17] after 351). A checkpoint is measured as it is.',
      check=fields.at_least(0))
  fp8_max_relative_error: float = setting(
      0.1,
      'fp8 (haiku_mp/advisor/fp8_numerics.py): what E4M3 / E5M2 may cost '
      "a Linear's matmul input, weight or output gradient, relative to "
      'its norm (their own rounding is ~2-3% and ~5% of a well-scaled '
      "tensor's).",
      check=_SHARE)
  fp8_max_underflow_share: float = setting(
      0.01,
      "fp8: share of a tensor's non-zero values that may underflow to "
      'zero.',
      check=_SHARE)
  fp8_max_saturate_share: float = setting(
      0.001,
      "fp8: share of a tensor's non-zero values that may saturate.",
      check=_SHARE)
  fp4_max_relative_error: float = setting(
      0.2,
      '4 bits (haiku_mp/advisor/fp4_numerics.py): what NVFP4 / MXFP4 may '
      'cost an operand, relative to its norm (E2M1 blocks of Gaussian '
      'values lose ~10%).',
      check=_SHARE)
  fp4_max_flushed_share: float = setting(
      0.05,
      "4 bits: share of an operand's blocks that an outlier may flush "
      "(the block's other values under E2M1's smallest step, rounded to "
      'zero).',
      check=_SHARE)


  # The library's threshold types are imported where they are made: the
  # settings import no JAX (configs/ and --help read them).
  @property
  def thresholds(self):
    """The 16-bit verdicts' limits (`verdicts.Thresholds`)."""
    from haiku_mp.advisor import verdicts  # pylint: disable=g-import-not-at-top
    return verdicts.Thresholds(self.max_relative_error,
                               self.max_overflow_share,
                               self.loss_scale_headroom)

  @property
  def fp8(self):
    from haiku_mp.advisor import fp8_numerics  # pylint: disable=g-import-not-at-top
    return fp8_numerics.Fp8Thresholds(self.fp8_max_relative_error,
                                      self.fp8_max_underflow_share,
                                      self.fp8_max_saturate_share)

  @property
  def fp4(self):
    from haiku_mp.advisor import fp4_numerics  # pylint: disable=g-import-not-at-top
    return fp4_numerics.Fp4Thresholds(self.fp4_max_relative_error,
                                      self.fp4_max_flushed_share)


__all__ = ['AdvisorSettings']
