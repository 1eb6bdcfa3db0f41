"""What a train step asks of a GPU, read from its program as JAX lowers it for
CUDA (`step_time.lower_for_gpu`: no GPU and no compilation needed): every matmul, with
its shapes, dtypes, module and pass, and for everything else the bytes that
go through memory and the kernels that move them.

XLA:GPU fuses the program before it runs it, and its fusion decisions are
not in the lowered program, so the rest of the step is read under a rule
that stands in for them (`traffic`):

- a matmul (`dot`, `convolution`), a custom call, a collective, a loop and
  a sort each run as kernels of their own, their operands read from memory
  and their results written to it;
- a reduction is a kernel of its own too, with the elementwise work that
  produces its input fused into it (XLA's input fusion);
- every other op (elementwise, broadcast, reshape, transpose, slice,
  concatenate, convert, select, ...) fuses: its result goes to memory only
  where a matmul (or a custom call, a collective, a loop) takes it, where
  the program returns it, or where two or more kernels use it (XLA
  recomputes cheap ops in each consumer; this rule writes a value used
  twice once and reads it twice, which is what XLA does with a value worth
  keeping); each such result is one kernel;
- a kernel reads each value in memory that it depends on through fused ops
  once (a broadcast scalar costs its one element);
- reshapes, bitcasts and the like are free where they only relabel what is
  in memory;
- a GEMM writes its result after its epilogue: the chain of elementwise ops
  its result alone flows through, each adding no more than a small operand
  (a bias, a scale) and ending in a cast (XLA folds a bias, the fp8 scales
  and the cast into the GEMM), so a GEMM with float32 sums and a bfloat16
  result writes bfloat16.

Each GEMM's own reads and writes are the GEMM's (the speed model times
them, `haiku_mp.advisor.speed`); `traffic` counts the rest.
"""

import collections
import dataclasses
import math
from typing import Any, Iterable, Optional

from haiku_mp.lab.studies import fp8_gemms
from haiku_mp.lab.studies import hlo_text

MATMUL_OPCODES = ('dot', 'convolution')
# Kernels of their own whose operands come from memory.
_UNFUSED = frozenset(('dot', 'convolution', 'custom-call', 'while',
                      'conditional', 'sort', 'all-reduce', 'all-gather',
                      'reduce-scatter', 'all-to-all', 'collective-permute',
                      'all-reduce-start', 'all-gather-start',
                      'collective-permute-start', 'rng-bit-generator',
                      'fft', 'triangular-solve', 'cholesky', 'infeed',
                      'outfeed', 'send', 'recv'))
# Kernels of their own that fuse the elementwise work producing their input.
_REDUCTIONS = frozenset(('reduce', 'reduce-window', 'select-and-scatter',
                         'scatter'))
# Ops that only relabel an array already in memory.
_VIEWS = frozenset(('reshape', 'bitcast', 'copy', 'get-tuple-element',
                    'optimization-barrier'))
# Custom calls that mark shardings and run nothing.
_NO_OP_TARGETS = frozenset(('Sharding', 'SPMDFullToShardShape',
                            'SPMDShardToFullShape', 'annotate_device_placement',
                            'MoveToHost', 'MoveToDevice', 'X64Combine',
                            'X64SplitLow', 'X64SplitHigh'))
# Ops without memory reads of their own.
_SOURCES = frozenset(('constant', 'iota', 'partition-id', 'replica-id',
                      'after-all', 'rng-get-and-update-state'))

