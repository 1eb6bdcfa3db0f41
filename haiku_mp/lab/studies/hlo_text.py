"""Reading XLA's HLO text: its instructions, computations and attributes.

jax hands out a compiled program as text (`as_text()`, XLA's dumps), not as
a structure one can walk through a public API, so the studies that prove
what a program does (`fp8_gemms`: which kernel runs each matmul;
`collectives`: what goes on the wire; `step_program`: what a GPU would run;
`profile`: which module each op came from) read that text. The grammar they
share lives here, once: instructions, computations, the element types and
shapes of arrays, and the attributes the studies read (operands, called
computations, trip counts, replica groups, a dot's dimensions, ...).
"""

import math
import re
from typing import Iterator, NamedTuple, Optional

# HLO's element types: NumPy's name and bytes per element (sub-byte types
# as their bits over 8).
ELEMENT_TYPES = {
    'pred': ('bool', 1), 's2': ('int2', 0.25), 'u2': ('uint2', 0.25),
    's4': ('int4', 0.5), 'u4': ('uint4', 0.5), 's8': ('int8', 1),
    'u8': ('uint8', 1), 's16': ('int16', 2), 'u16': ('uint16', 2),
    's32': ('int32', 4), 'u32': ('uint32', 4), 's64': ('int64', 8),
    'u64': ('uint64', 8), 'f16': ('float16', 2), 'bf16': ('bfloat16', 2),
    'f32': ('float32', 4), 'f64': ('float64', 8), 'c64': ('complex64', 8),
    'c128': ('complex128', 16), 'f8e4m3fn': ('float8_e4m3fn', 1),
    'f8e5m2': ('float8_e5m2', 1), 'f8e4m3': ('float8_e4m3', 1),
    'f8e3m4': ('float8_e3m4', 1), 'f8e4m3fnuz': ('float8_e4m3fnuz', 1),
    'f8e5m2fnuz': ('float8_e5m2fnuz', 1),
    'f8e4m3b11fnuz': ('float8_e4m3b11fnuz', 1),
    'f8e8m0fnu': ('float8_e8m0fnu', 1), 'f6e2m3fn': ('float6_e2m3fn', 0.75),
    'f6e3m2fn': ('float6_e3m2fn', 0.75), 'f4e2m1fn': ('float4_e2m1fn', 0.5),
}
_ARRAY = re.compile(r'(\w+)\[([\d,]*)\]')
# XLA numbers the elements of long tuples and operand lists every fifth
# (`(f32[], ..., /*index=5*/f32[])`); the comment holds an '=' that no
# shape does, so it goes before a line is read.
_INDEX_COMMENT = re.compile(r'/\*index=\d+\*/')
# `%name = SHAPE opcode(rest`: one instruction per line. A shape holds no
# '=' (attributes do), so a match never runs into them.
_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*([^=]+?)\s+([a-z][\w-]*)\((.*)$')
# A computation's first line: its name, perhaps its signature, then '{'.
_COMPUTATION = re.compile(r'^(ENTRY\s+)?%?([\w.-]+)\s*(?:\(.*)?\{\s*$')


# Attributes, read from an instruction's `rest`.
_OPERAND = re.compile(r'%?([\w.\-]+)')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# The computations an instruction calls: one per attribute, or a list.
_CALL = re.compile(r'\b(calls|to_apply|body|condition|true_computation|'
                   r'false_computation)=%?([\w.-]+)')
_CALL_LISTS = re.compile(r'\b(branch_computations|called_computations)='
                         r'\{([^}]*)\}')
_KNOWN_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# A fusion's kind in its backend config (`"kind":"__triton_gemm"`).
_BACKEND_KIND = re.compile(r'"kind":\s*"([^"]*)"')
_PARAMETER = re.compile(r'\s*(\d+)')
_TUPLE_INDEX = re.compile(r'\bindex=(\d+)')
_INTEGER_SCALAR = re.compile(r'[su]\d+\[\]\S*$')
_INTEGER_VALUE = re.compile(r'(\d+)\)')
_DIRECTION = re.compile(r'\bdirection=(\w+)')
_DOT_DIMS = re.compile(r'\b(lhs_batch_dims|lhs_contracting_dims|'
                       r'rhs_batch_dims|rhs_contracting_dims)=\{([\d,]*)\}')
_HIGHEST = re.compile(r'operand_precision=\{highest')
_DIM_LABELS = re.compile(r'dim_labels=(\w+)_(\w+)->(\w+)')
_FEATURE_GROUPS = re.compile(r'feature_group_count=(\d+)')
# Replica groups, in three forms: `[G,S]<=[...]` (G groups of S), a list
# `{{0,1},{2,3}}`, and `mesh['a'=4,'b'=2] {'b'}`: groups along the named
# axes (a sub-axis written 'b':(1)2 is of size 2); without the braces, all
# of them.
_IOTA_GROUPS = re.compile(r'replica_groups=\[(\d+),(\d+)\]<=')
_LIST_GROUPS = re.compile(r'replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}')
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:\s*\{([^}]*)\})?")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_MESH_USED = re.compile(r"'([^']+)'(?::\(\d+\)(\d+))?")
_PAIRS = re.compile(r'source_target_pairs=\{')
_HEADER_COUNT = re.compile(r'\b(replica_count|num_partitions)=(\d+)')


