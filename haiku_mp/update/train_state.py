"""`TrainState`: everything a train step reads and writes, how the first
one is made, and the checks that a state is one a step can take."""

from typing import Any, Mapping, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from haiku_mp.model import meta_params
from haiku_mp.update import loss_scaling
from haiku_mp.update import param_updates


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


def _is_state_dict(value: Any) -> bool:
  return isinstance(value, Mapping) and {'params', 'opt_state'} <= set(value)


def check_state(state: Any, optimizer: optax.GradientTransformation,
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
  if half and not param_updates.has_layout(opt_state):
    path, dtype = half[0]
    raise TypeError(
        f'train_step: {len(half)} params are half precision (e.g. '
        f'{jax.tree_util.keystr(path)}, {jnp.dtype(dtype).name}) and the '
        'optimizer keeps no float32 master: every update would be rounded to '
        'nearest and those under half an ulp lost. Wrap it: '
        'haiku_mp.float32_master(opt), haiku_mp.without_master(opt, '
        "'stochastic') or 'kahan', or without_master(opt, 'nearest') for "
        'round-to-nearest')


def check_model_state(new: hk.State, old: hk.State) -> None:
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