@dataclasses.dataclass(frozen=True)
class Matmul:
  """One matmul of the program, as `batch` x (M x K @ K x N)."""
  op_name: str
  batch: int
  m: int
  k: int
  n: int
  lhs: str  # HLO element types: 'bf16', 'f32', 'f8e4m3fn', ...
  rhs: str
  out: str
  highest: bool  # float32 at full precision (no tensor cores).
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]

  @property
  def flops(self) -> float:
    return 2.0 * self.batch * self.m * self.k * self.n


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Everything but the matmuls: bytes through memory and kernels."""
  bytes: float
  kernels: int
  # Bytes and kernels per kind: 'loop' (fused elementwise work),
  # 'reduction', 'other' (custom calls, collectives, loops, sorts).
  by_kind: dict[str, dict[str, float]]
  exact: bool  # False where a loop's trip count could not be read (1 used).


class _Node:
  """An array of the program, its calls inlined (one node per executed
  value)."""
  __slots__ = ('opcode', 'bytes', 'operands', 'operand_types', 'users',
               'rest', 'shape', 'dtype', 'dims', 'kind', 'op_name',
               'elements')

  def __init__(self, opcode, shape_text, operands=(), rest=''):
    self.opcode = opcode
    self.shape = shape_text
    arrays = hlo_text.arrays(shape_text)
    self.bytes = sum(b for _, b in arrays)
    self.dtype, self.dims = hlo_text.array_type(shape_text)
    self.operands = list(operands)
    # (element type, dimensions) of each operand as the op takes it, before
    # views are resolved.
    self.operand_types = [(o.dtype, o.dims) for o in operands]
    self.users = []
    self.rest = rest
    self.kind = None  # Set by `_classify`.
    self.op_name = hlo_text.op_name(rest)
    self.elements = None  # A tuple's members.


class _Program:
  """One computation of a lowered module, its calls inlined: the entry
  (its parameters arrays in memory), or a loop's body (its one parameter,
  the loop's state of `parameter_shape`, in memory too)."""

  def __init__(self, computations: dict[str, hlo_text.Computation],
               name: str, parameter_shape: Optional[str] = None):
    self.computations = computations
    self.nodes: list[_Node] = []
    self.loops: list[tuple[_Node, str, int]] = []  # (node, body, trips)
    self.exact = True
    arguments = (None if parameter_shape is None else
                 [self._new('parameter', parameter_shape)])
    self.roots = self._inline(name, arguments)

  @classmethod
  def of(cls, text: str) -> '_Program':
    """The entry computation of a module's text."""
    computations = {c.name: c for c in hlo_text.computations(text)}
    entry = next(c for c in computations.values() if c.entry)
    return cls(computations, entry.name)

  def _new(self, *args, **kwargs) -> _Node:
    node = _Node(*args, **kwargs)
    self.nodes.append(node)
    return node

  def _inline(self, name: str, arguments: Optional[list]) -> _Node:
    """The root of computation `name` with its parameters bound to
    `arguments` (None: the entry's parameters are arrays in memory)."""
    values: dict[str, Any] = {}
    root = None
    for line in self.computations[name].lines:
      op = hlo_text.instruction(line)
      if op is None:
        continue
      operands = [values[o] for o in hlo_text.operands(op.rest)
                  if o in values]
      values[op.name] = node = self._instruction(op, operands, arguments)
      if line.lstrip().startswith('ROOT'):
        root = node
    return root

  def _instruction(self, op: hlo_text.Instruction, operands: list,
                   arguments: Optional[list]):
    opcode = op.opcode
    if opcode == 'parameter':
      index = hlo_text.parameter_number(op.rest)
      if arguments is not None:
        return arguments[index]
      return self._new('parameter', op.shape)
    if opcode == 'tuple':
      node = self._new('tuple', '()', operands)
      node.elements = operands
      return node
    if opcode == 'get-tuple-element':
      source = operands[0]
      index = hlo_text.tuple_index(op.rest)
      if source.elements is not None:
        return source.elements[index]
      return self._new('get-tuple-element', op.shape, [source], op.rest)
    if opcode == 'optimization-barrier':
      return operands[0]
    if opcode == 'call':
      return self._inline(hlo_text.called(op.rest, 'to_apply'), operands)
    if opcode == 'custom-call':
      if (hlo_text.custom_call_target(op.rest) in _NO_OP_TARGETS
          and operands):
        return operands[0]
    node = self._new(opcode, op.shape, operands, op.rest)
    if opcode == 'while':
      trips = hlo_text.known_trip_count(op.rest)
      if trips is None:
        self.exact = False
      self.loops.append((node, hlo_text.called(op.rest, 'body'),
                         1 if trips is None else trips))
    return node


def _resolve(node: _Node) -> _Node:
  """The array a view relabels."""
  while node.opcode in _VIEWS and len(node.operands) == 1 and (
      node.opcode != 'get-tuple-element'):
    node = node.operands[0]
  return node


