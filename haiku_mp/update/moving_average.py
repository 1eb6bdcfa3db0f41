"""The params' exponential moving average, kept as optimizer state, and
the decay that suits a run's length."""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax


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


def ema_decay_for(decay: float, horizon: float, total_steps: int) -> float:
  """`decay`, or with `horizon` > 0 the decay whose time constant
  (1 / (1 - decay) steps) is that share of `total_steps`: a fixed decay
  outlasts a short run (0.9998 averages over 5,000 steps, longer than a
  20-epoch run at batch 512) and lags the end of any run whose schedule
  it spans. At least 2 steps, so a tiny run still keeps an average."""
  if horizon <= 0:
    return decay
  return 1.0 - 1.0 / max(horizon * total_steps, 2.0)
