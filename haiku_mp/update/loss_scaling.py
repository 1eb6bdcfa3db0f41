"""Loss scales built on jmp, with guards for jmp 0.0.4's defects.

The state that changes (scale and finite-step counter) is a plain NamedTuple in
`TrainState`; the static settings (kind, period, factor, floor) live in a
`LossScaler` built from its arguments, which makes jmp's `NoOpLossScale`,
`StaticLossScale` or `DynamicLossScale` from the two for every operation.
jmp's own classes make poor state: `DynamicLossScale` keeps `min_loss_scale`
out of its pytree, so after `jax.jit` (or any flatten/unflatten) its floor
silently returns to 1.0 (jmp PR #44 never merged), and its `__post_init__`
traces its leaves, which breaks `jit(...).lower` on abstract inputs. The scale
is always float32: jmp's `adjust` crashes on a float16 scale (`lax.select`
dtype mismatch, jmp issue #47).
"""

import dataclasses
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import jmp
import numpy as np

from haiku_mp import errors
from haiku_mp.update import state_check

KINDS = ('none', 'static', 'dynamic')
T = TypeVar('T')


class LossScaleState(NamedTuple):
  """The part of a loss scale that changes from step to step."""
  scale: jax.Array  # float32 scalar; 1.0 for no loss scaling.
  counter: jax.Array  # int32 scalar: consecutive finite steps (dynamic).
  overflows: jax.Array  # int32 scalar: consecutive non-finite steps.
  # int32 scalar (dynamic): overflows left before the scale backs off; set to
  # `hysteresis` at the start and whenever the scale grows.
  hysteresis: jax.Array


# A state per kind, so that a step can tell a state from another kind's
# scaler (a 'none' state stepped with a dynamic scaler would keep a scale
# of 1 and never say so): the class is in the pytree's structure, not in
# its leaves, so checkpoints hold the same arrays as before.
class NoLossScaleState(LossScaleState):
  """The state of `LossScaler('none')`."""


class StaticLossScaleState(LossScaleState):
  """The state of `LossScaler('static')`."""


class DynamicLossScaleState(LossScaleState):
  """The state of `LossScaler('dynamic')`."""


_STATE_TYPES = {'none': NoLossScaleState, 'static': StaticLossScaleState,
                'dynamic': DynamicLossScaleState}


class LossScaleError(errors.ArgumentError):
  """A loss-scale argument that cannot be used, or a run it stops; names
  the `LossScaler` argument (`$initial`), which an application that passed
  its settings renames to its own (`named(prefix=...)`)."""


