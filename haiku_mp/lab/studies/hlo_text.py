"""Reading XLA's HLO text: its instructions and its computations.

jax hands out a compiled program as text (`as_text()`, XLA's dumps), not as
a structure one can walk through a public API, so the studies that prove
what a program does (`fp8_gemms`: which kernel runs each matmul;
`collectives`: what goes on the wire; `step_program`: what a GPU would run)
read that text. The grammar they share lives here, once: instructions,
computations, and the element types and shapes of arrays.
"""

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