class Instruction(NamedTuple):
  name: str
  shape: str  # `f32[8,4]{1,0}`, or a tuple of them in parentheses.
  opcode: str
  rest: str  # Operands and attributes: all after the opcode's '('.


class Computation(NamedTuple):
  name: str
  entry: bool
  lines: list[str]  # Its instructions' lines, without the closing '}'.


def instruction(line: str) -> Optional[Instruction]:
  """The instruction a line of HLO text holds, if it holds one."""
  match = _INSTRUCTION.match(_INDEX_COMMENT.sub('', line))
  return Instruction(*match.groups()) if match else None


def computations(hlo_text: str) -> Iterator[Computation]:
  """The module's computations in the order the text prints them (a callee
  before its callers); lines outside any (a fragment of a program) last, as
  one computation named ''."""
  current, loose = None, []
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = Computation(header.group(2), bool(header.group(1)), [])
    elif current is not None and line.strip() == '}':
      yield current
      current = None
    elif current is not None:
      current.lines.append(line)
    else:
      loose.append(line)
  if current is not None:
    yield current
  if loose:
    yield Computation('', False, loose)


def arrays(shape_text: str) -> list[tuple[str, float]]:
  """(NumPy dtype, bytes) of each array in an HLO shape (a tuple's members)."""
  found = []
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype not in ELEMENT_TYPES:
      continue
    name, size = ELEMENT_TYPES[dtype]
    count = 1
    for d in filter(None, dims.split(',')):
      count *= int(d)
    found.append((name, count * size))
  return found


def array_type(shape_text: str) -> tuple[str, tuple[int, ...]]:
  """(HLO element type, dimensions) of the first array of a shape;
  ('', ()) for none."""
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype in ELEMENT_TYPES:
      return dtype, tuple(int(d) for d in dims.split(',') if d)
  return '', ()


def operands(rest: str) -> list[str]:
  """The names of an instruction's operands (`%a, %b), attributes...`; the
  '%' is optional: jax's `as_text('hlo')` leaves it out)."""
  depth, end = 0, len(rest)
  for i, ch in enumerate(rest):
    if ch in '({':
      depth += 1
    elif ch in ')}':
      if depth == 0:
        end = i
        break
      depth -= 1
  return _OPERAND.findall(rest[:end])


def op_name(rest: str) -> str:
  """The JAX op name (with module scopes) an instruction came from; '' for
  one XLA made."""
  match = _OP_NAME.search(rest)
  return match.group(1) if match else ''


def custom_call_target(rest: str) -> Optional[str]:
  """A custom call's target (`__cublas$lt$matmul$f8`); None for none."""
  match = _TARGET.search(rest)
  return match.group(1) if match else None


def backend_kinds(rest: str) -> list[str]:
  """Every `"kind"` of an instruction's backend config, in order (a
  fusion's: `__triton_gemm`, ...)."""
  return _BACKEND_KIND.findall(rest)


