"""A lowered module's values as a graph: one computation, its calls inlined,
one node per value a call of it computes, each with its operands and users.

`step_program` reads a step's matmuls from it and `gpu_traffic` its bytes
through memory. Views (a reshape, a bitcast) are resolved to the
array they relabel, sharding markers (custom calls that run nothing) to
their operand, a `call` to its computation's values; a loop stays one node,
its body listed (`Graph.loops`) to be read as a graph of its own.
"""

from typing import Any, Optional

from haiku_mp.lab.studies import hlo_text

# Ops that only relabel an array already in memory.
_VIEWS = frozenset(('reshape', 'bitcast', 'copy', 'get-tuple-element',
                    'optimization-barrier'))
# Custom calls that mark shardings and run nothing.
_NO_OP_TARGETS = frozenset(('Sharding', 'SPMDFullToShardShape',
                            'SPMDShardToFullShape', 'annotate_device_placement',
                            'MoveToHost', 'MoveToDevice', 'X64Combine',
                            'X64SplitLow', 'X64SplitHigh'))


class Node:
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
    self.kind = None  # What the traffic rule takes it for (`gpu_traffic`).
    self.op_name = hlo_text.op_name(rest)
    self.elements = None  # A tuple's members.


class Graph:
  """One computation of a lowered module, its calls inlined: the entry
  (its parameters arrays in memory), or a loop's body (its one parameter,
  the loop's state of `parameter_shape`, in memory too). Its loops are
  listed, not inlined: each body is a graph of its own."""

  def __init__(self, computations: dict[str, hlo_text.Computation],
               name: str, parameter_shape: Optional[str] = None):
    self.computations = computations
    self.nodes: list[Node] = []
    self.loops: list[tuple[Node, str, int]] = []  # (node, body, trips)
    self.exact = True
    arguments = (None if parameter_shape is None else
                 [self._new('parameter', parameter_shape)])
    self.roots = self._inline(name, arguments)

  @classmethod
  def of(cls, text: str) -> 'Graph':
    """The entry computation of a module's text."""
    computations = {c.name: c for c in hlo_text.computations(text)}
    entry = next(c for c in computations.values() if c.entry)
    return cls(computations, entry.name)

  def _new(self, *args, **kwargs) -> Node:
    node = Node(*args, **kwargs)
    self.nodes.append(node)
    return node

  def _inline(self, name: str, arguments: Optional[list]) -> Node:
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


def resolve(node: Node) -> Node:
  """The array a view relabels."""
  while node.opcode in _VIEWS and len(node.operands) == 1 and (
      node.opcode != 'get-tuple-element'):
    node = node.operands[0]
  return node


def resolved(program: Graph) -> list[Node]:
  """Every node with views resolved and its users listed."""
  for node in program.nodes:
    node.operands = [resolve(o) for o in node.operands]
  for node in program.nodes:
    if node.opcode in _VIEWS and node.opcode != 'get-tuple-element':
      continue
    for operand in {id(o): o for o in node.operands}.values():
      operand.users.append(node)
  return [n for n in program.nodes
          if not (n.opcode in _VIEWS and n.opcode != 'get-tuple-element')]
