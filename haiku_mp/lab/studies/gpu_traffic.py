"""The rule that stands in for XLA:GPU's fusion when a step's bytes through
memory and its kernels are read from its lowered program.

XLA:GPU fuses the program before it runs it, and its fusion decisions are
not in the lowered program, so the rest of the step (all but its GEMMs) is
read under this rule (`count`):

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
them, `haiku_mp.advisor.speed`); `count` counts the rest.
"""

import collections

from haiku_mp.lab.studies import lowered_graph

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
# Ops without memory reads of their own.
_SOURCES = frozenset(('constant', 'iota', 'partition-id', 'replica-id',
                      'after-all', 'rng-get-and-update-state'))


def kind(node: lowered_graph.Node) -> str:
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


def classify(nodes: list[lowered_graph.Node]) -> None:
  """Sets each node's `kind`."""
  for node in nodes:
    node.kind = kind(node)


# Elementwise ops a GEMM's epilogue may hold.
_EPILOGUE_OPS = frozenset(('add', 'subtract', 'multiply', 'divide', 'convert',
                           'maximum', 'minimum', 'negate'))


def _small(node: lowered_graph.Node, limit: float) -> bool:
  """Whether a value reads at most `limit` bytes from memory: a constant,
  or a broadcast (reshape, convert) of a small array."""
  while node.opcode in ('broadcast', 'reshape', 'convert', 'bitcast'):
    node = node.operands[0]
  return node.kind == 'source' or node.bytes <= limit


def epilogue(gemm: lowered_graph.Node) -> list[lowered_graph.Node]:
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


def count(nodes: list[lowered_graph.Node], roots: lowered_graph.Node,
          epilogues, totals, times: int) -> None:
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
      outputs.add(id(lowered_graph.resolve(node)))
  reads: dict[int, frozenset] = {}  # A fused value's arrays in memory.
  stored: set[int] = set()
  sizes = {id(n): n.bytes for n in nodes}

  def frontier(node: lowered_graph.Node) -> frozenset:
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
    part = 'reduction' if node.kind == 'reduction' else 'other'
    moved = sum(sizes[i] for i in reads[id(node)]) + node.bytes
    totals[part]['bytes'] += moved * times
    totals[part]['kernels'] += times
  for read, output_bytes in loops.items():
    totals['loop']['bytes'] += (sum(sizes[i] for i in read) +
                                output_bytes) * times
    totals['loop']['kernels'] += times


def _stored(node: lowered_graph.Node, is_output: bool,
            read_sizes: list[float]) -> bool:
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