def called_computations(rest: str) -> list[tuple[str, str]]:
  """(attribute, computation) for each computation an instruction calls:
  `calls`, `to_apply`, a while's `condition` and `body`, a conditional's
  branches, an async op's `called_computations`."""
  found = _CALL.findall(rest)
  for attribute, listed in _CALL_LISTS.findall(rest):
    found += [(attribute, name) for name in filter(
        None, (c.strip().lstrip('%') for c in listed.split(',')))]
  return found


def called(rest: str, attribute: str) -> Optional[str]:
  """The computation an instruction's `attribute` (`to_apply`, `body`,
  `calls`, ...) names; None where it names none."""
  return next((name for a, name in called_computations(rest)
               if a == attribute), None)


def known_trip_count(rest: str) -> Optional[int]:
  """A while loop's trip count where XLA's backend config gives it (the
  final program does); None where it does not."""
  match = _KNOWN_TRIP_COUNT.search(rest)
  return int(match.group(1)) if match else None


def parameter_number(rest: str) -> int:
  """Which of its computation's parameters a `parameter` instruction is."""
  return int(_PARAMETER.match(rest).group(1))


def tuple_index(rest: str) -> int:
  """The element a `get-tuple-element` takes."""
  return int(_TUPLE_INDEX.search(rest).group(1))


def integer_constant(op: Instruction) -> Optional[int]:
  """The value of a scalar integer constant (`s32[] constant(5)`); None for
  every other instruction."""
  if op.opcode != 'constant' or not _INTEGER_SCALAR.match(op.shape):
    return None
  match = _INTEGER_VALUE.match(op.rest)
  return int(match.group(1)) if match else None


def direction(rest: str) -> str:
  """A `compare`'s direction: 'LT', 'EQ', ...; '' for none."""
  match = _DIRECTION.search(rest)
  return match.group(1) if match else ''


def dot_dimensions(rest: str) -> dict[str, list[int]]:
  """A dot's batch and contracting dimensions, by attribute
  (`lhs_contracting_dims`: [1], ...); the absent ones left out."""
  return {k: [int(d) for d in v.split(',') if d]
          for k, v in _DOT_DIMS.findall(rest)}


def highest_precision(rest: str) -> bool:
  """Whether a dot or convolution runs at the highest operand precision
  (float32 at full precision)."""
  return bool(_HIGHEST.search(rest))


def dim_labels(rest: str) -> tuple[str, str, str]:
  """A convolution's (input, kernel, output) dimension labels
  (`b01f_01io->b01f`); empty ones for none."""
  match = _DIM_LABELS.search(rest)
  return match.groups() if match else ('', '', '')


def feature_group_count(rest: str) -> int:
  """A convolution's feature groups (1 where the attribute is absent)."""
  match = _FEATURE_GROUPS.search(rest)
  return int(match.group(1)) if match else 1


def group_size(rest: str, devices: int) -> int:
  """Devices in each replica group of a collective; `devices` (every
  device of the module) where its groups name none."""
  match = _IOTA_GROUPS.search(rest)
  if match:
    return int(match.group(2))
  match = _MESH_GROUPS.search(rest)
  if match:
    sizes = {a: int(n) for a, n in _MESH_AXIS.findall(match.group(1))}
    if match.group(2) is None:
      return math.prod(sizes.values())
    return math.prod(int(sub) if sub else sizes.get(axis, 1)
                     for axis, sub in _MESH_USED.findall(match.group(2)))
  match = _LIST_GROUPS.search(rest)
  if match:
    return len(match.group(1).split('},{')[0].strip('{}').split(','))
  # A collective-permute sends to one peer (its group: the pair).
  if _PAIRS.search(rest):
    return 2
  # `replica_groups={}`, or none: one group of every device.
  return devices


def module_devices(hlo_text: str) -> int:
  """Devices of the module, from its header (1 where it names none)."""
  counts = {'replica_count': 1, 'num_partitions': 1}
  for line in hlo_text.splitlines():
    if line.startswith('HloModule'):
      counts.update((k, int(v)) for k, v in _HEADER_COUNT.findall(line))
      break
  return counts['replica_count'] * counts['num_partitions']
