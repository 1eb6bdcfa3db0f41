"""What each module of a model really runs: its rule, its matmuls' form and
their share of the model's FLOPs, and whether haiku_mp ran them
(`describe`).

A module under a precision gets its policy's casts whatever it is; its
matmuls are haiku_mp's only where they go through haiku_mp's matmuls: a
`hk.Linear` (stock, a subclass calling its `__call__`, haiku_mp's), a patch
embedding's `hk.Conv2D`, Haiku's `MultiHeadAttention`, `Matmuls.einsum`.
Any other (a convolution of other shapes, a subclass that overrides
`__call__` with `jax.lax.conv_general_dilated`, a hand-written attention)
runs as JAX runs it under those casts: half x half -> half, and no low-bit
format reaches it. Intercepting `jax.lax` itself inside a policied module
would patch a global function every trace of every thread shares, so these
are named instead. The matmuls are read from the forward pass's jaxpr, by
the Haiku module scopes of its equations.
"""

import collections
import dataclasses
import functools
import math
from typing import Any, Iterator, Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.model import recording

_MATMUL_PRIMITIVES = ('dot_general', 'conv_general_dilated')
# Not haiku_mp's matmuls: why, as a row says it.
NOT_HAIKU_MP = ("not haiku_mp's: JAX's own matmul under the policy's casts "
                '(a convolution other than a patch embedding, a subclass '
                'that overrides __call__, a hand-written attention)')


@dataclasses.dataclass(frozen=True)
class Matmul:
  """One matmul of a traced function: the module scope it ran in, its
  FLOPs, and its operands' and result's dtypes."""
  scope: str
  flops: float
  operands: tuple[str, str]
  result: str

  @property
  def form(self) -> str:
    """'fp8', 'half x half -> float32', 'half x half -> half', 'float32'
    or 'integer'."""
    a, b = self.operands
    if a.startswith('float8') or b.startswith('float8'):
      return 'fp8'
    if not all(jnp.issubdtype(d, jnp.floating) for d in (a, b, self.result)):
      return 'integer'
    if all(jnp.finfo(d).bits < 32 for d in self.operands):
      if jnp.finfo(self.result).bits >= 32:
        return 'half x half -> float32'
      return 'half x half -> half'
    return 'float32'


@dataclasses.dataclass(frozen=True)
class ModuleMatmuls:
  """A module's own matmuls (not its children's), as `describe` lists it."""
  path: str
  class_name: str
  rule: str  # Its own policy, or 'inherited'.
  matmuls: int
  flops: float
  share: float  # Of every matmul FLOP of the forward pass.
  forms: tuple[str, ...]  # As the program has them (`Matmul.form`).
  haiku_mp: tuple[str, ...]  # The forms haiku_mp ran them in; () for none.

  @property
  def runs_haiku_mp(self) -> bool:
    return bool(self.haiku_mp)


def _subjaxprs(eqn) -> Iterator[tuple[Any, int]]:
  """The jaxprs an equation calls, with how often one call runs each."""
  for name, value in eqn.params.items():
    values = value if isinstance(value, (tuple, list)) else (value,)
    for v in values:
      jaxpr = getattr(v, 'jaxpr', v)
      if hasattr(jaxpr, 'eqns'):
        times = eqn.params.get('length', 1) if name == 'jaxpr' else 1
        yield jaxpr, int(times)


def _flops(eqn) -> float:
  lhs, rhs = (v.aval for v in eqn.invars[:2])
  if eqn.primitive.name == 'dot_general':
    (lc, rc), (lb, _) = eqn.params['dimension_numbers']
    batch = math.prod(lhs.shape[d] for d in lb)
    k = math.prod(lhs.shape[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs.shape) if d not in (*lb, *lc))
    n = math.prod(rhs.shape) // max(k * batch, 1)
    return 2.0 * batch * m * k * n
  out = eqn.outvars[0].aval
  rhs_spec = eqn.params['dimension_numbers'].rhs_spec
  per_output = math.prod(rhs.shape[d] for d in rhs_spec[1:])
  return 2.0 * math.prod(out.shape) * per_output


