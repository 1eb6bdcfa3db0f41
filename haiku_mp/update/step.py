"""`TrainState` and the pure, loss-scaled `train_step` / `eval_step`.

One step: forward in the compute dtype -> float32 loss -> x loss scale ->
gradients -> cast to float32 and unscaled -> finite check -> optax update on the
float32 master params (the params themselves, or a copy the optimizer keeps when
the policy stores params in half precision) (clipping, if configured, is the optimizer's first
transform, so it sees unscaled gradients) -> if any gradient or the new Haiku
state is not finite, params, optimizer state and Haiku state stay exactly as
they were -> loss scale adjusted.
"""

import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from haiku_mp.model import meta_params
from haiku_mp.model import module_runs
from haiku_mp.model import recording
from haiku_mp.update import data_parallel
from haiku_mp.update import loss_scaling
from haiku_mp.update import optimizer as optimizer_lib
from haiku_mp.update import state_check

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
# loss_fn(params, rng, batch) -> (float32 scalar loss, metrics such as accuracy).
LossFn = Callable[[hk.Params, jax.Array, Batch], tuple[jax.Array, Metrics]]


@dataclasses.dataclass(frozen=True)
class LossWithState:
  """The loss of a model with Haiku state (`hk.transform_with_state`:
  BatchNorm's moving statistics): `fn(params, model_state, rng, batch) ->
  (loss, metrics, new_model_state)`. `make_train_step` keeps the state in
  `TrainState.model_state`, and a skipped step leaves it as it was.

  Example:
    loss_fn = haiku_mp.make_classification_loss(hk.transform_with_state(f))
    # or, written by hand:
    loss_fn = haiku_mp.LossWithState(my_loss)
  """
  fn: Callable[[hk.Params, hk.State, jax.Array, Batch],
               tuple[jax.Array, Metrics, hk.State]]

  def __call__(self, params, model_state, rng, batch):
    return self.fn(params, model_state, rng, batch)


AnyLoss = Union[LossFn, LossWithState]
# A step's data-parallel axis: None (one device, or jit over a mesh), the
# name of a `pmap` / `shard_map` axis (float32 reductions), or a
# `DataParallel` that also sets the precision of its collectives.
AxisName = Union[None, str, data_parallel.DataParallel]
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
  # Haiku state (`hk.transform_with_state`), as `apply_precision` keeps it
  # (float32 by default); {} for a model without.
  model_state: hk.State = {}  # Never mutated: a NamedTuple field's default.


def init_train_state(params: hk.Params,
                     optimizer: optax.GradientTransformation,
                     loss_scaler: loss_scaling.LossScaler,
                     rng: jax.Array,
                     model_state: Optional[hk.State] = None) -> TrainState:
  """The state before the first step: `params` as `forward.init` made them,
  `optimizer`'s state of them (fp8 histories left out), the initial loss
  scale, the key the steps split, and the model's Haiku state if it has one.

  Example:
    params = forward.init(jax.random.key(0), images, True)
    state = haiku_mp.init_train_state(params, optimizer, scaler, jax.random.key(1))
    # A model with state (hk.transform_with_state):
    params, model_state = forward.init(jax.random.key(0), images, True)
    state = haiku_mp.init_train_state(params, optimizer, scaler,
                                      jax.random.key(1), model_state)
  """
  if isinstance(params, tuple) and len(params) == 2 and model_state is None:
    raise TypeError(
        'init_train_state: params is a (params, state) pair, what '
        'hk.transform_with_state\'s init returns; pass the state as '
        'model_state: init_train_state(params, optimizer, scaler, rng, '
        'model_state)')
  return TrainState(
      step=jnp.zeros([], jnp.int32),
      params=params,
      opt_state=optimizer.init(split_fp8(params)[1]),
      loss_scale=loss_scaler.init(),
      rng=rng,
      skipped_steps=jnp.zeros([], jnp.int32),
      model_state=model_state or {})


def split_fp8(tree: hk.Params) -> tuple[hk.Params, hk.Params]:
  """(fp8 amax histories, everything else) of params or their gradients."""
  return meta_params.split_meta(tree)


def _cross_replica_mean(tree, axis_name):
  """Means over `axis_name`; `num_examples` is summed."""
  if axis_name is None:
    return tree
  return {k: (jax.lax.psum(v, axis_name) if k == 'num_examples' else
              jax.lax.pmean(v, axis_name)) for k, v in tree.items()}


