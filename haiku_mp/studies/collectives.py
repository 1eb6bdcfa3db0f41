"""A compiled step's collectives, read from its program, and their time on
paper.

`step_collectives` compiles a jitted function and lists every collective
(all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute) of
the program as partitioned: the SPMD partitioner's output, the collectives'
dtypes as the step wrote them. It is read there because XLA:CPU's later
passes widen half-precision collectives (bfloat16 and float16 to float32, fp8
to float16: it has no narrower ones), which a GPU does not; the final
program's collectives are listed beside them (`compiled`).

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
import re
import tempfile
from typing import Any, Callable, NamedTuple, Sequence

KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all',
         'collective-permute')
_HLO_DTYPES = {
    'pred': ('bool', 1), 's8': ('int8', 1), 'u8': ('uint8', 1),
    's16': ('int16', 2), 'u16': ('uint16', 2), 's32': ('int32', 4),
    'u32': ('uint32', 4), 's64': ('int64', 8), 'u64': ('uint64', 8),
    'f16': ('float16', 2), 'bf16': ('bfloat16', 2), 'f32': ('float32', 4),
    'f64': ('float64', 8), 'f8e4m3fn': ('float8_e4m3fn', 1),
    'f8e5m2': ('float8_e5m2', 1), 'f8e4m3': ('float8_e4m3', 1),
    'f8e8m0fnu': ('float8_e8m0fnu', 1), 'f4e2m1fn': ('float4_e2m1fn', 0.5),
}
# `%name = SHAPE kind(` or `kind-start(`: one op per line of HLO text.
_OP = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*(.+?)\s+(' +
                 '|'.join(KINDS) + r')(-start)?\(')
_ARRAY = re.compile(r'(\w+)\[([\d,]*)\]')
_IOTA_GROUPS = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=')
_LIST_GROUPS = re.compile(r'replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}')
_PAIRS = re.compile(r'source_target_pairs=\{')


class Collective(NamedTuple):
  """One collective of a program, per device."""
  kind: str  # One of KINDS.
  dtype: str  # NumPy's name: 'bfloat16', 'float8_e4m3fn', ...
  bytes: float  # Of its result (a tuple's summed).
  group_size: int  # Devices in each of its replica groups.
  name: str  # The op's name in the program.

  @property
  def input_bytes(self) -> float:
    """Bytes each device puts in: an all-gather's shard, a reduce-scatter's
    whole."""
    if self.kind == 'all-gather':
      return self.bytes / self.group_size
    if self.kind == 'reduce-scatter':
      return self.bytes * self.group_size
    return self.bytes


def _arrays(shape_text: str) -> list[tuple[str, float]]:
  """(dtype, bytes) of each array in an HLO shape (a tuple's members; for
  an async start, its outputs: the last half of its tuple)."""
  arrays = []
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype not in _HLO_DTYPES:
      continue
    name, size = _HLO_DTYPES[dtype]
    count = 1
    for d in filter(None, dims.split(',')):
      count *= int(d)
    arrays.append((name, count * size))
  return arrays


def _group_size(line: str) -> int:
  match = _IOTA_GROUPS.search(line)
  if match:
    return int(match.group(2))
  match = _LIST_GROUPS.search(line)
  if match:
    return len(match.group(1).split('},{')[0].strip('{}').split(','))
  # A collective-permute sends to one peer; groups of all devices are
  # written `replica_groups={}`.
  return 2 if _PAIRS.search(line) else 1


def parse_collectives(hlo_text: str) -> list[Collective]:
  """Every collective of an HLO module's text, once each (an async pair
  by its `-start`); a tuple-shaped one counts as one of the dtype of its
  first array, its bytes summed."""
  found = []
  for line in hlo_text.splitlines():
    match = _OP.match(line)
    if not match:
      continue
    name, shape, kind, start = match.groups()
    arrays = _arrays(shape)
    if start and len(arrays) > 1:
      arrays = arrays[len(arrays) // 2:]  # (operands, outputs) of a start.
    if not arrays:
      continue
    found.append(Collective(kind, arrays[0][0], sum(b for _, b in arrays),
                            _group_size(line), name))
  return found


def wire_bytes(c: Collective) -> float:
  """Bytes each device sends for `c` under a ring algorithm."""
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
  per device per call of the program. Bytes are a reduce-scatter's input
  (what it reduces), every other kind's result."""
  rows: dict[tuple[str, str, int], dict[str, Any]] = {}
  for c in found:
    if c.group_size <= 1:
      continue  # Groups of one device (a partitioner's no-op) move nothing.
    key = (c.kind, c.dtype, c.group_size)
    row = rows.setdefault(key, dict(kind=c.kind, dtype=c.dtype,
                                    group_size=c.group_size, count=0,
                                    bytes=0.0, wire_bytes=0.0))
    row['count'] += 1
    row['bytes'] += c.input_bytes if c.kind == 'reduce-scatter' else c.bytes
    row['wire_bytes'] += wire_bytes(c)
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
  function is compiled with (a dump's are added)."""
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
# Dense peaks per GPU (NVIDIA's H100 SXM datasheet, without sparsity).
PEAKS = {
    'h100_bf16': dict(flops=989e12, about='H100 SXM, bfloat16 dense'),
    'h100_fp8': dict(flops=1979e12, about='H100 SXM, fp8 dense'),
    'h100_fp32': dict(flops=67e12, about='H100 SXM, float32 (no tensor '
                                         'cores)'),
}


def paper_time(rows: Sequence[dict[str, Any]], flops: float, link: str,
               peak: str) -> dict[str, Any]:
  """Seconds a step's collectives (`summarize` rows) take on `link`, and
  its `flops` per device at `peak`: which of the two bounds the step (no
  overlap assumed). The rows' groups over the data axis are taken to span
  the link's devices, each device keeping its batch (weak scaling): a
  ring's (g-1)/g share is recomputed for them; other groups are kept."""
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
  comm = sent / spec['bandwidth'] + count * spec['latency']
  compute = flops / compute_peak
  return dict(comm_seconds=comm, compute_seconds=compute,
              bound='communication' if comm > compute else 'compute',
              comm_over_compute=comm / compute if compute else None)
