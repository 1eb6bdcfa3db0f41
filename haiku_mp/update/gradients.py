"""The gradients a train step takes: of the loss scaled by a `LossScaler`,
in float32, reduced over a data-parallel axis, then unscaled; and the
form in which a caller brings gradients of its own (`GradientsFn`)."""

import functools
from typing import Callable, Union

import haiku as hk
import jax
import jax.numpy as jnp

from haiku_mp.model import meta_params
from haiku_mp.update import data_parallel
from haiku_mp.update import loss_scaling
from haiku_mp.update import losses
from haiku_mp.update import train_state

# A step's data-parallel axis: None (one device, or jit over a mesh), the
# name of a `pmap` / `shard_map` axis (float32 reductions), or a
# `DataParallel` that also sets the precision of its collectives.
AxisName = Union[None, str, data_parallel.DataParallel]


def _cross_replica_mean(tree, axis_name):
  """Means over `axis_name`; `num_examples` is summed."""
  if axis_name is None:
    return tree
  return {k: (jax.lax.psum(v, axis_name) if k == 'num_examples' else
              jax.lax.pmean(v, axis_name)) for k, v in tree.items()}


def state_gradients(loss_fn: losses.LossWithState,
                    loss_scaler: loss_scaling.LossScaler,
                    loss_scale: loss_scaling.LossScaleState,
                    params: hk.Params, model_state: hk.State,
                    rng: jax.Array, batch: losses.Batch,
                    axis_name: AxisName = None
                    ) -> tuple[hk.Params, jax.Array, losses.Metrics, hk.State]:
  """`gradients`, and the model's state after the forward pass (averaged
  over `axis_name` replicas, so that every replica keeps the same)."""
  parallel = data_parallel.of(axis_name)
  if parallel is not None:
    rng = jax.random.fold_in(rng, jax.lax.axis_index(parallel.axis_name))
  histories, trained = train_state.split_fp8(params)
  if parallel is not None:
    # Differentiated in float32: the reduction's result is not rounded back
    # to a half parameter's dtype (data_parallel.DataParallel.whole).
    stored = trained
    trained = jax.tree.map(
        lambda p: p.astype(jnp.promote_types(p.dtype, jnp.float32)), trained)

  def scaled_loss(histories, trained):
    if parallel is not None:
      trained = parallel.whole(trained, stored)
    loss, aux, new_state = loss_fn(meta_params.merge_meta(trained, histories),
                                   model_state, rng, batch)
    return loss_scaler.scale(loss_scale, loss), (loss, aux, new_state)

  (histories, grads), (loss, aux, new_state) = jax.grad(
      scaled_loss, argnums=(0, 1), has_aux=True)(histories, trained)
  # The amax histories' "gradients" are the histories rolled on (fp8.py):
  # not scaled, reduced by their maximum, so replicas keep the same scales.
  grads = jax.tree.map(
      lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), grads)
  if parallel is not None:
    # The gradients were reduced on their way back (DataParallel.whole).
    histories = jax.lax.pmax(histories, parallel.axis_name)
    new_state = jax.tree.map(
        lambda x: (jax.lax.pmean(x, parallel.axis_name)
                   if jnp.issubdtype(x.dtype, jnp.floating) else x),
        new_state)
  metrics = _cross_replica_mean(
      dict(aux, loss=loss), parallel and parallel.axis_name)
  grads = loss_scaler.unscale(loss_scale, grads)
  return (meta_params.merge_meta(grads, histories), metrics.pop('loss'),
          metrics, new_state)


def gradients(loss_fn: losses.LossFn, loss_scaler: loss_scaling.LossScaler,
              loss_scale: loss_scaling.LossScaleState, params: hk.Params,
              rng: jax.Array, batch: losses.Batch, axis_name: AxisName = None
              ) -> tuple[hk.Params, jax.Array, losses.Metrics]:
  """(gradients, loss, metrics) as the train step takes them: of the scaled
  loss, cast to at least float32 (half gradients of float32 params), averaged
  over `axis_name` replicas, then unscaled. Not yet checked for finiteness.
  Each replica draws its own dropout masks from `rng`; the loss and metrics
  cover every replica. A `DataParallel` as `axis_name` sets the dtype the
  gradients are reduced in, and gathers parameters split over the axis."""
  grads, loss, metrics, _ = state_gradients(
      losses.with_state(loss_fn), loss_scaler, loss_scale, params, {}, rng,
      batch, axis_name)
  return grads, loss, metrics


# gradients_fn(loss_scale, params, rng, batch, axis_name) -> (float32
# gradients, loss, metrics over every replica): `scaled_gradients`, or
# DP-SGD's (`dp_sgd.make_gradients`).
GradientsFn = Callable[..., tuple[hk.Params, jax.Array, losses.Metrics]]


def scaled_gradients(loss_fn: losses.LossFn,
                     loss_scaler: loss_scaling.LossScaler) -> GradientsFn:
  """`gradients` of `loss_fn` under `loss_scaler`: the train step's, unless
  the run is private. For a caller that wraps or replaces them.

  Example:
    gradients_fn = haiku_mp.scaled_gradients(loss_fn, scaler)
    step = haiku_mp.make_train_step(None, optimizer, scaler, gradients_fn=gradients_fn)
  """
  if isinstance(loss_fn, losses.LossWithState):
    raise TypeError('scaled_gradients: loss_fn has Haiku state '
                    '(LossWithState); pass it to make_train_step itself')
  return functools.partial(gradients, loss_fn, loss_scaler)
