"""A program's collectives, read from its HLO text, and the bytes each
device sends for them.

`parse_collectives` lists every collective (all-gather, reduce-scatter,
all-reduce, all-to-all, collective-permute) of a module's text, with its
dtype, bytes and replica groups per device; `summarize` sums them into one
row per kind, dtype and group size. `partitioned_step` reads them from a
compiled step, and `wire_time` turns the rows into seconds on paper.

Each collective counts as often as one call of the program runs it: once,
or the trip counts of the loops around it (a scan over layers gathers each
layer's weights in one op of the loop's body). A loop whose trip count the
text does not give (a `while_loop` on data) counts once, and the row says
it is a lower bound (`exact`). Both branches of a conditional count.

The bytes sent (`wire_bytes`) assume ring (bandwidth-optimal) algorithms:
each device sends (g-1)/g of an all-gather's output or a reduce-scatter's
input, twice that for an all-reduce.
"""

from typing import Any, NamedTuple, Sequence

from haiku_mp.lab.studies import hlo_text

KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all',
         'collective-permute')


class Collective(NamedTuple):
  """One collective of a program, per device."""
  kind: str  # One of KINDS.
  dtype: str  # NumPy's name: 'bfloat16', 'float8_e4m3fn', ...
  bytes: float  # Of its result (a tuple's summed), per call.
  group_size: int  # Devices in each of its replica groups.
  name: str  # The op's name in the program.
  # Times one call of the program runs it: the trip counts of the loops
  # around it, multiplied.
  calls: int = 1
  # False where a loop around it has a trip count that could not be read:
  # `calls` then counts that loop once, a lower bound.
  exact: bool = True

  @property
  def input_bytes(self) -> float:
    """Bytes each device puts in: an all-gather's shard, a reduce-scatter's
    whole."""
    if self.kind == 'all-gather':
      return self.bytes / self.group_size
    if self.kind == 'reduce-scatter':
      return self.bytes * self.group_size
    return self.bytes


