"""`TrainState` and the pure, loss-scaled `train_step` / `eval_step`.

One step: forward in the compute dtype -> float32 loss -> x loss scale ->
gradients -> cast to float32 and unscaled -> finite check -> optax update on the
float32 master params (the params themselves, or a copy the optimizer keeps when
the policy stores params in half precision) (clipping, if configured, is the optimizer's first
transform, so it sees unscaled gradients) -> if any gradient is not finite,
params and optimizer state stay exactly as they were -> loss scale adjusted.
"""

import functools
from typing import Any, Callable, Mapping, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import optax

from haiku_mp.model import meta_params
from haiku_mp.update import loss_scaling
from haiku_mp.update import optimizer as optimizer_lib

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
# loss_fn(params, rng, batch) -> (float32 scalar loss, metrics such as accuracy).
LossFn = Callable[[hk.Params, jax.Array, Batch], tuple[jax.Array, Metrics]]
# train_inputs(key, batch, axis_name, step) -> the batch the model takes
# (augmented and normalized on the device; `step`, the state's, for settings
# that change over the run); eval_inputs(batch) -> the same, no randomness.
TrainInputs = Callable[[jax.Array, Batch, Optional[str], jax.Array], Batch]
EvalInputs = Callable[[Batch], Batch]


# The step's rounding key is `fold_in(state.rng, ROUNDING_DRAW)`: apart from
# the `split(state.rng, 3)` the step's other keys come from (fold_in with 0, 1
# or 2 would repeat one of them), so the streams of runs from before it exist
# are unchanged.
ROUNDING_DRAW = 3


def _as_is_train(key, batch, axis_name, step):
  del key, axis_name, step
  return batch


class TrainState(NamedTuple):
  """Everything a step reads and writes; checkpointing this resumes a run.

  Example:
    state, metrics = train_step(state, batch)
    print(int(state.step), int(state.skipped_steps), state.loss_scale.scale)
  """
  step: jax.Array  # int32 scalar: steps taken, skipped ones included.
  # In the policy's param dtype: float32 master weights, or half-precision
  # params whose float32 master copy lives in `opt_state` (float32_master);
  # and fp8 delayed scaling's amax histories, which no optimizer sees.
  params: hk.Params
  opt_state: optax.OptState  # optimizer state of the (non-fp8) params.
  loss_scale: loss_scaling.LossScaleState  # scale and finite-step counter.
  rng: jax.Array  # PRNG key, split every step for dropout.
  skipped_steps: jax.Array  # int32 scalar: steps skipped for non-finite grads.


def init_train_state(params: hk.Params,
                     optimizer: optax.GradientTransformation,
                     loss_scaler: loss_scaling.LossScaler,
                     rng: jax.Array) -> TrainState:
  """The state before the first step: `params` as `forward.init` made them,
  `optimizer`'s state of them (fp8 histories left out), the initial loss
  scale, and the key the steps split.

  Example:
    params = forward.init(jax.random.key(0), images, True)
    state = haiku_mp.init_train_state(params, optimizer, scaler, jax.random.key(1))
  """
  return TrainState(
      step=jnp.zeros([], jnp.int32),
      params=params,
      opt_state=optimizer.init(split_fp8(params)[1]),
      loss_scale=loss_scaler.init(),
      rng=rng,
      skipped_steps=jnp.zeros([], jnp.int32))


def split_fp8(tree: hk.Params) -> tuple[hk.Params, hk.Params]:
  """(fp8 amax histories, everything else) of params or their gradients."""
  return meta_params.split_meta(tree)


def _cross_replica_mean(tree, axis_name):
  """Means over `axis_name`; `num_examples` is summed."""
  if axis_name is None:
    return tree
  return {k: (jax.lax.psum(v, axis_name) if k == 'num_examples' else
              jax.lax.pmean(v, axis_name)) for k, v in tree.items()}


