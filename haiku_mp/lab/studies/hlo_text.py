"""Reading XLA's HLO text: its instructions and its computations.

jax hands out a compiled program as text (`as_text()`, XLA's dumps), not as
a structure one can walk through a public API, so the studies that prove
what a program does (`fp8_gemms`: which kernel runs each matmul;
`collectives`: what goes on the wire) read that text. The grammar they
share lives here, once.
"""

import re
from typing import Iterator, NamedTuple, Optional

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
