"""The pure, loss-scaled `train_step` of a `TrainState`.

One step: forward in the compute dtype -> float32 loss -> x loss scale ->
gradients -> cast to float32 and unscaled -> finite check -> optax update on the
float32 master params (the params themselves, or a copy the optimizer keeps when
the policy stores params in half precision) (clipping, if configured, is the optimizer's first
transform, so it sees unscaled gradients) -> if any gradient or the new Haiku
state is not finite, params, optimizer state and Haiku state stay exactly as
they were -> loss scale adjusted.
"""

import logging
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from haiku_mp.model import meta_params
from haiku_mp.model import module_runs
from haiku_mp.model import recording
from haiku_mp.update import data_parallel
from haiku_mp.update import gradients as gradients_lib
from haiku_mp.update import loss_scaling
from haiku_mp.update import losses
from haiku_mp.update import param_updates
from haiku_mp.update import state_check
from haiku_mp.update import train_state

# train_inputs(key, batch, axis_name, step) -> the batch the model takes
# (augmented and normalized on the device; `step`, the state's, for settings
# that change over the run).
TrainInputs = Callable[[jax.Array, losses.Batch, Optional[str], jax.Array],
                       losses.Batch]


# The step's rounding key is `fold_in(state.rng, ROUNDING_DRAW)`: apart from
# the `split(state.rng, 3)` the step's other keys come from (fold_in with 0, 1
# or 2 would repeat one of them), so the streams of runs from before it exist
# are unchanged.
ROUNDING_DRAW = 3


def _as_is_train(key, batch, axis_name, step):
  del key, axis_name, step
  return batch


# Below this share of the forward's matmul FLOPs, a low-bit precision that
# reaches so few is noted at the step's first trace.
LOW_BIT_REACH_NOTED = 0.5
_LOG = logging.getLogger('haiku_mp')


def _note_precision(record: recording.Record,
                    loss: Optional[losses.LossWithState],
                    args: tuple) -> None:
  """One warning line each, at a step's first trace: when no haiku_mp
  precision was applied while its loss was traced (the model runs in its
  params' dtype; `apply_precision` forgotten), and when a low-bit
  precision's matmuls reach under `LOW_BIT_REACH_NOTED` of the forward's
  matmul FLOPs, naming what runs the rest (`haiku_mp.describe`)."""
  if not record.precisions:
    _LOG.warning(
        'train_step: no haiku_mp precision was applied while the loss was '
        'traced, so the model computes in its params\' dtype; enter '
        'haiku_mp.apply_precision(precision) around the model inside the '
        'transformed function')
    return
  if loss is None or not any(p.low_bit is not None for p in record.precisions):
    return
  params, model_state, rng, batch = args
  with recording.recording() as forward:
    jaxpr = jax.make_jaxpr(lambda p, s, r, b: loss(p, s, r, b)[0])(
        params, model_state, rng, batch)
  found = module_runs.matmuls_of(jaxpr.jaxpr)
  reached, rest = module_runs.low_bit_reach(found, forward)
  if not found or reached >= LOW_BIT_REACH_NOTED:
    return
  most = ', '.join(f'{scope or "(outside any module)"} {share:.0%}'
                   for scope, share in rest[:3])
  _LOG.warning(
      'train_step: low-bit matmuls reach %.0f%% of the forward pass\'s matmul '
      'FLOPs; most of the rest: %s (haiku_mp.describe(forward, *inputs) says '
      'what each module runs)', 100 * reached, most)


