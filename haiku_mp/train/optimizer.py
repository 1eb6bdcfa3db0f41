"""The optax optimizer from config: AdamW with warmup + cosine decay and clipping.

It always runs on float32 master params and float32 (unscaled) gradients:
when the precision policy stores params in half precision, `float32_master`
keeps the float32 copy the optimizer updates, and the half params are that copy
rounded after every step (so updates smaller than a half-precision ulp are not
lost).
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(learning_rate: float, warmup_steps: int,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then cosine decay to 0 at `total_steps`."""
  warmup = max(int(warmup_steps), 0)
  if not warmup:
    return optax.cosine_decay_schedule(learning_rate, max(total_steps, 1))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1))


# The only params weight decay shrinks: Linear and Conv weights. Biases,
# LayerNorm's scale and offset, the cls token and the position embedding
# keep their values (as in ViT and DeiT recipes).
_DECAYED = 'w'


def decay_mask(params):
  """True where weight decay applies (`_DECAYED` leaves), by param name."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], 'key', None) == _DECAYED, params)


class MasterState(NamedTuple):
  master: optax.Params  # float32 copy of every param.
  inner: optax.OptState  # state of the wrapped optimizer, over `master`.


def float32_master(inner: optax.GradientTransformation
                   ) -> optax.GradientTransformation:
  """Runs `inner` on a float32 copy of the params, whatever their dtype.

  Apply its updates with `apply_updates` below: the new params are then exactly
  the updated float32 copy rounded to each param's dtype. (`optax.apply_updates`
  gets within rounding of that, as `params + (master - params)`.)
  """

  def init(params):
    # A copy even of float32 leaves: a donated state must not hold one buffer
    # twice.
    master = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True),
                          params)
    return MasterState(master, inner.init(master))

  def update(grads, state, params):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, inner_state = inner.update(grads, state.inner, state.master)
    master = optax.apply_updates(state.master, updates)
    updates = jax.tree.map(lambda m, p: m - p.astype(jnp.float32), master,
                           params)
    return updates, MasterState(master, inner_state)

  return optax.GradientTransformation(init, update)


class EmaState(NamedTuple):
  ema_params: optax.Params  # float32: the moving average of the params.


def track_ema(decay: float) -> optax.GradientTransformation:
  """Passes updates through and keeps an exponential moving average of the
  params they make (from the initial params, no bias correction), in
  float32, for evaluation beside the params. It is optimizer state, so it is
  checkpointed, sharded like the params, and left as it was by a skipped
  step. (optax.ema averages updates, not params.)"""

  def init(params):
    return EmaState(jax.tree.map(
        lambda p: jnp.array(p, jnp.float32, copy=True), params))

  def update(updates, state, params):
    new_params = optax.apply_updates(params, updates)
    ema = jax.tree.map(
        lambda e, p: decay * e + (1.0 - decay) * p.astype(jnp.float32),
        state.ema_params, new_params)
    return updates, EmaState(ema)

  return optax.GradientTransformation(init, update)


def ema_params(opt_state: optax.OptState) -> Optional[optax.Params]:
  """The moving average `track_ema` keeps in `opt_state`, or None."""
  return optax.tree_utils.tree_get(opt_state, 'ema_params')


def apply_updates(params: optax.Params, updates: optax.Updates,
                  new_opt_state: optax.OptState) -> optax.Params:
  """`optax.apply_updates`, or the rounded master copy under `float32_master`."""
  if isinstance(new_opt_state, MasterState):
    return jax.tree.map(lambda m, p: m.astype(p.dtype), new_opt_state.master,
                        params)
  return optax.apply_updates(params, updates)


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float = 0.0,
                   grad_clip_norm: float = 0.0, ema_decay: float = 0.0,
                   half_params: bool = False) -> optax.GradientTransformation:
  """Clipping by global norm (if `grad_clip_norm` > 0), then AdamW on
  `schedule`, then the params' moving average (if `ema_decay` > 0).

  With `half_params` (some params stored in float16 / bfloat16), they run on
  a float32 master copy (`float32_master`).
  """
  optimizer = optax.adamw(schedule, weight_decay=weight_decay,
                          mask=decay_mask)
  if grad_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(grad_clip_norm),
                            optimizer)
  if ema_decay > 0:
    optimizer = optax.chain(optimizer, track_ema(ema_decay))
  return float32_master(optimizer) if half_params else optimizer