def _start_outputs(kind: str, arrays: list[tuple[str, float]]
                   ) -> list[tuple[str, float]]:
  """The results among an async start's arrays, where no `-done` names
  it: an all-gather's or a collective-permute's start holds (operands,
  results[, u32[] contexts]); an all-reduce's, its results alone."""
  if kind in ('all-gather', 'collective-permute'):
    while len(arrays) > 2 and arrays[-1][1] == 4 and arrays[-1][0] in (
        'uint32', 'int32'):
      arrays = arrays[:-1]  # Scalar contexts of a permute.
    if len(arrays) > 1:
      return arrays[len(arrays) // 2:]
  return arrays


def _calls_per_computation(text: str
                           ) -> tuple[dict[str, int], dict[str, bool]]:
  """How many times one call of the module runs each computation, and
  whether that count is exact: a while body runs its loop's trip count,
  read from XLA's `known_trip_count` where the program has it (the final
  program does) or else from the loop's condition when that compares a
  counter to one integer constant (`i < N`, as jax's scan and fori_loop
  write it, counting from 0). Every other call (call, fusion, a branch
  of a conditional, an async start) runs its computation once."""
  computations: dict[str, list[str]] = {}
  entry = None
  for computation in hlo_text.computations(text):
    computations[computation.name] = computation.lines
    if computation.entry:
      entry = computation.name

  def trip_count(op: hlo_text.Instruction) -> int | None:
    known = hlo_text.known_trip_count(op.rest)
    if known is not None:
      return known
    condition = hlo_text.called(op.rest, 'condition')
    body = [o for o in map(hlo_text.instruction,
                           computations.get(condition, [])) if o]
    bounds = {n for o in body
              if (n := hlo_text.integer_constant(o)) is not None}
    compares = [o for o in body if o.opcode == 'compare' and
                hlo_text.direction(o.rest) == 'LT']
    if len(bounds) == 1 and len(compares) == 1:
      return bounds.pop()
    return None

  # (callee, caller, factor, exact) for every call site.
  sites = []
  for caller, lines in computations.items():
    for line in lines:
      op = hlo_text.instruction(line)
      if not op or op.opcode in ('async-done', 'async-update'):
        continue  # An async pair calls its computation once, at its start.
      for attribute, callee in hlo_text.called_computations(op.rest):
        if attribute != 'body':
          sites.append((callee, caller, 1, True))
        elif op.opcode == 'while':
          n = trip_count(op)
          sites.append((callee, caller, 1 if n is None else n,
                        n is not None))

  calls: dict[str, int] = {}
  exact: dict[str, bool] = {}

  def visit(name: str, seen: tuple[str, ...] = ()) -> None:
    if name in calls:
      return
    callers = [s for s in sites if s[0] == name and s[1] not in seen]
    if name == entry or not callers or entry is None:
      calls[name], exact[name] = 1, True
      return
    total, known = 0, True
    for _, caller, factor, site_exact in callers:
      visit(caller, seen + (name,))
      total += calls[caller] * factor
      known = known and site_exact and exact[caller]
    calls[name], exact[name] = total, known

  for name in computations:
    visit(name)
  return calls, exact


def parse_collectives(text: str) -> list[Collective]:
  """Every collective of an HLO module's text, once each: an async pair by
  its `-start`, its bytes by its `-done` (the result; a start's shape may
  also hold its operands). A tuple-shaped one counts as one, of the dtype
  of its first array, its bytes summed. `calls` multiplies in the trip
  counts of the loops around it: the text lists a loop's body once."""
  devices = hlo_text.module_devices(text)
  calls, exact = _calls_per_computation(text)
  done_shapes = {}
  for line in text.splitlines():
    op = hlo_text.instruction(line)
    if op and op.opcode.endswith('-done'):
      operands = hlo_text.operands(op.rest)
      if operands:
        done_shapes[operands[0]] = op.shape
  found = []
  for computation in hlo_text.computations(text):
    for line in computation.lines:
      op = hlo_text.instruction(line)
      if op:
        found.extend(_collective(op, devices, done_shapes,
                                 calls.get(computation.name, 1),
                                 exact.get(computation.name, True)))
  return found


def _collective(op: hlo_text.Instruction, devices: int,
                done_shapes: dict[str, str], calls: int, exact: bool
                ) -> list[Collective]:
  """The collective an instruction is, as a list of one, or none."""
  name, shape, opcode = op.name, op.shape, op.opcode
  kind = opcode.removesuffix('-start')
  if kind not in KINDS:
    return []
  if opcode != kind:
    arrays = (hlo_text.arrays(done_shapes[name]) if name in done_shapes
              else _start_outputs(kind, hlo_text.arrays(shape)))
  else:
    arrays = hlo_text.arrays(shape)
  if not arrays:
    return []
  return [Collective(kind, arrays[0][0], sum(b for _, b in arrays),
                     hlo_text.group_size(op.rest, devices), name, calls,
                     exact)]


def wire_bytes(c: Collective) -> float:
  """Bytes each device sends for one call of `c` under a ring
  (bandwidth-optimal) algorithm: (g-1)/g of an all-gather's result, of a
  reduce-scatter's input and of an all-to-all's buffer, twice that of an
  all-reduce's (a reduce-scatter, then an all-gather), a permute's whole
  buffer to its peer."""
  g = c.group_size
  if g <= 1:
    return 0.0
  share = (g - 1) / g
  if c.kind == 'all-gather':
    return share * c.bytes
  if c.kind == 'reduce-scatter':
    return share * c.input_bytes
  if c.kind == 'all-reduce':
    return 2 * share * c.bytes
  if c.kind == 'all-to-all':
    return share * c.bytes
  return c.bytes  # collective-permute: the whole to its peer.


def summarize(found: Sequence[Collective]) -> list[dict[str, Any]]:
  """One row per (kind, dtype, group size): count, bytes and wire bytes
  per device per call of the program, each collective as many times as it
  runs (`calls`). Bytes are a reduce-scatter's input (what it reduces),
  every other kind's result. `exact` is False where a loop's trip count
  could not be read: the row is then a lower bound."""
  rows: dict[tuple[str, str, int], dict[str, Any]] = {}
  for c in found:
    if c.group_size <= 1:
      continue  # Groups of one device (a partitioner's no-op) move nothing.
    key = (c.kind, c.dtype, c.group_size)
    row = rows.setdefault(key, dict(kind=c.kind, dtype=c.dtype,
                                    group_size=c.group_size, count=0,
                                    bytes=0.0, wire_bytes=0.0, exact=True))
    row['count'] += c.calls
    row['bytes'] += c.calls * (c.input_bytes if c.kind == 'reduce-scatter'
                               else c.bytes)
    row['wire_bytes'] += c.calls * wire_bytes(c)
    row['exact'] = row['exact'] and c.exact
  return sorted(rows.values(), key=lambda r: (KINDS.index(r['kind']),
                                              r['dtype'], r['group_size']))
