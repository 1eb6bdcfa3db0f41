"""Loss scaling (haiku_mp/update/loss_scaling.py, on jmp's)."""

from haiku_mp.update import loss_scaling
from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import setting


@fields.frozen
class LossScaleSettings:
  """The loss scale: none, static or dynamic, and when a run gives up.
  Every setting is held to its range whichever kind reads it, so a change
  of kind meets none out of range."""

  kind: str = setting('none', "'none' | 'static' | 'dynamic'",
                      check=fields.one_of(loss_scaling.KINDS))
  initial: float = setting(
      32768.0, "the static scale, or the dynamic scale's start.")
  period: int = setting(2000, 'dynamic: finite steps before the scale grows.')
  factor: float = setting(2.0, 'dynamic: growth and back-off factor.')
  minimum: float = setting(
      1.0, 'dynamic: the scale never falls below this floor.')
  hysteresis: int = setting(
      1,
      'dynamic: back off on the k-th overflow since the scale last grew '
      'and on every one after (Megatron-LM / DeepSpeed hysteresis); 1: on '
      'every one.')
  max_consecutive_skips: int = setting(
      50,
      'Stop after this many consecutive skipped steps at the floor. '
      'Without dynamic scaling, any non-finite step stops the run.')

  def check_rules(self, path: str) -> None:
    """Each setting in its range whichever kind reads it (so that a change
    of kind meets none out of range), and a dynamic scale's floor under its
    start: `LossScaler`'s rules for its own arguments, asked of it once and
    named by the settings' paths (`loss_scale.initial: ...`)."""
    try:
      loss_scaling.LossScaler.from_config(self)
    except loss_scaling.LossScaleError as error:
      raise error.named(prefix=path) from None


__all__ = ['LossScaleSettings']
