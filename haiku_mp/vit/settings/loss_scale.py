"""Loss scaling (haiku_mp/update/loss_scaling.py, on jmp's)."""

import math

from haiku_mp import errors
from haiku_mp.update import loss_scaling
from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import setting


def _range(ok, valid: str) -> fields.Check:
  """A range every kind's settings keep, worded as `LossScaler` words its
  own arguments' (`loss_scale.factor: must be > 1, got 1.0`)."""
  return fields.worded(ok, lambda value: f': must be {valid}, got {value!r}')


@fields.frozen
class LossScaleSettings:
  """The loss scale: none, static or dynamic, and when a run gives up.
  Every setting is held to its range whichever kind reads it, so a change
  of kind meets none out of range."""

  kind: str = setting('none', "'none' | 'static' | 'dynamic'",
                      check=fields.one_of(loss_scaling.KINDS))
  initial: float = setting(
      32768.0,
      "the static scale, or the dynamic scale's start.",
      check=_range(lambda s: math.isfinite(s) and s > 0,
                   'a positive finite number'))
  period: int = setting(2000, 'dynamic: finite steps before the scale grows.',
                        check=_range(lambda p: p >= 1, 'a positive integer'))
  factor: float = setting(2.0, 'dynamic: growth and back-off factor.',
                          check=_range(lambda f: f > 1, '> 1'))
  minimum: float = setting(
      1.0,
      'dynamic: the scale never falls below this floor.',
      check=_range(lambda m: m > 0, 'in (0, loss_scale.initial]'))
  hysteresis: int = setting(
      1,
      'dynamic: back off on the k-th overflow since the scale last grew '
      'and on every one after (Megatron-LM / DeepSpeed hysteresis); 1: on '
      'every one.', check=_range(lambda h: h >= 1, 'a positive integer'))
  max_consecutive_skips: int = setting(
      50,
      'Stop after this many consecutive skipped steps at the floor. '
      'Without dynamic scaling, any non-finite step stops the run.',
      check=_range(lambda n: n >= 1, 'positive'))

  def check_rules(self, path: str) -> None:
    """The floor bounds a dynamic scale; a static one may sit below it."""
    if self.kind == 'dynamic' and self.minimum > self.initial:
      raise errors.ConfigError(
          f'{path}minimum: must be in (0, {path}initial], got '
          f'{self.minimum!r}')


__all__ = ['LossScaleSettings']