def _kind(node: _Node) -> str:
  """'memory' (an array of the program's inputs), 'kernel' (its own
  kernel), 'reduction', 'source' or 'fused'."""
  if node.opcode in ('parameter', 'get-tuple-element'):
    return 'memory'
  if node.opcode in _UNFUSED:
    return 'kernel'
  if node.opcode in _REDUCTIONS:
    return 'reduction'
  if node.opcode in _SOURCES:
    return 'source'
  return 'fused'


def _graph(program: _Program) -> list[_Node]:
  """Every node with views resolved and its users listed."""
  for node in program.nodes:
    node.operands = [_resolve(o) for o in node.operands]
    node.kind = _kind(node)
  for node in program.nodes:
    if node.opcode in _VIEWS and node.opcode != 'get-tuple-element':
      continue
    for operand in {id(o): o for o in node.operands}.values():
      operand.users.append(node)
  return [n for n in program.nodes
          if not (n.opcode in _VIEWS and n.opcode != 'get-tuple-element')]


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """A lowered program's matmuls (each as often as one call runs it) and
  the traffic of everything else."""
  matmuls: list[Matmul]
  traffic: Traffic


def read(text: str) -> StepProgram:
  """The matmuls and the traffic of a lowered module's text."""
  found: list[Matmul] = []
  totals = collections.defaultdict(lambda: {'bytes': 0.0, 'kernels': 0})
  exact = _measure(_Program.of(text), 1, found, totals)
  return StepProgram(found, Traffic(
      bytes=sum(t['bytes'] for t in totals.values()),
      kernels=sum(t['kernels'] for t in totals.values()),
      by_kind={k: dict(v) for k, v in totals.items()}, exact=exact))


def _measure(program: _Program, times: int, found: list[Matmul],
             totals) -> bool:
  """Adds `program`'s matmuls to `found` and its traffic to `totals`, each
  `times` over, and its loops' bodies as often as they run; whether every
  loop's trip count was read."""
  nodes = _graph(program)
  epilogues = {id(n): _epilogue(n) for n in nodes
               if n.opcode in MATMUL_OPCODES}
  found += [_matmul(n, epilogues[id(n)][-1]) for n in nodes
            if n.opcode in MATMUL_OPCODES] * times
  _count(nodes, program.roots, epilogues, totals, times)
  exact = program.exact
  for loop, body, trips in program.loops:
    exact &= _measure(_Program(program.computations, body, loop.shape),
                      times * trips, found, totals)
  return exact


# Elementwise ops a GEMM's epilogue may hold.
_EPILOGUE_OPS = frozenset(('add', 'subtract', 'multiply', 'divide', 'convert',
                           'maximum', 'minimum', 'negate'))


def _small(node: _Node, limit: float) -> bool:
  """Whether a value reads at most `limit` bytes from memory: a constant,
  or a broadcast (reshape, convert) of a small array."""
  while node.opcode in ('broadcast', 'reshape', 'convert', 'bitcast'):
    node = node.operands[0]
  return node.kind == 'source' or node.bytes <= limit


def _epilogue(gemm: _Node) -> list[_Node]:
  """The GEMM and the ops of its epilogue (module docstring), the one it
  writes last; just the GEMM where the chain ends in no cast."""
  chain, node = [gemm], gemm
  while True:
    users = [u for u in node.users if u.opcode != 'tuple']
    if len(users) != 1 or len(node.users) != 1:
      break
    user = users[0]
    if user.opcode not in _EPILOGUE_OPS or user.kind != 'fused':
      break
    others = [o for o in user.operands if o is not node]
    if not all(_small(o, node.bytes / 8) for o in others):
      break
    chain.append(user)
    node = user
  while len(chain) > 1 and chain[-1].opcode != 'convert':
    chain.pop()
  return chain


