"""How params take an optimizer's updates: the layouts around any optax
optimizer, and the new params they make.

The optimizer always computes in float32 from float32 (unscaled) gradients.
Where its results are kept (`make_optimizer`'s `param_update`,
docs/precision.md):

- `master` (the default): float32 params are their own master; when the
  policy stores params in half precision, `float32_master` keeps the float32
  copy the optimizer updates, and the half params are that copy rounded after
  every step (so updates smaller than a half-precision ulp are not lost);
- `nearest`, `stochastic`, `kahan`: bfloat16 params and no float32 copy
  (`without_master`). The optimizer reads the params as float32 values and
  each step's float32 result is rounded into them to nearest,
  stochastically, or to nearest with a Kahan compensation buffer in the
  params' dtype (`rounding.py`).
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from haiku_mp.update import rounding


# How params take an update: see the module docstring.
MASTER = 'master'
PARAM_UPDATES = (MASTER, 'nearest', 'stochastic', 'kahan')


class MasterState(NamedTuple):
  master: optax.Params  # float32 copy of every param.
  inner: optax.OptState  # state of the wrapped optimizer, over `master`.


def float32_master(inner: optax.GradientTransformation
                   ) -> optax.GradientTransformation:
  """Runs any optax `inner` on a float32 copy of the params, whatever their
  dtype: half-precision params are that copy rounded after every step, so
  updates below their ulp are not lost. The outermost transformation, as
  `without_master`.

  Apply its updates with `apply_updates` below: the new params are then exactly
  the updated float32 copy rounded to each param's dtype. (`optax.apply_updates`
  gets within rounding of that, as `params + (master - params)`.)

  Example:
    optimizer = haiku_mp.float32_master(optax.adam(1e-3, b2=0.99))
    state = haiku_mp.init_train_state(bf16_params, optimizer, scaler, key)
  """
  inner = optax.with_extra_args_support(inner)

  def init(params):
    # A copy even of float32 leaves: a donated state must not hold one buffer
    # twice.
    master = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True),
                          params)
    return MasterState(master, inner.init(master))

  def update(grads, state, params, **extra_args):
    grads = _as_float32(grads)
    updates, inner_state = inner.update(grads, state.inner, state.master,
                                        **extra_args)
    master = optax.apply_updates(state.master, updates)
    updates = jax.tree.map(lambda m, p: m - p.astype(jnp.float32), master,
                           params)
    return updates, MasterState(master, inner_state)

  return optax.GradientTransformationExtraArgs(init, update)


def _as_float32(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


class NearestState(NamedTuple):
  inner: optax.OptState  # state of the wrapped optimizer; no master copy.


class StochasticState(NamedTuple):
  inner: optax.OptState  # state of the wrapped optimizer; no master copy.


class KahanState(NamedTuple):
  inner: optax.OptState  # state of the wrapped optimizer; no master copy.
  # Per param, in its dtype: what rounding the last update dropped.
  compensation: optax.Params


_NO_MASTER_STATES = {'nearest': NearestState, 'stochastic': StochasticState,
                     'kahan': KahanState}


def without_master(inner: optax.GradientTransformation, param_update: str
                   ) -> optax.GradientTransformationExtraArgs:
  """Runs any optax `inner` on half-precision params read as float32, with
  no float32 copy: each param is its float32 result, `param + update`,
  rounded to its dtype by `param_update` ('nearest', 'stochastic', or
  'kahan': to nearest after adding the compensation this state keeps).
  float32 params in the tree (LayerNorm's, under `float32_layer_norm`)
  simply take the float32 result. It must be the outermost transformation
  (`make_train_step` applies its updates with `apply_updates` below and the
  step's rounding key).

  Example:
    optimizer = haiku_mp.without_master(optax.lion(1e-4), 'stochastic')
    state = haiku_mp.init_train_state(bf16_params, optimizer, scaler, key)
  """
  if param_update not in _NO_MASTER_STATES:
    raise ValueError(f'param_update {param_update!r}: expected one of '
                     f'{tuple(_NO_MASTER_STATES)}')
  inner = optax.with_extra_args_support(inner)
  kahan = param_update == 'kahan'
  state_type = _NO_MASTER_STATES[param_update]

  def init(params):
    # Of array leaves only: `optax.tree_map_params` inits with placeholders.
    floats = [p.dtype for p in jax.tree.leaves(params)
              if jnp.issubdtype(getattr(p, 'dtype', None) or jnp.int32,
                                jnp.floating)]
    if floats and all(jnp.finfo(d).bits >= 32 for d in floats):
      raise ValueError(
          f'without_master(..., {param_update!r}) rounds updates into '
          'half-precision params, but every param is float32; store params '
          "in bfloat16 (a 'params=bfloat16' policy), or use the optimizer "
          'itself')
    # Moments and averages of float32 values; the copy is transient.
    inner_state = inner.init(_as_float32(params))
    if kahan:
      return KahanState(inner_state, optax.tree.zeros_like(params))
    return state_type(inner_state)

  def update(grads, state, params, **extra_args):
    updates, inner_state = inner.update(_as_float32(grads), state.inner,
                                        _as_float32(params), **extra_args)
    if not kahan:
      return updates, state_type(inner_state)
    # The update applied is update + compensation; `apply_updates` rounds
    # param + that to nearest, as kahan_add does here.
    compensation = jax.tree.map(
        lambda p, u, c: rounding.kahan_add(p, u, c)[1], params, updates,
        state.compensation)
    updates = jax.tree.map(lambda u, c: u + c.astype(jnp.float32), updates,
                           state.compensation)
    return updates, KahanState(inner_state, compensation)

  return optax.GradientTransformationExtraArgs(init, update)


def apply_updates(params: optax.Params, updates: optax.Updates,
                  new_opt_state: optax.OptState,
                  key: Optional[jax.Array] = None) -> optax.Params:
  """The new params: `optax.apply_updates`; the rounded master copy under
  `float32_master`; under `without_master`, `param + update` in float32
  rounded to each param's dtype, stochastically from `key` (the step's
  rounding key, the one its optimizer update took)."""
  nested = _nested_layout(new_opt_state)
  if nested is not None:
    raise TypeError(
        f'{nested} is inside another optax transformation (a chain, '
        'MultiSteps, ...); it must wrap the whole optimizer: e.g. '
        'without_master(optax.chain(clip, adam), ...), not '
        'optax.chain(clip, without_master(adam, ...))')
  if isinstance(new_opt_state, MasterState):
    return jax.tree.map(lambda m, p: m.astype(p.dtype), new_opt_state.master,
                        params)
  if isinstance(new_opt_state, (NearestState, KahanState, StochasticState)):
    results = jax.tree.map(lambda p, u: p.astype(jnp.float32) + u, params,
                           updates)
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    if isinstance(new_opt_state, StochasticState):
      if key is None:
        raise ValueError('stochastic rounding needs the step\'s key')
      return rounding.tree_stochastic_round(
          jax.random.fold_in(key, rounding.PARAMS_DRAW), results, dtypes)
    return jax.tree.map(lambda r, d: r.astype(d), results, dtypes)
  return optax.apply_updates(params, updates)


_LAYOUT_STATES = (MasterState, NearestState, StochasticState, KahanState)
_LAYOUT_NAMES = {MasterState: 'float32_master(...)',
                 NearestState: "without_master(..., 'nearest')",
                 StochasticState: "without_master(..., 'stochastic')",
                 KahanState: "without_master(..., 'kahan')"}


def _nested_layout(opt_state: optax.OptState) -> Optional[str]:
  """The name of a layout (`float32_master`, `without_master`) whose state
  sits below the top of `opt_state`, where its updates would not be
  applied as it needs; None if there is none."""
  if isinstance(opt_state, _LAYOUT_STATES):
    return None
  found = [x for x in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, _LAYOUT_STATES))
           if isinstance(x, _LAYOUT_STATES)]
  return _LAYOUT_NAMES[type(found[0])] if found else None


def has_layout(opt_state: optax.OptState) -> bool:
  """Whether `opt_state` is a layout's (`float32_master`, `without_master`):
  an optimizer that says how half-precision params take their updates."""
  return isinstance(opt_state, _LAYOUT_STATES) or _nested_layout(
      opt_state) is not None
