"""The optax optimizer from config: AdamW with warmup + cosine decay and clipping,
on the training-state layout the precision config names.

It always computes in float32 from float32 (unscaled) gradients. Where its
results are kept (`precision.param_update`, docs/precision.md):

- `master` (the default): float32 params are their own master; when the
  policy stores params in half precision, `float32_master` keeps the float32
  copy the optimizer updates, and the half params are that copy rounded after
  every step (so updates smaller than a half-precision ulp are not lost);
- `nearest`, `stochastic`, `kahan`: bfloat16 params and no float32 copy. The
  optimizer reads the params as float32 values and each step's float32 result
  is rounded into them to nearest, stochastically, or to nearest with a Kahan
  compensation buffer in the params' dtype (`rounding.py`).

Adam's moments are float32, bfloat16 or 8-bit each (`precision.mu_dtype`,
`precision.nu_dtype`): bfloat16 moments are rounded stochastically, because
to nearest the second moment's small steps vanish (rounding.py); 8-bit ones
are float8 codes with a scale per block, also rounded stochastically
(block_moments.py).
"""

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from haiku_mp.update import block_moments
from haiku_mp.update import rounding

# How params take an update: see the module docstring.
MASTER = 'master'
PARAM_UPDATES = (MASTER, 'nearest', 'stochastic', 'kahan')


class StateLayout(NamedTuple):
  """How a training state is kept: the params' dtype, how updates reach
  them (`PARAM_UPDATES`), and Adam's moments' dtypes (`make_optimizer`'s
  `param_update`, `mu_dtype`, `nu_dtype`)."""
  params: str
  param_update: str
  mu_dtype: str
  nu_dtype: str


# The layouts the docs and the lab name, from the default (float32 params)
# to the least memory: the one table of them.
STATE_LAYOUTS = {
    'float32': StateLayout('float32', MASTER, 'float32', 'float32'),
    'bf16+master': StateLayout('bfloat16', MASTER, 'float32', 'float32'),
    'bf16 nearest': StateLayout('bfloat16', 'nearest', 'float32', 'float32'),
    'bf16 stochastic': StateLayout('bfloat16', 'stochastic', 'float32',
                                   'float32'),
    'bf16 kahan': StateLayout('bfloat16', 'kahan', 'float32', 'float32'),
    'bf16 kahan, bf16 moments': StateLayout('bfloat16', 'kahan', 'bfloat16',
                                            'bfloat16'),
    # configs/vit_pure_bf16.py's.
    'bf16 stochastic, bf16 moments': StateLayout('bfloat16', 'stochastic',
                                                 'bfloat16', 'bfloat16'),
    # configs/vit_pure_bf16_8bit.py's.
    'bf16 stochastic, 8-bit moments': StateLayout(
        'bfloat16', 'stochastic', block_moments.FLOAT8_BLOCKS,
        block_moments.FLOAT8_BLOCKS),
}
PURE_BF16 = STATE_LAYOUTS['bf16 stochastic, bf16 moments']
PURE_BF16_8BIT = STATE_LAYOUTS['bf16 stochastic, 8-bit moments']
# What Adam's first and second moments may be kept in.
MOMENT_DTYPES = ('float32', 'bfloat16', block_moments.FLOAT8_BLOCKS)
# Elements per block of an 8-bit moment: torchao's (block_moments.py).
MOMENT_BLOCK_SIZE = 256
# The independent draws one step's rounding key gives (fold_in data).
_PARAMS_DRAW, _MU_DRAW, _NU_DRAW = 0, 1, 2