def _matmul(node: _Node, written: _Node) -> Matmul:
  """`node`'s shapes as a GEMM, writing `written` (its epilogue's end)."""
  (lhs_type, lhs), (rhs_type, rhs) = node.operand_types[:2]
  if node.opcode == 'dot':
    dims = hlo_text.dot_dimensions(node.rest)
    lb = dims.get('lhs_batch_dims', [])
    lc = dims.get('lhs_contracting_dims', [])
    rb = dims.get('rhs_batch_dims', [])
    rc = dims.get('rhs_contracting_dims', [])
    batch = math.prod(lhs[d] for d in lb)
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs) if d not in lb + lc)
    n = math.prod(s for d, s in enumerate(rhs) if d not in rb + rc)
  else:  # A convolution as the GEMM its im2col form runs.
    _, kernel_labels, out_labels = hlo_text.dim_labels(node.rest)
    groups = hlo_text.feature_group_count(node.rest)
    out_features = node.dims[out_labels.index('f')] if 'f' in out_labels else 1
    n = rhs[kernel_labels.index('o')] if 'o' in kernel_labels else 1
    k = math.prod(rhs) // max(n, 1)
    m = math.prod(node.dims) // max(out_features, 1)
    batch = groups
    n //= groups
  return Matmul(node.op_name, batch, m, k, n, lhs_type, rhs_type,
                written.dtype, hlo_text.highest_precision(node.rest),
                tuple(lhs), tuple(rhs), tuple(node.dims))


def _count(nodes: list[_Node], roots: _Node, epilogues, totals,
           times: int) -> None:
  """Adds `nodes`' kernels and bytes (`times` each) to `totals`; a GEMM's
  epilogue (`epilogues`: by the GEMM's id) is the GEMM's, its last value
  the one in memory."""
  in_gemm = {id(n) for chain in epilogues.values() for n in chain[:-1]}
  written = {id(chain[-1]) for chain in epilogues.values()}
  outputs = set()
  pending = [roots]
  while pending:
    node = pending.pop()
    if node.elements is not None:
      pending.extend(node.elements)
    else:
      outputs.add(id(_resolve(node)))
  reads: dict[int, frozenset] = {}  # A fused value's arrays in memory.
  stored: set[int] = set()
  sizes = {id(n): n.bytes for n in nodes}

  def frontier(node: _Node) -> frozenset:
    if id(node) in stored or node.kind == 'memory':
      return frozenset((id(node),))
    return reads.get(id(node), frozenset())

  for node in nodes:  # Program order: every operand before its users.
    found = frozenset()
    for operand in node.operands:
      found |= frontier(operand)
    reads[id(node)] = found
    if id(node) in in_gemm:
      continue
    if id(node) in written or node.kind in ('kernel', 'reduction') or (
        node.kind == 'fused' and _stored(node, id(node) in outputs,
                                         [sizes[i] for i in found])):
      stored.add(id(node))
  # Kernels: each unfused op and reduction (the GEMMs are the speed
  # model's); stored fused values that read the same arrays, one kernel
  # with several outputs (XLA's multi-output fusion).
  loops = collections.defaultdict(float)
  for node in nodes:
    if id(node) not in stored or id(node) in written:
      continue
    if node.kind == 'fused':
      loops[reads[id(node)]] += node.bytes
      continue
    kind = 'reduction' if node.kind == 'reduction' else 'other'
    moved = sum(sizes[i] for i in reads[id(node)]) + node.bytes
    totals[kind]['bytes'] += moved * times
    totals[kind]['kernels'] += times
  for read, output_bytes in loops.items():
    totals['loop']['bytes'] += (sum(sizes[i] for i in read) +
                                output_bytes) * times
    totals['loop']['kernels'] += times


def _stored(node: _Node, is_output: bool, read_sizes: list[float]) -> bool:
  """Whether a fused value goes to memory (module docstring): the program
  returns it, an unfused kernel takes it, or two or more ops use it and
  recomputing it would read two or more arrays at least half its size."""
  if node.opcode in ('tuple', 'broadcast'):
    return is_output
  if is_output:
    return True
  users = [u for u in node.users if u.opcode != 'tuple']
  if any(u.kind == 'kernel' for u in users):
    return True
  large = sum(1 for size in read_sizes if size >= node.bytes / 2)
  return len(users) > 1 and large >= 2


def module_of(matmul: Matmul, module_paths: Iterable[str]) -> tuple[str, str]:
  """(module, 'forward' / 'backward' or an fp8 Linear's pass) of a matmul,
  from its op name's scopes."""
  return fp8_gemms.locate(matmul.op_name, list(module_paths))
