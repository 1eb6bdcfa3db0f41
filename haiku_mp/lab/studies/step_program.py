"""What a train step asks of a GPU, read from its program as JAX lowers it
for CUDA (`lower_for_gpu`: no GPU and no compilation needed):
every matmul, with its shapes, dtypes, module and pass, and for everything
else the bytes that go through memory and the kernels that move them, under
the rule that stands in for XLA:GPU's fusion (`gpu_traffic`).

Each loop's body counts as often as the loop runs: its trip count from XLA's
`known_trip_count`, or once where the program does not give it (`exact`).
"""

import collections
import dataclasses
import math
from typing import Any, Callable, Iterable

from haiku_mp.lab.studies import fp8_gemms
from haiku_mp.lab.studies import gpu_traffic
from haiku_mp.lab.studies import hlo_text
from haiku_mp.lab.studies import lowered_graph

MATMUL_OPCODES = ('dot', 'convolution')


def lower_for_gpu(jitted: Callable[..., Any], *args) -> str:
  """A jitted function's HLO as JAX lowers it for CUDA on `args` (arrays or
  their shapes), on any machine: nothing is compiled."""
  lowered = jitted.trace(*args).lower(lowering_platforms=('cuda',))
  return lowered.compiler_ir('hlo').get_hlo_module().to_string()


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
  exact = _measure(lowered_graph.Graph.of(text), 1, found, totals)
  return StepProgram(found, Traffic(
      bytes=sum(t['bytes'] for t in totals.values()),
      kernels=sum(t['kernels'] for t in totals.values()),
      by_kind={k: dict(v) for k, v in totals.items()}, exact=exact))


def _measure(program: lowered_graph.Graph, times: int,
             found: list[Matmul], totals) -> bool:
  """Adds `program`'s matmuls to `found` and its traffic to `totals`, each
  `times` over, and its loops' bodies as often as they run; whether every
  loop's trip count was read."""
  nodes = lowered_graph.resolved(program)
  gpu_traffic.classify(program.nodes)
  epilogues = {id(n): gpu_traffic.epilogue(n) for n in nodes
               if n.opcode in MATMUL_OPCODES}
  found += [_matmul(n, epilogues[id(n)][-1]) for n in nodes
            if n.opcode in MATMUL_OPCODES] * times
  gpu_traffic.count(nodes, program.roots, epilogues, totals, times)
  exact = program.exact
  for loop, body, trips in program.loops:
    exact &= _measure(
        lowered_graph.Graph(program.computations, body, loop.shape),
        times * trips, found, totals)
  return exact


def _matmul(node: lowered_graph.Node, written: lowered_graph.Node
            ) -> Matmul:
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


def module_of(matmul: Matmul, module_paths: Iterable[str]) -> tuple[str, str]:
  """(module, 'forward' / 'backward' or an fp8 Linear's pass) of a matmul,
  from its op name's scopes."""
  return fp8_gemms.locate(matmul.op_name, list(module_paths))