def matmuls_of(jaxpr, scope: str = '', times: int = 1) -> list[Matmul]:
  """Every matmul of a jaxpr, nested calls included (a loop's body as often
  as it runs), each with the name-stack scope it ran in."""
  found = []
  for eqn in jaxpr.eqns:
    here = '/'.join(p for p in (scope, str(eqn.source_info.name_stack)) if p)
    if eqn.primitive.name in _MATMUL_PRIMITIVES:
      found += [Matmul(here, _flops(eqn),
                       tuple(jnp.dtype(v.aval.dtype).name
                             for v in eqn.invars[:2]),
                       jnp.dtype(eqn.outvars[0].aval.dtype).name)] * times
    for sub, count in _subjaxprs(eqn):
      found += matmuls_of(sub, here, times * count)
  return found


# The forms `recording` names low-bit matmuls by.
LOW_BIT_FORMS = frozenset(('fp8', 'nvfp4', 'mxfp4'))


def scope_of(path: str) -> str:
  """A module path as its equations' name stack has it ('mlp/~/linear_0'
  -> 'mlp/linear_0')."""
  return '/'.join(p for p in path.split('/') if p != '~')


def stripped(scope: str) -> str:
  """'jvp(mlp)/linear_0/transpose(...)' -> 'mlp/linear_0/...'."""
  parts = []
  for part in scope.split('/'):
    while '(' in part and part.endswith(')'):
      part = part[part.index('(') + 1:-1]
    parts.append(part)
  return '/'.join(parts)


def module_scope(scope: str) -> str:
  """A matmul's scope without the named scopes of the op itself (an
  einsum's spec, an fp8 GEMM's pass): the module it ran in."""
  parts = stripped(scope).split('/')
  while parts and ('->' in parts[-1] or parts[-1].startswith('fp8_')):
    parts.pop()
  return '/'.join(parts)


def within(scope: str, scopes) -> bool:
  """Whether a matmul's `scope` (`Matmul.scope`) is one of `scopes`
  (`scope_of`'s) or inside one."""
  scope = stripped(scope)
  return any(scope == s or scope.startswith(s + '/') for s in scopes)


def low_bit_reach(matmuls: Sequence[Matmul], record: recording.Record
                  ) -> tuple[float, list[tuple[str, float]]]:
  """The share of `matmuls`' FLOPs in modules that `record` saw haiku_mp
  run low-bit, and each other module scope's share, largest first."""
  low_bit = {scope_of(path) for path, forms in record.matmuls.items()
             if forms & LOW_BIT_FORMS}
  total = sum(m.flops for m in matmuls) or 1.0
  reached, rest = 0.0, collections.Counter()
  for m in matmuls:
    if within(m.scope, low_bit):
      reached += m.flops
    else:
      rest[module_scope(m.scope)] += m.flops
  return reached / total, [(scope, flops / total)
                           for scope, flops in rest.most_common()]


def owner(matmul: Matmul, paths: Sequence[str]) -> Optional[str]:
  """The innermost module of `paths` whose scope `matmul` ran in."""
  inside = [p for p in paths if within(matmul.scope, (scope_of(p),))]
  return max(inside, key=lambda p: len(scope_of(p)), default=None)


def _inputs_split(inputs):
  """The arrays among `inputs` (traced) and the rest (kept as they are)."""
  arrays = [isinstance(x, (jax.Array, np.ndarray)) for x in inputs]
  return arrays, [x for x, a in zip(inputs, arrays) if a]


