"""A compiled step's collectives, read from its program, and their time on
paper.

`step_collectives` compiles a jitted function and lists every collective
(all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute) of
the program as partitioned: the SPMD partitioner's output, the collectives'
dtypes as the step wrote them. It is read there because XLA:CPU's later
passes widen half-precision collectives (bfloat16 and float16 to float32, fp8
to float16: it has no narrower ones), which a GPU does not; the final
program's collectives are listed beside them (`compiled`).

Each collective counts as often as one call of the program runs it: once,
or the trip counts of the loops around it (a scan over layers gathers each
layer's weights in one op of the loop's body). A loop whose trip count the
text does not give (a `while_loop` on data) counts once, and the row says
it is a lower bound (`exact`). Both branches of a conditional count.

`paper_time` turns a step's bytes into seconds for a link, against its FLOPs
at a peak. It is planning on paper, under these assumptions:
- no overlap of communication with compute: the sum is an upper bound, and
  the larger of the two a lower bound;
- ring (bandwidth-optimal) algorithms: each device sends (g-1)/g of an
  all-gather's output or a reduce-scatter's input, twice that for an
  all-reduce (`wire_bytes`);
- the link's nominal bandwidth per device, achieved, plus a fixed latency
  per collective;
- the per-device bytes and FLOPs of the partitioned program, for the mesh it
  was compiled for.
"""

import glob
import os
import random
import tempfile
from typing import Any, Callable, NamedTuple, Sequence

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


def _partitioned_text(lowered, options: dict[str, Any]
                      ) -> tuple[Any, str, str]:
  """(compiled, text, source): the program after SPMD partitioning, read
  from XLA's dump of that pass into a temporary directory, or the final
  program where no dump appears."""
  with tempfile.TemporaryDirectory() as tmp:
    dump = {'xla_dump_to': tmp, 'xla_dump_hlo_pass_re': 'spmd-partitioning'}
    compiled = lowered.compile(compiler_options={**options, **dump})
    dumps = glob.glob(os.path.join(tmp, '*after_spmd-partitioning*'))
    if not dumps:
      # Loaded from JAX's persistent compilation cache, which leaves dump
      # options out of its key: no pass ran. Compiled again under a key no
      # cached program has (the option only sizes a debug printout of
      # XLA's; a value drawn at random, so that no earlier call's is met).
      compiled = lowered.compile(compiler_options={
          **options, **dump, 'xla_debug_buffer_assignment_show_max':
              random.SystemRandom().randrange(2**20, 2**30)})
      dumps = glob.glob(os.path.join(tmp, '*after_spmd-partitioning*'))
    if dumps:
      with open(sorted(dumps)[-1]) as f:
        return compiled, f.read(), 'partitioned'
  return compiled, compiled.as_text(), 'compiled'


def _memory(compiled) -> dict[str, int]:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  fields = ('argument_size_in_bytes', 'output_size_in_bytes',
            'temp_size_in_bytes', 'alias_size_in_bytes',
            'generated_code_size_in_bytes')
  return {f.replace('_size_in_bytes', '_bytes'): int(getattr(analysis, f))
          for f in fields if hasattr(analysis, f)}


def _flops(compiled) -> float:
  costs = compiled.cost_analysis()
  if isinstance(costs, (list, tuple)):
    costs = costs[0] if costs else {}
  return float((costs or {}).get('flops', 0.0))


def step_collectives(jitted: Callable[..., Any], *args,
                     compiler_options: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
  """`jitted` (a `jax.jit` or `jax.pmap` function) lowered on `args`
  (arrays or ShapeDtypeStructs with shardings) and compiled: its
  collectives as partitioned and as compiled, its per-device memory from
  XLA's analysis, and its FLOPs per device. `compiler_options`: those the
  function is compiled with (a dump's are added). XLA's cost analysis
  counts a loop's body once (a scan of 5 matmuls: one matmul's FLOPs),
  where the collectives count every trip."""
  lowered = jitted.lower(*args)
  compiled, text, source = _partitioned_text(lowered,
                                             compiler_options or {})
  return dict(source=source, collectives=summarize(parse_collectives(text)),
              compiled_collectives=summarize(
                  parse_collectives(compiled.as_text())),
              memory=_memory(compiled), flops=_flops(compiled))


# Links, per device, nominal (NVIDIA's and InfiniBand's figures).
LINKS = {
    'nvlink_8gpu': dict(
        devices=8, bandwidth=450e9, latency=5e-6,
        about='8 H100/H200 in one node, NVLink 4 through NVSwitch: 450 GB/s '
              'per GPU each way'),
    'ib_2node': dict(
        devices=16, bandwidth=50e9, latency=10e-6,
        about='2 nodes of 8 GPUs, NDR InfiniBand 400 Gb/s (50 GB/s) per GPU, '
              'one NIC each; a ring over the nodes runs at the inter-node '
              'link'),
    'ib_16node': dict(
        devices=128, bandwidth=50e9, latency=20e-6,
        about='16 nodes of 8 GPUs, NDR InfiniBand 50 GB/s per GPU; a longer '
              'ring, a larger latency per collective'),
}
# Dense peaks per GPU (NVIDIA's H100 SXM and H200 datasheets, the same
# figures for both; without sparsity).
PEAKS = {
    'h100_bf16': dict(flops=989e12, about='H100/H200 SXM, bfloat16 dense'),
    'h100_fp8': dict(flops=1979e12, about='H100/H200 SXM, fp8 dense'),
    'h100_fp32': dict(flops=67e12, about='H100/H200 SXM, float32 (no tensor '
                                         'cores)'),
}


def paper_time(rows: Sequence[dict[str, Any]], flops: float, link: str,
               peak: str) -> dict[str, Any]:
  """Seconds a step's collectives (`summarize` rows) take on `link`, and
  its `flops` per device at `peak`: which of the two bounds the step (no
  overlap assumed), with the latencies and on bandwidth alone. The rows' groups over the data axis are taken to span
  the link's devices, each device keeping its batch (weak scaling): a
  ring's (g-1)/g share is recomputed for them; other groups are kept.
  `exact` is False where a row is a lower bound (a loop of unknown trip
  count)."""
  spec, compute_peak = LINKS[link], PEAKS[peak]['flops']
  devices = spec['devices']
  sent = 0.0
  for row in rows:
    g = row['group_size']
    share = 1.0
    if g == max(r['group_size'] for r in rows) and g > 1:
      share = ((devices - 1) / devices) / ((g - 1) / g)
    sent += row['wire_bytes'] * share
  count = sum(r['count'] for r in rows if r['group_size'] > 1)
  bandwidth = sent / spec['bandwidth']
  # One latency per collective as the program has them: an upper bound
  # where a backend's combiners merge them later.
  latency = count * spec['latency']
  comm = bandwidth + latency
  compute = flops / compute_peak
  return dict(comm_seconds=comm, bandwidth_seconds=bandwidth,
              latency_seconds=latency, collectives=count,
              compute_seconds=compute,
              bound='communication' if comm > compute else 'compute',
              bandwidth_bound=('communication' if bandwidth > compute
                               else 'compute'),
              comm_over_compute=comm / compute if compute else None,
              exact=all(r.get('exact', True) for r in rows))
