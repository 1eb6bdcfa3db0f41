"""Writes docs/api.md, the library's public names with their signatures,
summaries and examples, from the code itself (tests/commands/api_page_test.py fails
when the page is out of date).

python -m launch.api_page            # rewrite docs/api.md
python -m launch.api_page --check    # exit 1 if docs/api.md is out of date
"""

import inspect
import os
import re
import sys

from absl import app
from absl import flags

import haiku_mp
from haiku_mp import advisor

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'docs', 'api.md')
# The public surfaces, in the page's order.
PACKAGES = (haiku_mp, advisor)
EXAMPLE = 'Example:'

_CHECK = flags.DEFINE_bool('check', False, 'Only check that the page is up '
                           'to date; exit 1 if not.')

_HEAD = """# API

The library's public names: `haiku_mp` (policies, matmuls, loss scaling, the
train step) and `haiku_mp.advisor` (statistics and verdicts for any Haiku
model). Generated from the code by `python -m launch.api_page`; a test fails
when this page and the code disagree. [your_model.md](your_model.md) puts
them together in one script. `BF16` in the examples stands for
`'params=float32,compute=bfloat16,output=float32'`, `F16` for its float16
twin.
"""


def parts(obj) -> tuple[str, str]:
  """(summary, example) of a public object's docstring: its first
  paragraph, and the code indented under its ``Example:`` line."""
  doc = inspect.getdoc(obj) or ''
  summary = ' '.join(doc.split('\n\n')[0].split())
  lines = doc.splitlines()
  if EXAMPLE not in lines:
    return summary, ''
  code = []
  for line in lines[lines.index(EXAMPLE) + 1:]:
    if not line.startswith('  '):
      break
    code.append(line[2:])
  return summary, '\n'.join(code)


def signature(name: str, obj) -> str:
  """`name(...)` as `inspect` writes it, without a default function's
  address (which changes from process to process)."""
  try:
    text = f'{name}{inspect.signature(obj)}'
  except (TypeError, ValueError):
    return name
  return re.sub(r' at 0x[0-9a-f]+>', '>', text)


def page() -> str:
  out = [_HEAD]
  for package in PACKAGES:
    out.append(f'## `{package.__name__}`\n')
    for name in sorted(package.__all__, key=str.lower):
      obj = getattr(package, name)
      summary, example = parts(obj)
      kind = 'class' if inspect.isclass(obj) else 'function'
      out.append(f'### `{package.__name__}.{name}` ({kind})\n')
      out.append(f'```python\n{signature(name, obj)}\n```\n')
      out.append(f'{summary}\n')
      if example:
        out.append(f'```python\n{example}\n```\n')
  return '\n'.join(out)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  text = page()
  current = ''
  if os.path.exists(PAGE):
    with open(PAGE) as f:
      current = f.read()
  if _CHECK.value:
    if current != text:
      print('error: docs/api.md is out of date: run python -m launch.api_page',
            file=sys.stderr)
      sys.exit(1)
    return
  with open(PAGE, 'w') as f:
    f.write(text)
  print(f'wrote {PAGE}')


if __name__ == '__main__':
  app.run(main)