@dataclasses.dataclass(frozen=True)
class LossScaler:
  """Static loss-scale settings; creates and adjusts jmp loss-scale states.
  The state (scale, counters) lives in the `TrainState`, so jit and
  checkpoints carry it.

  Example:
    scaler = haiku_mp.LossScaler('dynamic', initial=2.0**15, period=2000)
    train_step = haiku_mp.make_train_step(loss_fn, optimizer, scaler)
  """
  kind: str = 'none'
  initial: float = 2.0**15
  period: int = 2000
  factor: float = 2.0
  minimum: float = 1.0
  # Back off on the k-th overflow since the scale last grew and on every one
  # after (Megatron-LM, DeepSpeed); 1 backs off on every overflow.
  hysteresis: int = 1
  # Stop the run after this many consecutive skipped steps at the floor.
  max_consecutive_skips: int = 50

  def __post_init__(self):
    # Every argument in its range whichever kind reads it: the dynamic ones a
    # static scaler leaves unused are checked too, before a change of kind
    # meets them.
    errors.check_choice('$kind', self.kind, KINDS, LossScaleError)
    if not np.isfinite(self.initial) or self.initial <= 0:
      raise LossScaleError('$initial: must be a positive finite number, got '
                           + errors.quoted(self.initial))
    if int(self.period) != self.period or self.period < 1:
      raise LossScaleError('$period: must be a positive integer, got '
                           + errors.quoted(self.period))
    if self.factor <= 1:
      raise LossScaleError('$factor: must be > 1, got '
                           + errors.quoted(self.factor))
    # The floor bounds a dynamic scale only; a static one may sit below it.
    if self.minimum <= 0 or (self.kind == 'dynamic' and
                             self.minimum > self.initial):
      raise LossScaleError('$minimum: must be in (0, $initial], got '
                           + errors.quoted(self.minimum))
    if int(self.hysteresis) != self.hysteresis or self.hysteresis < 1:
      raise LossScaleError('$hysteresis: must be a positive integer, got '
                           + errors.quoted(self.hysteresis))
    if self.max_consecutive_skips < 1:
      raise LossScaleError('$max_consecutive_skips: must be positive, got '
                           + errors.quoted(self.max_consecutive_skips))

  @classmethod
  def from_config(cls, settings) -> 'LossScaler':
    """From `settings` that hold this class's fields by name (an
    application's typed settings, or a ConfigDict in a program of your
    own); an error names the field as this class does (`initial`)."""
    return cls(kind=settings.kind, initial=float(settings.initial),
               period=int(settings.period), factor=float(settings.factor),
               minimum=float(settings.minimum),
               hysteresis=int(settings.hysteresis),
               max_consecutive_skips=int(settings.max_consecutive_skips))

  def init(self) -> LossScaleState:
    """The initial loss-scale state."""
    scale = 1.0 if self.kind == 'none' else self.initial
    # Distinct buffers: a donated state must not hold one array twice.
    return _STATE_TYPES[self.kind](
        jnp.asarray(scale, jnp.float32), jnp.zeros([], jnp.int32),
        jnp.zeros([], jnp.int32), jnp.asarray(self.hysteresis, jnp.int32))

  def check_state(self, state: LossScaleState, where: str) -> None:
    """Raises one line when `state` is another kind's (`init` of a scaler
    of another `kind`), naming `where` it was found."""
    made_by = next((k for k, t in _STATE_TYPES.items() if type(state) is t),
                   None)
    if made_by != self.kind:
      made = (f"LossScaler('{made_by}')" if made_by else
              f'a {type(state).__name__}, not a LossScaler')
      message = (f"{where} was made by {made}; this step's scaler is "
                 f"LossScaler('{self.kind}'): build the state with the scaler "
                 'the step takes')
      raise LossScaleError(errors.literal(message))

  def jmp_loss_scale(self, state: LossScaleState) -> jmp.LossScale:
    """jmp's loss scale for `state`, with the configured floor."""
    if self.kind == 'none':
      return jmp.NoOpLossScale()
    if self.kind == 'static':
      return jmp.StaticLossScale(state.scale)
    return jmp.DynamicLossScale(
        loss_scale=state.scale, counter=state.counter,
        period=int(self.period), factor=self.factor,
        min_loss_scale=jnp.asarray(self.minimum, jnp.float32))

  def scale(self, state: LossScaleState, tree: T) -> T:
    return self.jmp_loss_scale(state).scale(tree)

  def unscale(self, state: LossScaleState, tree: T) -> T:
    return self.jmp_loss_scale(state).unscale(tree)

  def adjust(self, state: LossScaleState,
             grads_finite: jax.Array) -> LossScaleState:
    """The next state: grows after `period` finite steps, backs off on overflow.

    Hysteresis k as Megatron-LM's DynamicGradScaler and DeepSpeed's
    DynamicLossScaler (`consecutive_hysteresis=False`) define it: every overflow
    uses up one of k, consecutive or not; the scale backs off on the overflow
    that uses up the last one and on every overflow after it, until the scale
    grows again (after `period` consecutive finite steps), which restores all
    k. Every overflow resets the growth counter. k=1 backs off on every overflow.
    """
    overflows = jnp.where(grads_finite, 0, state.overflows + 1)
    if self.kind != 'dynamic':
      return state._replace(overflows=overflows)
    new = self.jmp_loss_scale(state).adjust(grads_finite)
    grows = grads_finite & (state.counter == self.period - 1)
    left = jnp.where(grads_finite,
                     jnp.where(grows, self.hysteresis, state.hysteresis),
                     jnp.maximum(state.hysteresis - 1, 0))
    held = ~grads_finite & (left > 0)
    scale = jnp.where(held, state.scale, new.loss_scale)
    return type(state)(scale, new.counter, overflows, left.astype(jnp.int32))

  def check_metrics(self, step: int, metrics: dict, state: Any = None
                    ) -> None:
    """`check` after one train step, from its `metrics` (read on the host):
    the trainer's guard, for a loop of your own. With the step's `state`
    (a `TrainState`), a step skipped for its Haiku state names the module
    whose state was not finite and the override that computes it in
    float32.

    Example:
      state, metrics = train_step(state, batch)
      scaler.check_metrics(int(state.step), metrics, state)
    """
    applied = state_check.applied(metrics)
    state_skip = not applied and bool(metrics['grads_finite'])
    self.check(step, float(metrics['loss_scale']),
               int(metrics['consecutive_skips']), int(not applied),
               _nonfinite_state(metrics, state) if state_skip else '')

  def check(self, step: int, scale: float, consecutive_skips: int,
            skipped_in_window: int, why: str = '') -> None:
    """Raises when a run cannot go on (called on the host at log points).

    Dynamic scaling: after `max_consecutive_skips` consecutive overflows with
    the scale at its floor. No or static scaling: at any non-finite step, since
    nothing would change on the next one. `why`: what the last skip was
    for where it was not the gradients (its Haiku state, `check_metrics`
    says); '' for the gradients.
    """
    why = errors.literal(why)
    if self.kind == 'dynamic':
      if (consecutive_skips >= self.max_consecutive_skips and
          scale <= self.minimum):
        if why:
          raise LossScaleError(
              f'$max_consecutive_skips: {consecutive_skips} consecutive steps '
              f'up to step {step} were skipped with the loss scale at its '
              f'floor $minimum={self.minimum:g}; the last because {why}')
        raise LossScaleError(
            f'$max_consecutive_skips: {consecutive_skips} consecutive steps up '
            f'to step {step} had non-finite gradients with the loss scale at '
            f'its floor $minimum={self.minimum:g}; the model diverged or '
            'float16 overflows even unscaled')
    elif skipped_in_window:
      if why:
        raise LossScaleError(
            f'$kind={self.kind}: a step before step {step} was skipped '
            f'(params are intact) because {why}')
      raise LossScaleError(
          f'$kind={self.kind}: non-finite loss or gradients before step '
          f'{step} (the update was skipped, params are intact); the last '
          'checkpoint is kept. Lower the learning rate, or use float16 with '
          'dynamic loss scaling')

def _nonfinite_state(metrics: dict, state: Any) -> str:
  """Why a step with finite gradients was skipped: the Haiku state it would
  have written, its modules named where the step's `state` is given."""
  if state is None or not getattr(state, 'model_state', None):
    return ('the new Haiku state was not finite (pass the TrainState to '
            'check_metrics to name its module)')
  modules = state_check.modules_of(state.model_state,
                                   np.asarray(metrics['nonfinite_state']))
  if not modules:
    return 'the new Haiku state was not finite'
  first = modules[0]
  more = f' (and {len(modules) - 1} more)' if len(modules) > 1 else ''
  return (f'the new Haiku state of {first!r}{more} was not finite: a module '
          'that computes its state in float16 (an epsilon that underflows to '
          '0)? compute it in float32 with the override '
          f"'{first}:p=f32,c=f32,o=f16' (haiku_mp.advisor's float16 pass "
          'finds such modules)')
