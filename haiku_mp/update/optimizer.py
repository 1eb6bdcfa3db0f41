"""The optax optimizer of a run: AdamW on a learning-rate schedule, with
clipping, on the training-state layout its `param_update` names
(`param_updates.py`).

Adam's moments are float32, bfloat16 or 8-bit each (`mu_dtype`,
`nu_dtype`): bfloat16 moments are rounded stochastically, because
to nearest the second moment's small steps vanish (rounding.py); 8-bit ones
are float8 codes with a scale per block, also rounded stochastically
(block_moments.py).
"""

import jax
import jax.numpy as jnp
import optax

from haiku_mp.update import block_moments
from haiku_mp.update import moving_average
from haiku_mp.update import param_updates
from haiku_mp.update import rounding


# What Adam's first and second moments may be kept in.
MOMENT_DTYPES = ('float32', 'bfloat16', block_moments.FLOAT8_BLOCKS)
# Elements per block of an 8-bit moment: torchao's (block_moments.py).
MOMENT_BLOCK_SIZE = 256


# The only params weight decay shrinks: Linear and Conv weights. Biases,
# LayerNorm's scale and offset, the cls token and the position embedding
# keep their values (as in ViT and DeiT recipes).
_DECAYED = 'w'


def decay_mask(params):
  """True where weight decay applies (`_DECAYED` leaves), by param name."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], 'key', None) == _DECAYED, params)


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
    return jax.tree.map(lambda m: m.astype(jnp.float32), moment)

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
    mu = store(None if key is None else jax.random.fold_in(
        key, rounding.MU_DRAW), mu, kinds[0], False)
    nu = store(None if key is None else jax.random.fold_in(
        key, rounding.NU_DRAW), nu, kinds[1], True)
    return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

  return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(schedule: optax.Schedule, *, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0,
                   grad_clip_norm: float = 0.0, ema_decay: float = 0.0,
                   half_params: bool = False,
                   param_update: str = param_updates.MASTER,
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
  if param_update not in param_updates.PARAM_UPDATES:
    raise ValueError(f'param_update {param_update!r}: expected one of '
                     f'{param_updates.PARAM_UPDATES}')
  if param_update != param_updates.MASTER and not half_params:
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
    optimizer = optax.chain(optimizer, moving_average.track_ema(ema_decay))
  if not half_params:
    return optax.with_extra_args_support(optimizer)
  if param_update == param_updates.MASTER:
    return param_updates.float32_master(optimizer)
  return param_updates.without_master(optimizer, param_update)