def gradients(loss_fn: LossFn, loss_scaler: loss_scaling.LossScaler,
              loss_scale: loss_scaling.LossScaleState, params: hk.Params,
              rng: jax.Array, batch: Batch, axis_name: Optional[str] = None
              ) -> tuple[hk.Params, jax.Array, Metrics]:
  """(gradients, loss, metrics) as the train step takes them: of the scaled
  loss, cast to at least float32 (half gradients of float32 params), averaged
  over `axis_name` replicas, then unscaled. Not yet checked for finiteness.
  Each replica draws its own dropout masks from `rng`; the loss and metrics
  cover every replica."""

  if axis_name is not None:
    rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))

  def scaled_loss(params):
    loss, aux = loss_fn(params, rng, batch)
    return loss_scaler.scale(loss_scale, loss), (loss, aux)

  grads, (loss, aux) = jax.grad(scaled_loss, has_aux=True)(params)
  # The amax histories' "gradients" are the histories rolled on (fp8.py):
  # not scaled, reduced by their maximum, so replicas keep the same scales.
  histories, grads = split_fp8(grads)
  grads = jax.tree.map(
      lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), grads)
  if axis_name is not None:
    grads = jax.lax.pmean(grads, axis_name)
    histories = jax.lax.pmax(histories, axis_name)
  metrics = _cross_replica_mean(dict(aux, loss=loss), axis_name)
  grads = loss_scaler.unscale(loss_scale, grads)
  return (meta_params.merge_meta(grads, histories), metrics.pop('loss'),
          metrics)


# gradients_fn(loss_scale, params, rng, batch, axis_name) -> (float32
# gradients, loss, metrics over every replica): `ordinary_gradients`, or
# DP-SGD's (`dp_sgd.make_gradients`).
GradientsFn = Callable[..., tuple[hk.Params, jax.Array, Metrics]]


def ordinary_gradients(loss_fn: LossFn,
                       loss_scaler: loss_scaling.LossScaler) -> GradientsFn:
  """`gradients` of `loss_fn` under `loss_scaler`: the train step's, unless
  the run is private. For a caller that wraps or replaces them.

  Example:
    gradients_fn = haiku_mp.ordinary_gradients(loss_fn, scaler)
    step = haiku_mp.make_train_step(None, optimizer, scaler, gradients_fn=gradients_fn)
  """
  return functools.partial(gradients, loss_fn, loss_scaler)


