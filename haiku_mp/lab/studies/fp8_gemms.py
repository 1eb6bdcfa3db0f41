"""Study `fp8`: every matmul of the train step, its operands' formats,
and which kernel the compiled program runs it with.

The lowered program (what JAX hands XLA, on any backend) says which matmuls
take fp8 operands; only the compiled one says whether the backend made an fp8
GEMM of them. XLA:GPU runs an fp8 GEMM one of two ways: its gemm rewriter
turns a matched pattern into a cuBLASLt custom call whose target names fp8
(`__cublas$lt$matmul$f8`), or its GEMM fusion keeps the dot, fp8 operands and
all, in a Triton GEMM fusion (`__triton_gemm`, or in newer XLA
`__triton_nested_gemm_fusion`, whose operands are nested fusions; XLA 0.11
on an H100 makes every fp8 dot such a fusion before autotuning picks a
kernel). A
pattern neither takes falls back to a 16-bit GEMM without a word (flax PR
#4686, TE PR #547), so the proof is per matmul, in the compiled HLO. XLA:CPU has no fp8
kernel: it converts f8 operands to f16 and runs a float32 dot (emulated).

Each matmul is named by the module that made it (the HLO op names carry
Haiku's module scopes) and its pass: ``fprop`` / ``dgrad`` / ``wgrad`` for an
fp8 Linear's three (`fp8.FPROP` ...), else ``forward`` or ``backward``.
"""

import collections
import os
import re
from typing import Any, Callable

import jax

from haiku_mp.lab import timing
from haiku_mp.lab.studies import hlo_text
from haiku_mp.lab.studies import memory
from haiku_mp.model import fp4
from haiku_mp.model import fp8
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment

FP8_TYPES = ('f8e4m3fn', 'f8e5m2')
# cuBLASLt's fp8 GEMM (XLA:GPU's custom-call target).
FP8_GEMM_TARGET = '__cublas$lt$matmul$f8'
# A dot inside a fusion that XLA:GPU hands Triton as a GEMM (its
# backend_config's fusion kind); reported as that kind. XLA 0.11.2 on an H200
# printed the nested form for most of a ViT step's GEMMs.
TRITON_GEMM = '__triton_gemm'
TRITON_NESTED_GEMM = '__triton_nested_gemm_fusion'
TRITON_KINDS = (TRITON_GEMM, TRITON_NESTED_GEMM)
_PASSES = {fp8.FPROP: 'fprop', fp8.DGRAD: 'dgrad', fp8.WGRAD: 'wgrad'}


def hlo_matmuls(text: str) -> list[dict[str, Any]]:
  """Every matmul of an HLO module's text: `dot` instructions and the
  matmul custom calls a backend rewrites them into (cuBLAS, cuBLASLt, oneDNN),
  with their operand element types, op name and (custom calls) target."""
  # A computation is printed before the fusion that calls it: first the
  # computations that Triton GEMM fusions call.
  triton_computations = {}
  for line in text.splitlines():
    op = hlo_text.instruction(line)
    if not op or op.opcode != 'fusion':
      continue
    kind = next((k for k in hlo_text.backend_kinds(op.rest)
                 if k in TRITON_KINDS), None)
    calls = hlo_text.called(op.rest, 'calls')
    if kind and calls:
      triton_computations[calls] = kind
  found = []
  for computation in hlo_text.computations(text):
    types = {}  # Each computation's names are its own.
    for line in computation.lines:
      op = hlo_text.instruction(line)
      if op:
        types.update(_value_type(op))
        found.extend(_matmul(op, types, triton_computations.get(
            computation.name, '')))
  return found


def _value_type(op: hlo_text.Instruction) -> dict[str, str]:
  """{name: element type} of an array-shaped instruction."""
  if op.shape.startswith('('):
    return {}
  element_type, _ = hlo_text.array_type(op.shape)
  return {op.name: element_type} if element_type else {}


def _matmul(op: hlo_text.Instruction, types: dict[str, str],
            triton_kind: str) -> list[dict[str, Any]]:
  """The matmul an instruction is, as a list of one, or none."""
  opcode, rest = op.opcode, op.rest
  target = hlo_text.custom_call_target(rest)
  is_matmul = opcode == 'dot' or (
      opcode == 'custom-call' and target and
      re.search(r'cublas|matmul|gemm', target))
  if not is_matmul:
    return []
  return [dict(opcode=opcode, target=target or triton_kind,
               operands=[types.get(o, '?')
                         for o in hlo_text.operands(rest)[:2]],
               op_name=hlo_text.op_name(rest))]


