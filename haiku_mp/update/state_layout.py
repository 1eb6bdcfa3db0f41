"""The training state's layouts (`STATE_LAYOUTS`, the one table of them),
and what a TrainState holds, part by part, and how many bytes per parameter.

The training state's layout (float32 params, or bfloat16 params with or
without a float32 master; Adam's moments in float32 or bfloat16; a Kahan
buffer; fp8 histories; the moving average) is what decides its size, not the
compute dtype. The parts are read from the state's own tree (field names of
the optimizer's states), so that what is reported is what is stored.
"""

import math
from typing import Any, Mapping, NamedTuple

import jax

from haiku_mp.model import meta_params
from haiku_mp.update import block_moments
from haiku_mp.update import param_updates


class StateLayout(NamedTuple):
  """How a training state is kept: the params' dtype, how updates reach
  them (`param_updates.PARAM_UPDATES`), and Adam's moments' dtypes
  (`make_optimizer`'s `param_update`, `mu_dtype`, `nu_dtype`)."""
  params: str
  param_update: str
  mu_dtype: str
  nu_dtype: str


# The layouts the docs and the lab name, from the default (float32 params)
# to the least memory: the one table of them.
STATE_LAYOUTS = {
    'float32': StateLayout('float32', param_updates.MASTER, 'float32',
                           'float32'),
    'bf16+master': StateLayout('bfloat16', param_updates.MASTER, 'float32',
                               'float32'),
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

# The parts, in the order a table shows them; `other` is the step, counts,
# loss scale and key: a few bytes.
PARTS = ('params', 'master', 'mu', 'nu', 'compensation', 'ema', 'fp8',
         'other')
# The optimizer states' field names that hold one copy of the params each
# (param_updates.MasterState, optax.ScaleByAdamState,
# param_updates.KahanState, moving_average.EmaState).
_FIELD_PARTS = {'master': 'master', 'mu': 'mu', 'nu': 'nu',
                'compensation': 'compensation', 'ema_params': 'ema'}


def _nbytes(leaf) -> int:
  return math.prod(leaf.shape) * leaf.dtype.itemsize


def _part(path) -> str:
  names = [getattr(k, 'name', getattr(k, 'key', None)) for k in path]
  if names[0] == 'params':
    return 'fp8' if names[-1] in meta_params.META_NAMES else 'params'
  if names[0] == 'opt_state':
    for name in reversed(names):
      if name in _FIELD_PARTS:
        return _FIELD_PARTS[name]
  return 'other'


def bytes_by_part(state) -> dict[str, int]:
  """Bytes of each of `PARTS` in a TrainState (arrays or ShapeDtypeStructs;
  the rng key as stored), zero where a part is absent."""
  sizes = dict.fromkeys(PARTS, 0)
  state = state._replace(rng=jax.eval_shape(jax.random.key_data, state.rng))
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    sizes[_part(path)] += _nbytes(leaf)
  return sizes


def param_count(state) -> int:
  """The trained parameters (fp8 histories left out)."""
  _, trained = meta_params.split_meta(state.params)
  return sum(math.prod(p.shape) for p in jax.tree.leaves(trained))


def dtype_names(tree) -> str:
  """'bfloat16', or 'bfloat16/float32' (most bytes first) for a tree."""
  sizes = {}
  for leaf in jax.tree.leaves(tree):
    sizes[leaf.dtype.name] = sizes.get(leaf.dtype.name, 0) + _nbytes(leaf)
  return '/'.join(sorted(sizes, key=lambda d: -sizes[d])) or '-'


def describe(state, param_update: str, mu_dtype: str, nu_dtype: str) -> str:
  """The `State:` line of a run: the layout (`param_update` and the
  moments' dtypes, as `optimizer.make_optimizer` takes them), and bytes per
  parameter in all and per part."""
  sizes = bytes_by_part(state)
  per = per_parameter(sizes, param_count(state))
  params = dtype_names(meta_params.split_meta(state.params)[1])
  if sizes['master']:
    how = 'rounded from a float32 master copy'
  elif param_update == 'master':
    how = 'updated in place'
  else:
    how = f'no master, updates rounded {_ROUNDING_WORDS[param_update]}'
  parts = ', '.join(f'{name} {per[name]:.2f}' for name in PARTS
                    if sizes[name] and name != 'other')
  return (f'State: params {params} ({how}), Adam moments '
          f'{mu_dtype}/{nu_dtype}: '
          f'{per["total"]:.2f} bytes per parameter ({parts}), '
          f'{sum(sizes.values()) / 1e6:.2f} MB')


_ROUNDING_WORDS = {'nearest': 'to nearest', 'stochastic': 'stochastically',
                   'kahan': 'to nearest with a Kahan buffer'}


def per_parameter(sizes: Mapping[str, int], count: int) -> dict[str, Any]:
  """`bytes_by_part`'s sizes as bytes per parameter, and their total."""
  count = max(count, 1)
  row = {name: sizes[name] / count for name in PARTS}
  row['total'] = sum(sizes.values()) / count
  return row