def _returned(result: Any, stateful: bool) -> tuple:
  """A loss's result as the step takes it, or one line naming what it
  should return: `(loss, metrics)`, with the new Haiku state third for a
  `LossWithState`."""
  expected = ('(loss, metrics, new_model_state)' if stateful else
              '(loss, metrics)')
  size = 3 if stateful else 2
  if not isinstance(result, tuple) or len(result) != size:
    if isinstance(result, tuple):
      got = f'a tuple of {len(result)}'
    elif hasattr(result, 'shape'):
      got = f'an array of shape {tuple(result.shape)}'
    else:
      got = f'a {type(result).__name__}'
    raise TypeError(
        f'train_step: loss_fn returned {got}, not {expected}; return '
        f'{"(loss, {}, new_model_state)" if stateful else "(loss, {})"} '
        'for a loss without metrics')
  return result


def _stateful(loss_fn: AnyLoss) -> LossWithState:
  """`loss_fn` as a loss with state: a stateless one passes the state on;
  either's result checked (`_returned`)."""
  if isinstance(loss_fn, LossWithState):
    return LossWithState(lambda *args: _returned(loss_fn(*args), True))

  def fn(params, model_state, rng, batch):
    return (*_returned(loss_fn(params, rng, batch), False), model_state)

  return LossWithState(fn)


def _state_gradients(loss_fn: LossWithState,
                     loss_scaler: loss_scaling.LossScaler,
                     loss_scale: loss_scaling.LossScaleState,
                     params: hk.Params, model_state: hk.State,
                     rng: jax.Array, batch: Batch,
                     axis_name: AxisName = None
                     ) -> tuple[hk.Params, jax.Array, Metrics, hk.State]:
  """`gradients`, and the model's state after the forward pass (averaged
  over `axis_name` replicas, so that every replica keeps the same)."""
  parallel = data_parallel.of(axis_name)
  if parallel is not None:
    rng = jax.random.fold_in(rng, jax.lax.axis_index(parallel.axis_name))
  histories, trained = split_fp8(params)
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


def gradients(loss_fn: LossFn, loss_scaler: loss_scaling.LossScaler,
              loss_scale: loss_scaling.LossScaleState, params: hk.Params,
              rng: jax.Array, batch: Batch, axis_name: AxisName = None
              ) -> tuple[hk.Params, jax.Array, Metrics]:
  """(gradients, loss, metrics) as the train step takes them: of the scaled
  loss, cast to at least float32 (half gradients of float32 params), averaged
  over `axis_name` replicas, then unscaled. Not yet checked for finiteness.
  Each replica draws its own dropout masks from `rng`; the loss and metrics
  cover every replica. A `DataParallel` as `axis_name` sets the dtype the
  gradients are reduced in, and gathers parameters split over the axis."""
  grads, loss, metrics, _ = _state_gradients(
      _stateful(loss_fn), loss_scaler, loss_scale, params, {}, rng, batch,
      axis_name)
  return grads, loss, metrics


# gradients_fn(loss_scale, params, rng, batch, axis_name) -> (float32
# gradients, loss, metrics over every replica): `scaled_gradients`, or
# DP-SGD's (`dp_sgd.make_gradients`).
GradientsFn = Callable[..., tuple[hk.Params, jax.Array, Metrics]]


def scaled_gradients(loss_fn: LossFn,
                     loss_scaler: loss_scaling.LossScaler) -> GradientsFn:
  """`gradients` of `loss_fn` under `loss_scaler`: the train step's, unless
  the run is private. For a caller that wraps or replaces them.

  Example:
    gradients_fn = haiku_mp.scaled_gradients(loss_fn, scaler)
    step = haiku_mp.make_train_step(None, optimizer, scaler, gradients_fn=gradients_fn)
  """
  if isinstance(loss_fn, LossWithState):
    raise TypeError('scaled_gradients: loss_fn has Haiku state '
                    '(LossWithState); pass it to make_train_step itself')
  return functools.partial(gradients, loss_fn, loss_scaler)


# 0.1's name, kept for its users: "ordinary" meant "not DP-SGD's".
ordinary_gradients = scaled_gradients


def _is_state_dict(value: Any) -> bool:
  return isinstance(value, Mapping) and {'params', 'opt_state'} <= set(value)