def is_fp8_gemm(matmul: dict[str, Any]) -> bool:
  """Whether a compiled matmul is a GEMM on fp8 operands: cuBLASLt's fp8
  custom call, or a Triton GEMM fusion whose dot takes both operands in fp8
  (Triton then issues Hopper's fp8 MMA; an operand converted to 16 bits
  inside the fusion shows as bf16 or f16 here, and is no fp8 GEMM)."""
  if matmul['target'] == FP8_GEMM_TARGET:
    return True
  return (matmul['target'] in TRITON_KINDS and
          all(t in FP8_TYPES for t in matmul['operands']))


def locate(op_name: str, module_paths: list[str]) -> tuple[str, str]:
  """(module, pass) of a matmul from its HLO op name: the longest module
  path its scopes begin with, and fprop / dgrad / wgrad (an fp8 Linear's) or
  forward / backward."""
  scopes = op_name.split('/', 1)[1] if '/' in op_name else op_name
  path = memory.module_path(scopes)
  module = max((m for m in module_paths
                if path == m or path.startswith(m + '/')), key=len,
               default='(outside the model)')
  parts = set(path.split('/'))
  pass_ = next((p for scope, p in _PASSES.items() if scope in parts), None)
  if pass_ is None:
    pass_ = 'backward' if 'transpose(' in op_name else 'forward'
  return module, pass_


def _kernel(compiled: list[dict[str, Any]]) -> str:
  """What the compiled program runs for one lowered matmul."""
  if not compiled:
    return 'fused or removed'
  targets = sorted({c['target'] or c['opcode'] for c in compiled})
  return ', '.join(targets)


def _kernel_operands(compiled: list[dict[str, Any]]) -> str:
  """The element types the compiled matmuls take ('f8e5m2 x f8e4m3fn'), so
  a verdict can be checked against the program."""
  return ', '.join(sorted({' x '.join(c['operands']) for c in compiled})) or '-'



def verdict(row: dict[str, Any], compiled: list[dict[str, Any]],
             backend: str) -> str:
  """Whether an fp8 matmul became an fp8 GEMM, or why not."""
  if row.get('format') in fp4.FORMATS:
    return (f'emulated: {row["format"]} blocks dequantized, a float32 GEMM '
            '(4-bit GEMMs exist only on Blackwell)')
  if not row['fp8_operands']:
    return '-'
  if backend == 'cpu':
    return ('emulated: XLA:CPU has no fp8 GEMM (f8 converted to f16, a '
            'float32 dot)')
  if any(c['target'] == FP8_GEMM_TARGET for c in compiled):
    return 'fp8 GEMM (cuBLASLt)'
  if any(is_fp8_gemm(c) for c in compiled):
    return 'fp8 GEMM (Triton)'
  if not compiled:
    return ('no GEMM of its own (merged into another matmul\'s GEMM, as XLA '
            'merges dots that share an input, or removed)')
  return ('NOT an fp8 GEMM: neither cuBLASLt nor Triton took fp8 operands (a '
          'stray op between quantize and dot, or a GPU below compute '
          'capability 8.9); ran as ' + _kernel(compiled) + ' on ' +
          _kernel_operands(compiled))