def _kept_if_skipped(finite: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the step's gradients are `finite`, else `old`, each leaf in
  `old`'s dtype: an optax transformation may return state in the dtype of
  the float32 gradients for half params (optax.adam's moments of bfloat16
  params), which the next step must not see change (jmp's `select_tree`
  refuses the mix)."""
  return jax.tree.map(
      lambda n, o: jnp.where(finite, jnp.asarray(n).astype(o.dtype), o),
      new, old)


def make_train_step(loss_fn: Optional[losses.AnyLoss],
                    optimizer: optax.GradientTransformation,
                    loss_scaler: loss_scaling.LossScaler = (
                        loss_scaling.LossScaler()),
                    axis_name: gradients_lib.AxisName = None,
                    inputs: TrainInputs = _as_is_train, *,
                    gradients_fn: Optional[gradients_lib.GradientsFn] = None
                    ) -> Callable[[train_state.TrainState, losses.Batch],
                                  tuple[train_state.TrainState,
                                        losses.Metrics]]:
  """A pure `train_step(state, batch) -> (state, metrics)` of `loss_fn`.

  Example:
    step = jax.jit(haiku_mp.make_train_step(loss_fn, optax.adam(1e-3),
                                            haiku_mp.LossScaler('dynamic')))

  `loss_fn(params, rng, batch) -> (loss, metrics)`, or a `LossWithState`
  for a model with Haiku state; its gradients are those
  of the loss scaled by `loss_scaler` (default: none), unscaled in float32.
  A caller that brings its own gradients (DP-SGD) passes `gradients_fn`
  (`scaled_gradients`'s signature) instead, and None for `loss_fn`.
  `optimizer` is `optimizer.make_optimizer`'s (or any optax
  transformation; with half params, wrapped in `float32_master` or
  `without_master`): its update takes the step's rounding key as `key=`.

  Jit it with `donate_argnums=0`; every metric is a device scalar, so nothing
  syncs with the host until the caller reads one. Under `jax.pmap`, pass its
  `axis_name`: gradients are then averaged over replicas before the finite
  check, so every replica takes the same skip decision and keeps the same
  loss scale, and each replica draws its own dropout masks; a
  `DataParallel` (`haiku_mp.DataParallel`) in its place also sets the dtype
  of the reduction. `inputs` turns the host batch into the model's
  (augmentation on the device), keyed by the step's own key, the same on
  every replica. `gradients_fn` takes the step's key as it is on every
  replica.

  A step is skipped (params, optimizer state and Haiku state kept, the
  loss scale lowered, `skipped_steps` counted) where its gradients or the
  new Haiku state are not finite; its metrics say which (`grads_finite`,
  `state_finite`, `applied`). At its first trace the step checks the state
  it is given (a TrainState of this optimizer and loss scaler, half params
  only with an optimizer that keeps a master or says how it rounds, the
  Haiku state the model returns): a mismatch is one line, not an error deep
  in optax. Call `loss_scaler.check_metrics(step, metrics, state)` after
  each step, as the trainer does, to stop a run that only skips.
  """
  if (loss_fn is None) == (gradients_fn is None):
    raise ValueError('make_train_step: give a loss_fn, or gradients_fn '
                     '(with loss_fn None), not both')
  if loss_fn is not None and not callable(loss_fn):
    raise TypeError(f'make_train_step: loss_fn is a {type(loss_fn).__name__}, '
                    'not a function of (params, rng, batch)')
  stateful = isinstance(loss_fn, losses.LossWithState)
  stateful_loss = None if loss_fn is None else losses.with_state(loss_fn)
  if gradients_fn is None:

    def gradients_fn(loss_scale, params, rng, batch, axis_name, model_state):
      return gradients_lib.state_gradients(
          stateful_loss, loss_scaler, loss_scale, params, model_state, rng,
          batch, axis_name)
  else:
    brought = gradients_fn

    def gradients_fn(loss_scale, params, rng, batch, axis_name, model_state):
      return (*brought(loss_scale, params, rng, batch, axis_name),
              model_state)

  optimizer = optax.with_extra_args_support(optimizer)
  axis = data_parallel.of(axis_name)
  noted = []  # Whether a trace has noted the precision (`_note_precision`).

  def train_step(state: train_state.TrainState, batch: losses.Batch
                 ) -> tuple[train_state.TrainState, losses.Metrics]:
    train_state.check_state(state, optimizer, loss_scaler, stateful)
    rng, step_rng, inputs_rng = jax.random.split(state.rng, 3)
    batch = inputs(inputs_rng, batch, axis and axis.axis_name, state.step)
    with recording.recording() as record:
      grads, loss, aux, model_state = gradients_fn(
          state.loss_scale, state.params, step_rng, batch, axis_name,
          state.model_state)
    train_state.check_model_state(model_state, state.model_state)
    if not noted:  # The first trace says what it saw, once.
      noted.append(True)
      _note_precision(record, stateful_loss,
                      (state.params, state.model_state, step_rng, batch))
    # fp8 amax histories are written over on every step, skipped or not: a
    # skipped step's amaxes are real observations (non-finite ones are not
    # recorded, fp8_scales.roll_history), and the next step's scales need them.
    histories, grads = train_state.split_fp8(grads)
    _, trained = train_state.split_fp8(state.params)
    # One flag per gradient leaf: the skip decision, and where float16
    # overflowed for the log of a skipped step. Read from each leaf's sum of
    # squares, which the gradient norm needs anyway: a separate `isfinite`
    # reduction per leaf, selecting the whole state, made XLA:CPU compile
    # the step 2-3x as long as the model's plain step (BENCHMARKS.md). A sum
    # is not finite if a value is not, or if the leaf's norm passes
    # float32's range (1.8e19), a gradient no step survives either
    # (DeepSpeed reads overflow from a sum too).
    squares = [jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)]
    nonfinite = ~jnp.isfinite(jnp.stack(squares))
    grads_finite = ~nonfinite.any()
    # The new Haiku state, checked like the gradients: a step whose
    # gradients are finite can still write inf or NaN into it (a float16
    # epsilon that underflows to 0 in an EMA's denominator), and every step
    # after it would train on that. Its sum per leaf: inf or NaN wherever a
    # value is, and no false alarm from large finite state.
    nonfinite_state = state_check.flags(model_state)
    state_finite = ~nonfinite_state.any()
    applied = grads_finite & state_finite
    # The rounding of bfloat16 state (param_updates.py, optimizer.py): the
    # same on every replica and shard, from the state's key, so a resume
    # redraws it.
    round_key = jax.random.fold_in(state.rng, ROUNDING_DRAW)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, trained,
                                              key=round_key)
    new_params = param_updates.apply_updates(trained, updates, new_opt_state,
                                             round_key)
    updates_lost = _updates_lost(trained, new_params, updates)
    params, opt_state, model_state = _kept_if_skipped(
        applied, (new_params, new_opt_state, model_state),
        (trained, state.opt_state, state.model_state))
    params = meta_params.merge_meta(params, histories)
    skipped_steps = state.skipped_steps + (~applied).astype(jnp.int32)
    new_state = train_state.TrainState(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        loss_scale=loss_scaler.adjust(state.loss_scale, applied),
        rng=rng,
        skipped_steps=skipped_steps,
        model_state=model_state)
    metrics = dict(
        aux, loss=loss,
        nonfinite_grads=nonfinite,  # In the order of jax.tree.leaves.
        # In the order of `state_check.leaves(state.model_state)`.
        nonfinite_state=nonfinite_state,
        consecutive_skips=new_state.loss_scale.overflows,
        loss_scale=state.loss_scale.scale,
        grads_finite=grads_finite,
        state_finite=state_finite,
        # The step's update was applied: its gradients and new state finite.
        applied=applied,
        grad_norm=jnp.sqrt(sum(squares)),
        # NaN at a skipped step (a log window averages the others).
        updates_lost=jnp.where(applied, updates_lost, jnp.nan),
        skipped_steps=skipped_steps)
    return new_state, metrics

  return train_step


def _updates_lost(params: hk.Params, new_params: hk.Params,
                  updates: optax.Updates) -> jax.Array:
  """The share of the step's update, by magnitude, that did not reach the
  params: 1 - sum(applied * sign(update)) / sum(|update|) over every
  element. ~0 where params are float32, or rounded from a float32 master or
  stochastically (unbiased: a step moves fewer params, each by an ulp);
  toward 1 where bfloat16 params rounded to nearest drop updates below half
  an ulp."""
  applied = sum((jnp.sum((n.astype(jnp.float32) - p.astype(jnp.float32))
                         * jnp.sign(u)) for p, n, u in zip(
                             jax.tree.leaves(params),
                             jax.tree.leaves(new_params),
                             jax.tree.leaves(updates))), jnp.zeros([]))
  total = sum((jnp.sum(jnp.abs(u)) for u in jax.tree.leaves(updates)),
              jnp.zeros([]))
  return jnp.where(total > 0, 1 - applied / total, 0.0)