def describe(forward: Any, *inputs, rng: Optional[jax.Array] = None,
             init_shapes: Any = None) -> list[ModuleMatmuls]:
  """Every module that runs a matmul in `forward` (`hk.transform`'s or
  `hk.transform_with_state`'s) called on `inputs`: its rule under the
  precision the forward applies, its matmuls' count, FLOPs, share and
  forms, and the forms haiku_mp ran them in (none: `NOT_HAIKU_MP`).
  Traced abstractly: no FLOPs run, no params are made. `init_shapes`: what
  `forward.init` returns for these inputs (or its `jax.eval_shape`), where
  the caller already has it; the init is then not traced a second time.

  Example:
    for row in haiku_mp.describe(hk.transform(forward), images):
      print(row.path, row.rule, row.forms, f'{row.share:.0%}', row.haiku_mp)
  """
  rng = jax.random.key(0) if rng is None else rng
  is_array, arrays = _inputs_split(inputs)

  def call(fn, *args):
    it = iter(args)
    return fn(*[next(it) if a else x for x, a in zip(inputs, is_array)])

  stateful = isinstance(forward, hk.TransformedWithState)
  init = init_shapes
  if init is None:
    init = jax.eval_shape(lambda r, *a: call(
        functools.partial(forward.init, r), *a), rng, *arrays)
  params, state = init if stateful else (init, None)
  classes = {}

  def note(next_f, args, kwargs, context: hk.MethodContext):
    if context.method_name != '__init__':  # No name before its init.
      classes.setdefault(context.module.module_name,
                         type(context.module).__name__)
    return next_f(*args, **kwargs)

  def apply(params, state, rng, *args):
    with hk.intercept_methods(note):
      if stateful:
        return call(functools.partial(forward.apply, params, state, rng),
                    *args)
      return call(functools.partial(forward.apply, params, rng), *args)

  with recording.recording() as record:
    jaxpr = jax.make_jaxpr(apply)(params, state, rng, *arrays)
  precision = record.precisions[0] if record.precisions else None
  found = matmuls_of(jaxpr.jaxpr)
  total = sum(m.flops for m in found) or 1.0
  by_module: dict[str, list[Matmul]] = {}
  for m in found:
    by_module.setdefault(owner(m, list(classes)) or '', []).append(m)
  rows = []
  for path in [*classes, '']:
    if path not in by_module:
      continue
    mine = by_module[path]
    class_name = classes.get(path, '(outside any module)')
    rule = precision and precision.rule_for(class_name, path)
    flops = sum(m.flops for m in mine)
    rows.append(ModuleMatmuls(
        path=path or '(outside any module)', class_name=class_name,
        rule=_policy_text(rule.policy) if rule else 'inherited',
        matmuls=len(mine), flops=flops, share=flops / total,
        forms=tuple(sorted({m.form for m in mine})),
        haiku_mp=tuple(sorted(record.matmuls.get(path, ())))))
  return rows


def _policy_text(policy) -> str:
  names = [jnp.dtype(d).name for d in (policy.param_dtype,
                                        policy.compute_dtype,
                                        policy.output_dtype)]
  short = {'float32': 'f32', 'bfloat16': 'bf16', 'float16': 'f16'}
  return 'p={},c={},o={}'.format(*(short.get(n, n) for n in names))


def table(rows: Sequence[ModuleMatmuls]) -> str:
  """`describe`'s rows as text: one line per module."""
  columns = ('module', 'class', 'rule', 'matmuls', 'FLOPs', 'forms',
             'haiku_mp ran them')
  lines = [[r.path, r.class_name, r.rule, str(r.matmuls), f'{r.share:.1%}',
            ', '.join(r.forms),
            ', '.join(r.haiku_mp) if r.haiku_mp else NOT_HAIKU_MP]
           for r in rows]
  widths = [max(len(c), *(len(l[i]) for l in lines)) for i, c in
            enumerate(columns)]
  fmt = lambda cells: '  '.join(c.ljust(w) for c, w in zip(cells, widths))
  return '\n'.join([fmt(columns).rstrip(), *(fmt(l).rstrip() for l in lines)])
