"""The device mesh and the rules that shard parameters over its 'model' axis.

Rules map a regular expression over ``module_path/param_name`` (e.g.
``vit/encoder_block_0/attention/query/w``) to a PartitionSpec string such as
``None,model``. The first rule that matches wins; config rules
(`parallel.sharding_rules`) are tried before `DEFAULT_RULES`; a parameter that
no rule matches is replicated.
"""

import math
import re
from typing import Any, Optional, Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

from haiku_mp import errors

BATCH = 'batch'
MODEL = 'model'
AXES = (BATCH, MODEL)

# Attention and MLP kernels along their output features (first matmul) or
# input features (second matmul), so that each pair needs one all-reduce;
# biases follow their kernel's output features; everything else is replicated.
DEFAULT_RULES = (
    (r'.*/attention/(query|key|value)/w$', 'None,model'),
    (r'.*/attention/(query|key|value)/b$', 'model'),
    (r'.*/attention/out/w$', 'model,None'),
    (r'.*/mlp_block/fc1/w$', 'None,model'),
    (r'.*/mlp_block/fc1/b$', 'model'),
    (r'.*/mlp_block/fc2/w$', 'model,None'),
)


class ShardingError(errors.ConfigError):
  """A mesh or sharding rule that cannot be used; names the setting."""


def make_mesh(mesh_shape: Sequence[int],
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A ('batch', 'model') mesh with Auto axes; -1 takes the remaining
  devices. `mesh_shape` is two sizes, at most one -1 (the setting's own
  check); what the devices allow is checked here."""
  devices = list(jax.devices() if devices is None else devices)
  shape = [int(d) for d in mesh_shape]
  if -1 in shape:
    known = -math.prod(shape)
    if len(devices) % known:
      raise ShardingError(
          f'parallel.mesh_shape={tuple(mesh_shape)} does not divide the '
          f'{len(devices)} devices')
    shape[shape.index(-1)] = len(devices) // known
  if math.prod(shape) != len(devices):
    raise ShardingError(
        f'parallel.mesh_shape={tuple(mesh_shape)} needs {math.prod(shape)} '
        f'devices; there are {len(devices)}')
  return jax.make_mesh(tuple(shape), AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def parse_spec(text: str) -> P:
  """``'None,model'`` -> ``P(None, 'model')``; ``''`` -> ``P()``. Rules name
  the `model` axis only: `batch` is the data's, and parameters are split
  over it by `parallel.strategy=fsdp` alone (sharding.fsdp_specs)."""
  parts = [p.strip() for p in text.split(',')] if text.strip() else []
  axes = []
  for part in parts:
    if part in ('None', ''):
      axes.append(None)
    elif part == MODEL:
      axes.append(part)
    elif BATCH in part and MODEL in part:
      raise ShardingError(
          f'parallel.sharding_rules: {text!r} shards one dimension over both '
          f"mesh axes; a rule names 'model' only (parallel.strategy=fsdp "
          "splits parameters over 'batch', on another dimension)")
    elif part == BATCH:
      raise ShardingError(
          f"parallel.sharding_rules: {text!r} names the 'batch' axis, which "
          "holds the data; split parameters over it with "
          'parallel.strategy=fsdp')
    else:
      raise ShardingError(f'parallel.sharding_rules: unknown mesh axis '
                          f'{part!r} in {text!r}; expected {AXES} or None')
  return P(*axes)


def parse_rules(text: str) -> tuple[tuple[str, str], ...]:
  """``'REGEX=SPEC;REGEX=SPEC'`` -> rules (config rules, tried first)."""
  rules = []
  for item in (text or '').split(';'):
    if not item.strip():
      continue
    pattern, sep, spec = item.rpartition('=')
    if not sep:
      raise ShardingError(f'parallel.sharding_rules: malformed entry {item!r}; '
                          "expected 'REGEX=SPEC', e.g. '.*/head/w=None,model'")
    try:
      re.compile(pattern)
    except re.error as e:
      raise ShardingError(f'parallel.sharding_rules: bad regex {pattern!r} '
                          f'({e})') from None
    parse_spec(spec)
    rules.append((pattern.strip(), spec))
  return tuple(rules)


def rules(parallel_config) -> tuple[tuple[str, str], ...]:
  """The config's rules, tried first, then the built-in ones."""
  return parse_rules(parallel_config.sharding_rules) + DEFAULT_RULES


def param_name(path) -> str:
  """'module/path/param' of a leaf's key path in a params tree."""
  return '/'.join(str(getattr(k, 'key', k)) for k in path)


def param_specs(params, rules: Sequence[tuple[str, str]], mesh: Mesh):
  """A PartitionSpec per parameter (same tree as `params`)."""

  def spec_for(path, value):
    name = param_name(path)
    for pattern, spec_text in rules:
      if re.fullmatch(pattern, name):
        spec = parse_spec(spec_text)
        for dim, axis in enumerate(spec):
          if axis is None:
            continue
          size = mesh.shape[axis]
          if dim >= len(value.shape) or value.shape[dim] % size:
            raise ShardingError(
                f'parallel.sharding_rules: {name} of shape {value.shape} '
                f'cannot be split {size} ways on dimension {dim} ({spec_text})')
        return spec
    return P()

  return jax.tree_util.tree_map_with_path(spec_for, params)


def fsdp_specs(params, specs, mesh: Mesh) -> tuple[Any, Any]:
  """`specs` with each parameter also split over the `batch` axis (FSDP): on
  its largest dimension that the axis divides and no rule splits already.
  Returns (specs, dims): dims a tree of the dimension chosen, or None for a
  parameter that no dimension fits, which stays replicated over `batch`."""
  size = mesh.shape[BATCH]

  def split(value, spec):
    entries = list(spec) + [None] * (len(value.shape) - len(spec))
    fits = [d for d, n in enumerate(value.shape)
            if entries[d] is None and n % size == 0 and size > 1]
    if not fits:
      return spec, None
    dim = max(fits, key=lambda d: value.shape[d])  # The first of the largest.
    entries[dim] = BATCH
    return P(*entries), dim

  is_spec = lambda x: isinstance(x, P)
  pairs = jax.tree.map(split, params, specs, is_leaf=is_spec)
  is_pair = lambda x: isinstance(x, tuple) and not isinstance(x, P)
  return (jax.tree.map(lambda pair: pair[0], pairs, is_leaf=is_pair),
          jax.tree.map(lambda pair: pair[1], pairs, is_leaf=is_pair))


def batch_part(spec: P) -> P:
  """The `batch` entries of `spec` alone: what a `shard_map` over `batch`
  (its `model` axis left to the compiler) takes as a parameter's spec."""
  return P(*(a if a == BATCH else None for a in spec))


def bytes_per_device(abstract, shardings) -> tuple[int, int]:
  """(bytes one device holds, bytes of the whole) of a tree of
  ShapeDtypeStructs laid out by `shardings` (NamedShardings, same tree)."""
  held = whole = 0
  for value, named in zip(jax.tree.leaves(abstract),
                          jax.tree.leaves(shardings)):
    size = nbytes(value)
    axes = [a for entry in named.spec if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)]
    held += size // math.prod(named.mesh.shape[a] for a in axes)
    whole += size
  return held, whole