def _check_state(state: Any, optimizer: optax.GradientTransformation,
                 loss_scaler: loss_scaling.LossScaler, stateful: bool
                 ) -> None:
  """Raises one line naming what is wrong when `state` is not a TrainState
  this step can take: made by `init_train_state` with the same optimizer and
  loss scaler, with Haiku state only if the loss has it. At trace time:
  nothing of it runs in the compiled step."""
  if not isinstance(state, TrainState):
    if _is_state_dict(state):
      raise TypeError(
          'train_step: state is a dict of a TrainState\'s fields (a '
          'checkpoint restored without a target?); restore into the state\'s '
          'layout: ocp.args.StandardRestore(jax.eval_shape(lambda: state))')
    raise TypeError(
        f'train_step: state is a {type(state).__name__}, not a '
        'haiku_mp.TrainState; build it with haiku_mp.init_train_state('
        'params, optimizer, loss_scaler, rng)')
  expected = jax.tree.structure(
      jax.eval_shape(optimizer.init, split_fp8(state.params)[1]))
  found = jax.tree.structure(state.opt_state)
  if found != expected:
    raise TypeError(
        'train_step: state.opt_state is not this optimizer\'s state (it holds '
        f'{_outline(state.opt_state)}; this optimizer\'s init makes '
        f'{_outline(jax.tree.unflatten(expected, expected.num_leaves * [0]))}'
        '); build the state with init_train_state and the optimizer the '
        'step takes')
  loss_scaler.check_state(state.loss_scale, 'train_step: state.loss_scale')
  _check_half_params(split_fp8(state.params)[1], state.opt_state)
  if not stateful and state.model_state:
    raise TypeError(
        'train_step: state.model_state holds Haiku state but the loss takes '
        'none; make the loss from the hk.transform_with_state model '
        '(make_classification_loss, or LossWithState)')


def _check_half_params(params: hk.Params, opt_state: optax.OptState) -> None:
  """Half-precision params take their updates only through an optimizer
  that says how (`float32_master`, `without_master`): a plain optax one's
  updates would be rounded to nearest into them, and those below half an ulp
  lost without a word (docs/precision.md#training-state-layouts)."""
  half = [(path, p.dtype) for path, p in
          jax.tree_util.tree_flatten_with_path(params)[0]
          if jnp.issubdtype(p.dtype, jnp.floating)
          and jnp.finfo(p.dtype).bits < 32]
  if half and not optimizer_lib.has_layout(opt_state):
    path, dtype = half[0]
    raise TypeError(
        f'train_step: {len(half)} params are half precision (e.g. '
        f'{jax.tree_util.keystr(path)}, {jnp.dtype(dtype).name}) and the '
        'optimizer keeps no float32 master: every update would be rounded to '
        'nearest and those under half an ulp lost. Wrap it: '
        'haiku_mp.float32_master(opt), haiku_mp.without_master(opt, '
        "'stochastic') or 'kahan', or without_master(opt, 'nearest') for "
        'round-to-nearest')


# Below this share of the forward's matmul FLOPs, a low-bit precision that
# reaches so few is noted at the step's first trace.
LOW_BIT_REACH_NOTED = 0.5
_LOG = logging.getLogger('haiku_mp')