def learning_rate_schedule(learning_rate: float, warmup_steps: int,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then cosine decay to 0 at `total_steps`.

  Example:
    schedule = haiku_mp.learning_rate_schedule(1e-3, 500, total_steps=10_000)
    optimizer = haiku_mp.make_optimizer(schedule, weight_decay=0.05)
  """
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


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                  mu_dtype: str = 'float32', nu_dtype: str = 'float32',
                  block_size: int = MOMENT_BLOCK_SIZE
                  ) -> optax.GradientTransformationExtraArgs:
  """`optax.scale_by_adam` with each moment kept in `mu_dtype` / `nu_dtype`:
  float32, bfloat16 rounded stochastically, or 'float8_blocks' (8 bits per
  value and a float32 scale per `block_size` values, rounded
  stochastically; block_moments.py), with the `key` its update takes.
  Computed in float32 as optax does (the same state structure, so
  `optax.tree` helpers find `mu` and `nu`): with both moments float32 its
  updates are optax's bit for bit. optax's `mu_dtype` rounds to nearest and
  it has no `nu_dtype` (see rounding.py for why that fails)."""
  kinds = (mu_dtype, nu_dtype)
  for kind in kinds:
    if kind not in MOMENT_DTYPES:
      raise ValueError(f'moment dtype {kind!r}: expected one of '
                       f'{MOMENT_DTYPES}')

  def zeros(params, kind):
    if kind == block_moments.FLOAT8_BLOCKS:
      return block_moments.zeros_like(params, block_size)
    return optax.tree.zeros_like(params, dtype=jnp.dtype(kind))

  def load(moment, kind, second):
    if kind == block_moments.FLOAT8_BLOCKS:
      return block_moments.load(moment, block_size, square=second)
    return _as_float32(moment)

  def store(key, moment, kind, second):
    if kind == 'float32':
      return moment
    if kind == block_moments.FLOAT8_BLOCKS:
      return block_moments.store(key, moment, block_size, square_root=second)
    return rounding.tree_stochastic_round(
        key, moment, jax.tree.map(lambda _: jnp.dtype(kind), moment))

  def init(params):
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                  mu=zeros(params, kinds[0]),
                                  nu=zeros(params, kinds[1]))

  def update(updates, state, params=None, *, key=None, **extra_args):
    del params, extra_args
    mu = optax.tree.update_moment(updates, load(state.mu, kinds[0], False),
                                  b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(
        updates, load(state.nu, kinds[1], True), b2, 2)
    count = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat,
                           nu_hat)
    if any(k != 'float32' for k in kinds) and key is None:
      raise ValueError('moments below float32 are rounded stochastically: '
                       'pass the step\'s key to update (key=...)')
    mu = store(jax.random.fold_in(key, _MU_DRAW) if key is not None else None,
               mu, kinds[0], False)
    nu = store(jax.random.fold_in(key, _NU_DRAW) if key is not None else None,
               nu, kinds[1], True)
    return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformationExtraArgs(init, update)


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
          jax.random.fold_in(key, _PARAMS_DRAW), results, dtypes)
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


def ema_decay_for(decay: float, horizon: float, total_steps: int) -> float:
  """`decay`, or with `horizon` > 0 the decay whose time constant
  (1 / (1 - decay) steps) is that share of `total_steps`: a fixed decay
  outlasts a short run (0.9998 averages over 5,000 steps, longer than a
  20-epoch run at batch 512) and lags the end of any run whose schedule
  it spans. At least 2 steps, so a tiny run still keeps an average."""
  if horizon <= 0:
    return decay
  return 1.0 - 1.0 / max(horizon * total_steps, 2.0)


def make_optimizer(schedule: optax.Schedule, *, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0,
                   grad_clip_norm: float = 0.0, ema_decay: float = 0.0,
                   half_params: bool = False, param_update: str = MASTER,
                   mu_dtype: str = 'float32', nu_dtype: str = 'float32',
                   moment_block_size: int = MOMENT_BLOCK_SIZE
                   ) -> optax.GradientTransformationExtraArgs:
  """Clipping by global norm (if `grad_clip_norm` > 0), then AdamW on
  `schedule` (`b1`, `b2`, `eps` as optax's) with its moments in `mu_dtype`
  / `nu_dtype` ('float32',
  'bfloat16', or 'float8_blocks': 8 bits and a scale per
  `moment_block_size` values), then the params'
  moving average (if `ema_decay` > 0; float32 in every layout: see
  docs/precision.md).

  With `half_params` (some params stored in float16 / bfloat16), they take
  their updates as `param_update` says: from a float32 master copy
  (`float32_master`), or rounded into them (`without_master`). Its update
  takes the step's rounding `key=` (`apply_updates` takes the same key).
  Another optax optimizer gets the same layouts from those two wrappers.

  Example:
    optimizer = haiku_mp.make_optimizer(schedule, half_params=True,  # :pure_bf16
        param_update='stochastic', mu_dtype='bfloat16', nu_dtype='bfloat16')
    # About 4 bytes per parameter: bfloat16 params, 8-bit moments.
    optimizer = haiku_mp.make_optimizer(schedule, half_params=True,
        param_update='stochastic', mu_dtype='float8_blocks',
        nu_dtype='float8_blocks')
  """
  if param_update not in PARAM_UPDATES:
    raise ValueError(f'param_update {param_update!r}: expected one of '
                     f'{PARAM_UPDATES}')
  if param_update != MASTER and not half_params:
    raise ValueError(f'param_update {param_update!r} rounds half params; '
                     'these params are float32')
  if mu_dtype == nu_dtype == 'float32':
    # optax's own, so that states saved before moment dtypes existed restore.
    optimizer = optax.adamw(schedule, b1=b1, b2=b2, eps=eps,
                            weight_decay=weight_decay, mask=decay_mask)
  else:
    optimizer = optax.chain(
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                      block_size=moment_block_size),
        optax.add_decayed_weights(weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule))
  if grad_clip_norm > 0:
    optimizer = optax.chain(optax.clip_by_global_norm(grad_clip_norm),
                            optimizer)
  if ema_decay > 0:
    optimizer = optax.chain(optimizer, track_ema(ema_decay))
  if not half_params:
    return optax.with_extra_args_support(optimizer)
  if param_update == MASTER:
    return float32_master(optimizer)
  return without_master(optimizer, param_update)