def nbytes(value) -> int:
  """Bytes of an array or ShapeDtypeStruct; a PRNG key counts its data."""
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    return jax.eval_shape(jax.random.key_data, value).size * 4
  return value.size * value.dtype.itemsize


def state_shardings(state, params_spec, trained_spec,
                    optimizer: optax.GradientTransformation, mesh: Mesh):
  """NamedShardings of a TrainState: params by rule (`params_spec`),
  optimizer state alike (`trained_spec`: the specs of the params the
  optimizer holds). A param-shaped state leaf of another shape (an 8-bit
  moment's block scales) takes its param's spec on each dimension that spec
  splits evenly, and is whole along the others (it is small)."""
  named = lambda spec: NamedSharding(mesh, spec)
  is_spec = lambda x: isinstance(x, P)
  replicated = named(P())
  param_shardings = jax.tree.map(named, params_spec, is_leaf=is_spec)

  def like_its_param(leaf, sharding):
    if _splits(sharding.spec, leaf.shape, mesh):
      return sharding
    if len(sharding.spec) > len(leaf.shape):
      return replicated
    # Split where the param's split fits (a row's block scales take the
    # rows' split), whole along the rest.
    kept = [axes if _splits(P(axes), (dim,), mesh) else None
            for dim, axes in zip(leaf.shape, sharding.spec)]
    return named(P(*kept)) if any(kept) else replicated

  opt_shardings = optax.tree_map_params(
      optimizer, like_its_param, state.opt_state,
      jax.tree.map(named, trained_spec, is_leaf=is_spec),
      transform_non_params=lambda _: replicated)
  return state._replace(
      step=replicated, params=param_shardings, opt_state=opt_shardings,
      loss_scale=replicated,  # One sharding for the whole loss-scale state.
      rng=replicated, skipped_steps=replicated)


def _splits(spec: P, shape: tuple[int, ...], mesh: Mesh) -> bool:
  """Whether `spec` names dimensions `shape` has, each a multiple of its
  mesh axes' size."""
  if len(spec) > len(shape):
    return False
  for dim, axes in zip(shape, spec):
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    if dim % math.prod(mesh.shape[a] for a in axes):
      return False
  return True


def with_shardings(abstract, shardings):
  """`abstract` (ShapeDtypeStructs) with shardings from a tree or prefix of them."""
  return jax.tree.map(
      lambda s, sub: jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), sub),
      shardings, abstract)


def describe(sharding: NamedSharding) -> str:
  """A short text for tables: ``PartitionSpec(None, 'model')`` -> ``None,model``."""
  spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
  return ','.join(str(a) for a in spec) or 'replicated'


def parse_layout(text: str) -> tuple[str, tuple[int, int]]:
  """'STRATEGY:BATCHxMODEL' (e.g. 'pjit:4x2') -> ('pjit', (4, 2))."""
  strategy, sep, shape = text.partition(':')
  try:
    batch, model = (int(x) for x in shape.split('x'))
  except ValueError:
    sep = ''
  if not sep or not strategy:
    raise ShardingError(f'bad layout {text!r}; expected STRATEGY:BATCHxMODEL, '
                        "e.g. 'pjit:4x2' or 'single:1x1'")
  return strategy, (batch, model)


def mesh_for(parallel_config,
             devices: Optional[Sequence[jax.Device]] = None) -> Optional[Mesh]:
  """The mesh `parallel.strategy` needs, of `devices` (all by default): None
  for 'single'."""
  if parallel_config.strategy == 'single':
    return None
  return make_mesh(parallel_config.mesh_shape, devices)
