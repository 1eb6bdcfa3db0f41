"""Loss scales from config, built on jmp, with guards for jmp 0.0.4's defects.

The state (a jmp `LossScale`) lives in `TrainState`; the static settings (kind,
floor) live in a `LossScaler` built from the config, because jmp keeps
`min_loss_scale` out of the pytree: after `jax.jit`, or any flatten/unflatten,
a `DynamicLossScale`'s floor silently returns to 1.0 (jmp PR #44 never merged).
`LossScaler.adjust` restores the configured floor before every adjustment.
The scale is always float32: jmp's `adjust` crashes on a float16 scale
(`lax.select` dtype mismatch, jmp issue #47).
"""

import dataclasses

import jax
import jax.numpy as jnp
import jmp
import ml_collections
import numpy as np

from haiku_mp import errors

KINDS = ('none', 'static', 'dynamic')


class LossScaleError(errors.ConfigError):
  """A loss-scale setting that cannot be used; names the setting."""


@dataclasses.dataclass(frozen=True)
class LossScaler:
  """Static loss-scale settings; creates and adjusts jmp loss-scale states."""
  kind: str = 'none'
  initial: float = 2.0**15
  period: int = 2000
  factor: float = 2.0
  minimum: float = 1.0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise LossScaleError(
          f'loss_scale.kind: unknown kind {self.kind!r}; expected one of {KINDS}')
    if self.kind == 'none':
      return
    if not np.isfinite(self.initial) or self.initial <= 0:
      raise LossScaleError(
          f'loss_scale.initial: must be a positive finite number, got {self.initial!r}')
    if self.kind == 'dynamic':
      if int(self.period) != self.period or self.period < 1:
        raise LossScaleError(
            f'loss_scale.period: must be a positive integer, got {self.period!r}')
      if self.factor <= 1:
        raise LossScaleError(f'loss_scale.factor: must be > 1, got {self.factor!r}')
      if self.minimum <= 0 or self.minimum > self.initial:
        raise LossScaleError(
            f'loss_scale.minimum: must be in (0, loss_scale.initial], got {self.minimum!r}')

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> 'LossScaler':
    return cls(kind=config.kind, initial=float(config.initial),
               period=int(config.period), factor=float(config.factor),
               minimum=float(config.minimum))

  def init(self) -> jmp.LossScale:
    """The initial loss-scale state."""
    if self.kind == 'none':
      return jmp.NoOpLossScale()
    scale = jnp.asarray(self.initial, jnp.float32)
    if self.kind == 'static':
      return jmp.StaticLossScale(scale)
    return jmp.DynamicLossScale(
        loss_scale=scale, counter=jnp.zeros([], jnp.int32),
        period=int(self.period), factor=self.factor,
        min_loss_scale=self._floor())

  def _floor(self) -> jax.Array:
    return jnp.asarray(self.minimum, jnp.float32)

  def adjust(self, state: jmp.LossScale, grads_finite: jax.Array) -> jmp.LossScale:
    """The next state: grows after `period` finite steps, backs off on overflow."""
    if isinstance(state, jmp.DynamicLossScale):
      state = dataclasses.replace(state, min_loss_scale=self._floor())
    return state.adjust(grads_finite)


def value(state: jmp.LossScale) -> jax.Array:
  """The current scale as a float32 scalar (1.0 for no loss scaling)."""
  return jnp.asarray(state.loss_scale, jnp.float32)