def make_train_step(loss_fn: Optional[LossFn],
                    optimizer: optax.GradientTransformation,
                    loss_scaler: loss_scaling.LossScaler = (
                        loss_scaling.LossScaler()),
                    axis_name: Optional[str] = None,
                    inputs: TrainInputs = _as_is_train, *,
                    gradients_fn: Optional[GradientsFn] = None
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
  """A pure `train_step(state, batch) -> (state, metrics)` of `loss_fn`.

  Example:
    step = jax.jit(haiku_mp.make_train_step(loss_fn, optax.adam(1e-3),
                                            haiku_mp.LossScaler('dynamic')))

  `loss_fn(params, rng, batch) -> (loss, metrics)`; its gradients are those
  of the loss scaled by `loss_scaler` (default: none), unscaled in float32.
  A caller that brings its own gradients (DP-SGD) passes `gradients_fn`
  (`ordinary_gradients`'s signature) instead, and None for `loss_fn`.
  `optimizer` is `optimizer.make_optimizer`'s (or any optax
  transformation): its update takes the step's rounding key as `key=`.

  Jit it with `donate_argnums=0`; every metric is a device scalar, so nothing
  syncs with the host until the caller reads one. Under `jax.pmap`, pass its
  `axis_name`: gradients are then averaged over replicas before the finite
  check, so every replica takes the same skip decision and keeps the same
  loss scale, and each replica draws its own dropout masks. `inputs` turns
  the host batch into the model's (augmentation on the device), keyed by the
  step's own key, the same on every replica. `gradients_fn` takes the
  step's key as it is on every replica.
  """
  if (loss_fn is None) == (gradients_fn is None):
    raise ValueError('make_train_step: give a loss_fn, or gradients_fn '
                     '(with loss_fn None), not both')
  if gradients_fn is None:
    gradients_fn = ordinary_gradients(loss_fn, loss_scaler)

  optimizer = optax.with_extra_args_support(optimizer)

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    rng, step_rng, inputs_rng = jax.random.split(state.rng, 3)
    batch = inputs(inputs_rng, batch, axis_name, state.step)
    grads, loss, aux = gradients_fn(state.loss_scale, state.params, step_rng,
                                    batch, axis_name)
    # fp8 amax histories are written over on every step, skipped or not: a
    # skipped step's amaxes are real observations (non-finite ones are not
    # recorded, fp8_scales.roll_history), and the next step's scales need them.
    histories, grads = split_fp8(grads)
    _, trained = split_fp8(state.params)
    # One flag per gradient leaf: the skip decision, and where float16
    # overflowed for the log of a skipped step.
    nonfinite = jnp.stack([~jnp.isfinite(g).all()
                           for g in jax.tree.leaves(grads)])
    grads_finite = ~nonfinite.any()
    # The rounding of bfloat16 state (optimizer.py): the same on every
    # replica and shard, from the state's key, so a resume redraws it.
    round_key = jax.random.fold_in(state.rng, ROUNDING_DRAW)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, trained,
                                              key=round_key)
    new_params = optimizer_lib.apply_updates(trained, updates, new_opt_state,
                                             round_key)
    updates_lost = _updates_lost(trained, new_params, updates)
    params, opt_state = jmp.select_tree(
        grads_finite, (new_params, new_opt_state),
        (trained, state.opt_state))
    params = meta_params.merge_meta(params, histories)
    skipped_steps = state.skipped_steps + (~grads_finite).astype(jnp.int32)
    new_state = TrainState(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        loss_scale=loss_scaler.adjust(state.loss_scale, grads_finite),
        rng=rng,
        skipped_steps=skipped_steps)
    metrics = dict(
        aux, loss=loss,
        nonfinite_grads=nonfinite,  # In the order of jax.tree.leaves.
        consecutive_skips=new_state.loss_scale.overflows,
        loss_scale=state.loss_scale.scale,
        grads_finite=grads_finite,
        grad_norm=optax.tree.norm(grads),
        # NaN at a skipped step (a log window averages the others).
        updates_lost=jnp.where(grads_finite, updates_lost, jnp.nan),
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


def _losses(logits: jax.Array, batch: Batch,
            label_smoothing: float) -> jax.Array:
  """Per-example float32 cross-entropy against the integer labels, or, with
  soft labels (`batch['targets']`, from mixing) or label smoothing, against
  those targets smoothed."""
  labels = batch['label']
  if 'targets' not in batch and not label_smoothing:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  targets = batch.get('targets')
  if targets is None:
    targets = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
  targets = optax.smooth_labels(targets.astype(jnp.float32), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets)


def _weighted_metrics(logits: jax.Array, batch: Batch,
                      axis_name: Optional[str] = None,
                      label_smoothing: float = 0.0) -> dict[str, Any]:
  """float32 cross-entropy and accuracy, masked by `batch['mask']` if present.

  With `axis_name`, the means are over the examples of every replica.
  Accuracy is against each example's own label, mixed or not.
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  labels = batch['label']
  mask = batch.get('mask')
  if mask is None:
    mask = jnp.ones(labels.shape, jnp.float32)
  mask = mask.astype(jnp.float32)
  losses = _losses(logits, batch, label_smoothing)
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  sums = dict(loss=(losses * mask).sum(), correct=(correct * mask).sum(),
              num_examples=mask.sum())
  if axis_name is not None:
    sums = jax.lax.psum(sums, axis_name)
  count = jnp.maximum(sums['num_examples'], 1.0)
  return dict(loss=sums['loss'] / count, accuracy=sums['correct'] / count,
              num_examples=sums['num_examples'])


def make_classification_loss(forward: hk.Transformed,
                             label_smoothing: float = 0.0) -> LossFn:
  """The training loss of a classifier `forward(images, is_training)`:
  cross-entropy in float32, its targets smoothed by `label_smoothing`.

  Example:
    loss_fn = haiku_mp.make_classification_loss(hk.transform(forward), 0.1)
    loss, metrics = loss_fn(params, rng, dict(image=images, label=labels))
  """

  def loss_fn(params, rng, batch):
    logits = forward.apply(params, rng, batch['image'], True)
    metrics = _weighted_metrics(logits, batch,
                                label_smoothing=label_smoothing)
    return metrics.pop('loss'), metrics

  return loss_fn


def make_eval_step(forward: hk.Transformed, axis_name: Optional[str] = None,
                   inputs: EvalInputs = lambda batch: batch
                   ) -> Callable[[hk.Params, Batch], Metrics]:
  """`eval_step(params, batch) -> {logits, loss, accuracy, num_examples}`, no dropout.

  Under `jax.pmap` pass its `axis_name`: the metrics then cover every replica.

  Example:
    eval_step = jax.jit(haiku_mp.make_eval_step(hk.transform(forward)))
    accuracy = eval_step(state.params, batch)['accuracy']
  """

  def eval_step(params: hk.Params, batch: Batch) -> Metrics:
    batch = inputs(batch)
    logits = forward.apply(params, None, batch['image'], False)
    return dict(_weighted_metrics(logits, batch, axis_name), logits=logits)

  return eval_step
