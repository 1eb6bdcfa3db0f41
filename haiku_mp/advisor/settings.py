"""The advisor's settings (`config.advisor`), parsed once: each limit
checked by one rule, and returned as the thresholds it describes."""

import dataclasses

import ml_collections

from haiku_mp import errors
from haiku_mp.advisor import fp4_numerics
from haiku_mp.advisor import fp8_numerics
from haiku_mp.advisor import verdicts

# Shares of a tensor's values or blocks, and errors relative to its norm:
# each in [0, 1] (1 lets everything pass).
_SHARES = ('max_relative_error', 'max_overflow_share',
           'fp8_max_relative_error', 'fp8_max_underflow_share',
           'fp8_max_saturate_share', 'fp4_max_relative_error',
           'fp4_max_flushed_share')


@dataclasses.dataclass(frozen=True)
class AdvisorSettings:
  """What `config.advisor` describes: the limits of each format's verdicts,
  and the float32 steps taken from init before measuring."""
  thresholds: verdicts.Thresholds
  fp8: fp8_numerics.Fp8Thresholds
  fp4: fp4_numerics.Fp4Thresholds
  init_steps: int


def parse(advisor: ml_collections.ConfigDict) -> AdvisorSettings:
  """`config.advisor` checked (a `ConfigError` naming the first bad field)
  and turned into the settings it describes."""
  for name in _SHARES:
    if not 0 <= advisor[name] <= 1:
      raise errors.ConfigError(
          f'advisor.{name}={advisor[name]:g} must be in [0, 1]')
  if not advisor.loss_scale_headroom >= 1:
    raise errors.ConfigError(
        f'advisor.loss_scale_headroom={advisor.loss_scale_headroom:g} must '
        'be >= 1')
  if advisor.init_steps < 0:
    raise errors.ConfigError(
        f'advisor.init_steps={advisor.init_steps} must be >= 0')
  return AdvisorSettings(
      thresholds=verdicts.Thresholds(
          float(advisor.max_relative_error), float(advisor.max_overflow_share),
          float(advisor.loss_scale_headroom)),
      fp8=fp8_numerics.Fp8Thresholds(
          float(advisor.fp8_max_relative_error),
          float(advisor.fp8_max_underflow_share),
          float(advisor.fp8_max_saturate_share)),
      fp4=fp4_numerics.Fp4Thresholds(
          float(advisor.fp4_max_relative_error),
          float(advisor.fp4_max_flushed_share)),
      init_steps=int(advisor.init_steps))