def run(settings: settings_lib.Settings, compile_step: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:
  """The train step's matmuls for `settings` (their batch size and strategy):
  one row per matmul with its module, pass and operand formats, and with
  `compile_step`, the kernel the backend compiled it to."""
  exp = experiment.build_without_data(settings)
  lowered = timing.lower_train_step(exp)
  lowered_text = lowered.compiler_ir('hlo').get_hlo_module().to_string()
  paths = sorted({c.path for c in exp.module_calls})
  classes = {c.path: c.class_name for c in exp.module_calls}
  backend = jax.default_backend()
  by_op = collections.defaultdict(list)
  compiled_matmuls = None
  if compile_step:
    log('compiling the train step ...')
    compiled_matmuls = hlo_matmuls(lowered.compile().as_text())
    for c in compiled_matmuls:
      by_op[c['op_name']].append(c)
  rows = []
  for m in hlo_matmuls(lowered_text):
    module, pass_ = locate(m['op_name'], paths)
    runs_low_bit = exp.precision.runs_low_bit(classes.get(module, ''), module)
    fp8_operands = any(t in FP8_TYPES for t in m['operands'])
    row = dict(module=module, pass_=pass_, lhs=m['operands'][0],
               rhs=m['operands'][1], fp8_operands=fp8_operands,
               runs_low_bit=runs_low_bit,
               format=_format(exp.precision,
                              exp.precision.runs_fp4(classes.get(module, ''),
                                                     module),
                              pass_, fp8_operands))
    if compiled_matmuls is not None:
      compiled = by_op.get(m['op_name'], [])
      row['kernel'] = _kernel(compiled)
      row['kernel_operands'] = _kernel_operands(compiled)
      row['fp8_gemm'] = verdict(row, compiled, backend)
    rows.append({('pass' if k == 'pass_' else k): v for k, v in row.items()})
  fp8_rows = [r for r in rows if r['fp8_operands']]
  low_bit = exp.precision.low_bit
  fp4_config = low_bit.fp4 if low_bit is not None else None
  result = dict(
      experiment='fp8', backend=backend, jax_version=jax.__version__,
      device=str(jax.devices()[0].device_kind),
      batch_size=settings.batch_size,
      scaling=low_bit.fp8.describe() if low_bit is not None else 'off',
      fp8_modules=settings.precision.low_bit.modules,
      matmuls=rows, fp8_matmuls=len(fp8_rows),
      fp8_linears=sum(1 for p, c in classes.items()
                      if exp.precision.runs_low_bit(c, p)),
      low_bit_format=fp4_config.format if fp4_config else 'fp8',
      fp4_matmuls=sum(1 for r in rows if r['format'] in fp4.FORMATS),
      # modules='auto': which Linears the speed model chose, and why.
      placement=exp.low_bit_lines())
  if fp4_config is not None:
    result['scaling'] = fp4_config.describe()
  if compiled_matmuls is not None:
    result['fp8_gemms'] = sum(1 for c in compiled_matmuls if is_fp8_gemm(c))
    # Every matmul of the compiled program, so a verdict can be re-derived
    # from the JSON without the GPU.
    result['compiled_matmuls'] = compiled_matmuls
  return result


def _format(precision, runs_fp4: bool, pass_: str,
            fp8_operands: bool) -> str:
  """The low-bit format a lowered matmul's operands hold: a 4-bit Linear's
  three GEMMs take its dequantized values (float32 in the program, so only
  the module and pass tell), an fp8 one's fp8; '-' for the others."""
  if runs_fp4 and pass_ in _PASSES.values():
    return precision.low_bit.fp4.format
  return 'fp8' if fp8_operands else '-'


def table(result: dict[str, Any]) -> str:
  """The rows as a plain-text table."""
  columns = ['module', 'pass', 'format', 'lhs', 'rhs']
  if result['matmuls'] and 'kernel' in result['matmuls'][0]:
    columns += ['kernel', 'fp8_gemm']
  lines = [[str(r.get(c, '-')) for c in columns] for r in result['matmuls']]
  widths = [max(len(x) for x in [c, *(l[i] for l in lines)])
            for i, c in enumerate(columns)]
  fmt = lambda cells: '  '.join(c.ljust(w) for c, w in zip(cells, widths))
  return '\n'.join([fmt(columns), fmt(['-' * w for w in widths]),
                    *(fmt(l).rstrip() for l in lines)])


def write_table(result: dict[str, Any], out_dir: str) -> list[str]:
  """`fp8_matmuls.txt`: the table and its summary line (no plot: a list
  says more here than a picture)."""
  path = os.path.join(out_dir, 'fp8_matmuls.txt')
  with open(path, 'w') as f:
    f.write(summary(result) + '\n\n' + table(result) + '\n')
  return [path]


def summary(result: dict[str, Any]) -> str:
  if result['fp4_matmuls']:
    return (f'{len(result["matmuls"])} matmuls in the train step; '
            f'{result["fp4_matmuls"]} on {result["low_bit_format"]} operands '
            f'({result["fp8_linears"]} 4-bit Linear x fprop, dgrad, wgrad; '
            f'{result["scaling"]}), emulated: dequantized float32 GEMMs')
  line = (f'{len(result["matmuls"])} matmuls in the train step; '
          f'{result["fp8_matmuls"]} on fp8 operands ({result["fp8_linears"]} '
          f'fp8 Linear x fprop, dgrad, wgrad; scaling {result["scaling"]})')
  if 'fp8_gemms' in result:
    line += (f'; the compiled program ({result["backend"]}, '
             f'{result["device"]}) holds {result["fp8_gemms"]} fp8 GEMMs')
  if result.get('placement'):
    line = '\n'.join([*result['placement'], line])
  return line