def _note_precision(record: recording.Record, loss: Optional[LossWithState],
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


def _check_model_state(new: hk.State, old: hk.State) -> None:
  """The loss's new Haiku state has the layout of the state it was given:
  a model with state needs the one its `init` made (`init_train_state`'s
  `model_state`), checked at trace time in one line."""
  if jax.tree.structure(new) == jax.tree.structure(old):
    return
  if not old:
    modules = sorted(new)
    raise TypeError(
        f'train_step: the model has Haiku state ({len(modules)} modules, e.g. '
        f'{modules[0] if modules else "?"}) but state.model_state is empty; '
        "pass what hk.transform_with_state's init returned: params, "
        'model_state = forward.init(...); init_train_state(params, '
        'optimizer, scaler, rng, model_state)')
  raise TypeError(
      'train_step: the loss returned Haiku state of another layout than '
      f'state.model_state (modules {sorted(new)} against {sorted(old)}); '
      'build the state from the same model\'s init')


def _outline(tree: Any, depth: int = 2) -> str:
  """The node types at the top of `tree`, e.g. `(ScaleByAdamState(array,
  dict, dict), EmptyState())`: enough to tell two optimizers' states
  apart."""
  if isinstance(tree, Mapping):
    return 'dict'
  if not isinstance(tree, (tuple, list)):
    return 'array'
  name = type(tree).__name__ if hasattr(tree, '_fields') else ''
  if depth == 0:
    return name or '(...)'
  return f'{name}({", ".join(_outline(t, depth - 1) for t in tree)})'


def _kept_if_skipped(finite: jax.Array, new: Any, old: Any) -> Any:
  """`new` where the step's gradients are `finite`, else `old`, each leaf in
  `old`'s dtype: an optax transformation may return state in the dtype of
  the float32 gradients for half params (optax.adam's moments of bfloat16
  params), which the next step must not see change (jmp's `select_tree`
  refuses the mix)."""
  return jax.tree.map(
      lambda n, o: jnp.where(finite, jnp.asarray(n).astype(o.dtype), o),
      new, old)


def make_train_step(loss_fn: Optional[AnyLoss],
                    optimizer: optax.GradientTransformation,
                    loss_scaler: loss_scaling.LossScaler = (
                        loss_scaling.LossScaler()),
                    axis_name: AxisName = None,
                    inputs: TrainInputs = _as_is_train, *,
                    gradients_fn: Optional[GradientsFn] = None
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
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
  stateful = isinstance(loss_fn, LossWithState)
  stateful_loss = None if loss_fn is None else _stateful(loss_fn)
  if gradients_fn is None:

    def gradients_fn(loss_scale, params, rng, batch, axis_name, model_state):
      return _state_gradients(stateful_loss, loss_scaler, loss_scale, params,
                              model_state, rng, batch, axis_name)
  else:
    brought = gradients_fn

    def gradients_fn(loss_scale, params, rng, batch, axis_name, model_state):
      return (*brought(loss_scale, params, rng, batch, axis_name),
              model_state)

  optimizer = optax.with_extra_args_support(optimizer)
  axis = data_parallel.of(axis_name)
  noted = []  # Whether a trace has noted the precision (`_note_precision`).

  def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    _check_state(state, optimizer, loss_scaler, stateful)
    rng, step_rng, inputs_rng = jax.random.split(state.rng, 3)
    batch = inputs(inputs_rng, batch, axis and axis.axis_name, state.step)
    with recording.recording() as record:
      grads, loss, aux, model_state = gradients_fn(
          state.loss_scale, state.params, step_rng, batch, axis_name,
          state.model_state)
    _check_model_state(model_state, state.model_state)
    if not noted:  # The first trace says what it saw, once.
      noted.append(True)
      _note_precision(record, stateful_loss,
                      (state.params, state.model_state, step_rng, batch))
    # fp8 amax histories are written over on every step, skipped or not: a
    # skipped step's amaxes are real observations (non-finite ones are not
    # recorded, fp8_scales.roll_history), and the next step's scales need them.
    histories, grads = split_fp8(grads)
    _, trained = split_fp8(state.params)
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
    # The rounding of bfloat16 state (optimizer.py): the same on every
    # replica and shard, from the state's key, so a resume redraws it.
    round_key = jax.random.fold_in(state.rng, ROUNDING_DRAW)
    updates, new_opt_state = optimizer.update(grads, state.opt_state, trained,
                                              key=round_key)
    new_params = optimizer_lib.apply_updates(trained, updates, new_opt_state,
                                             round_key)
    updates_lost = _updates_lost(trained, new_params, updates)
    params, opt_state, model_state = _kept_if_skipped(
        applied, (new_params, new_opt_state, model_state),
        (trained, state.opt_state, state.model_state))
    params = meta_params.merge_meta(params, histories)
    skipped_steps = state.skipped_steps + (~applied).astype(jnp.int32)
    new_state = TrainState(
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


def _takes_rng(forward: Any) -> bool:
  """Whether `forward.apply` takes a key (`hk.transform`), or not
  (`hk.without_apply_rng`), checked as Haiku writes its signatures; raises
  one line when `forward` is not a transformed Haiku function."""
  if not isinstance(forward, (hk.Transformed, hk.TransformedWithState)):
    raise TypeError(
        f'forward is a {type(forward).__name__}, not a transformed Haiku '
        'function; pass hk.transform(f) or hk.transform_with_state(f)')
  names = list(inspect.signature(forward.apply).parameters)
  first = 2 if isinstance(forward, hk.TransformedWithState) else 1
  return names[first:first + 1] == ['rng']


def _applied(forward: Any) -> Callable[..., Any]:
  """`forward.apply` as `(params, [model_state,] rng, images, is_training)`,
  whether or not it takes a key (`hk.without_apply_rng`)."""
  if _takes_rng(forward):
    return forward.apply
  if isinstance(forward, hk.TransformedWithState):
    return lambda params, state, rng, *args: forward.apply(params, state,
                                                           *args)
  return lambda params, rng, *args: forward.apply(params, *args)


class BatchKeyError(KeyError):
  """A key the loss reads that the batch lacks; its message is one line."""

  def __str__(self) -> str:
    return str(self.args[0])


def _keyed(batch: Batch, image_key: str, label_key: str) -> Batch:
  """`batch` with its images and labels under the names the loss reads, or
  one line naming the keys it has and the arguments that name them."""
  missing = [k for k in (image_key, label_key) if k not in batch]
  if missing:
    raise BatchKeyError(
        f'make_classification_loss: the batch has keys {sorted(batch)}, no '
        f'{missing[0]!r}; it reads the images at image_key={image_key!r} and '
        f'the labels at label_key={label_key!r}: name yours, '
        "make_classification_loss(forward, image_key=..., label_key=...)")
  renamed = {k: v for k, v in batch.items() if k not in (image_key, label_key)}
  return dict(renamed, image=batch[image_key], label=batch[label_key])


def make_classification_loss(forward: Union[hk.Transformed,
                                            hk.TransformedWithState],
                             label_smoothing: float = 0.0, *,
                             image_key: str = 'image',
                             label_key: str = 'label') -> AnyLoss:
  """The training loss of a classifier `forward(images, is_training)`:
  cross-entropy in float32, its targets smoothed by `label_smoothing`,
  the images and integer labels read from the batch at `image_key` and
  `label_key` (mixing's soft `targets` and a `mask`, where present, by
  those names). `forward` is `hk.transform`'s (with or without
  `hk.without_apply_rng`) or `hk.transform_with_state`'s; then the loss is
  a `LossWithState`, which the train step gives the state in
  `TrainState.model_state`.

  Example:
    loss_fn = haiku_mp.make_classification_loss(hk.transform(forward), 0.1)
    loss, metrics = loss_fn(params, rng, dict(image=images, label=labels))
  """
  apply = _applied(forward)

  def metrics_of(logits, batch):
    metrics = _weighted_metrics(logits, batch,
                                label_smoothing=label_smoothing)
    return metrics.pop('loss'), metrics

  if isinstance(forward, hk.TransformedWithState):

    def loss_with_state(params, model_state, rng, batch):
      batch = _keyed(batch, image_key, label_key)
      logits, model_state = apply(params, model_state, rng, batch['image'],
                                  True)
      return (*metrics_of(logits, batch), model_state)

    return LossWithState(loss_with_state)

  def loss_fn(params, rng, batch):
    batch = _keyed(batch, image_key, label_key)
    return metrics_of(apply(params, rng, batch['image'], True), batch)

  return loss_fn


def make_eval_step(forward: Union[hk.Transformed, hk.TransformedWithState],
                   axis_name: Optional[str] = None,
                   inputs: EvalInputs = lambda batch: batch
                   ) -> Callable[..., Metrics]:
  """`eval_step(params, batch) -> {logits, loss, accuracy, num_examples}`, no
  dropout; for a model with Haiku state `eval_step(params, batch,
  model_state)`, which reads the state (BatchNorm's moving statistics) and
  leaves it as it is.

  Under `jax.pmap` pass its `axis_name`: the metrics then cover every replica.

  Example:
    eval_step = jax.jit(haiku_mp.make_eval_step(hk.transform(forward)))
    accuracy = eval_step(state.params, batch)['accuracy']
    # With state: eval_step(state.params, batch, state.model_state)
  """
  apply = _applied(forward)
  stateful = isinstance(forward, hk.TransformedWithState)

  def eval_step(params: hk.Params, batch: Batch,
                model_state: Optional[hk.State] = None) -> Metrics:
    if isinstance(params, TrainState):
      raise TypeError('eval_step: takes the params (state.params), not the '
                      'TrainState')
    if stateful and model_state is None:
      raise TypeError('eval_step: the model has Haiku state; pass it: '
                      'eval_step(params, batch, state.model_state)')
    if not stateful and model_state:
      raise TypeError('eval_step: the model takes no Haiku state (made with '
                      'hk.transform), but model_state was given')
    batch = inputs(batch)
    if stateful:
      logits, _ = apply(params, model_state, None, batch['image'], False)
    else:
      logits = apply(params, None, batch['image'], False)
    return dict(_weighted_metrics(logits, batch, axis_name), logits=logits)

  return eval_step
