"""The docs as a reader meets them: every relative link and image of
README.md, BENCHMARKS.md and docs/ resolves (a page's #anchor to one of its
headings), every command in a README code block still parses (its --config
file exists, its flags are the command's or settings), the README's example
runs, each headline result links to the section with its command, and the
README keeps to its line budget."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import ast
import collections
import pathlib
import re
import shlex

from absl.testing import absltest
import jax.numpy as jnp

from haiku_mp.vit import settings
from haiku_mp.vit.settings import fields
from tests.commands import your_model_test

_ROOT = pathlib.Path(__file__).resolve().parents[2]
# The README is a first screen: what haiku_mp is, install, a first run, the
# test command, an example, the features and the headline results.
README_LINES = 200
# A markdown link or image target, or an HTML image's: (target, #anchor).
_LINK = re.compile(r'(?:\]\(|src=")([^)"\s#]*)(#[^)"\s]*)?[)"]')
_FENCE = re.compile(r'^```')
_HEADING = re.compile(r'^(#{1,6})\s+(.*?)\s*#*\s*$')
_TEST_FILE = re.compile(r'\btests/[A-Za-z0-9_/]+\.py\b')


def pages() -> list[pathlib.Path]:
  """README.md, BENCHMARKS.md and every page under docs/."""
  return [_ROOT / 'README.md', _ROOT / 'BENCHMARKS.md',
          *sorted((_ROOT / 'docs').rglob('*.md'))]


def _prose(text: str):
  """The lines of `text` outside fenced code blocks: (line number, line)."""
  fenced = False
  for number, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line.lstrip()):
      fenced = not fenced
      continue
    if not fenced:
      yield number, line


def slug(heading: str) -> str:
  """The anchor GitHub gives a heading: its text without markup, lower
  case, punctuation dropped, spaces as hyphens."""
  text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', heading)
  text = re.sub(r'<[^>]+>', '', text).lower()
  text = ''.join(c for c in text if c.isalnum() or c in '-_ ')
  return text.replace(' ', '-')


def anchors(path: pathlib.Path) -> set[str]:
  """Every heading's anchor in a page (a repeated one numbered)."""
  seen = collections.Counter()
  found = set()
  for _, line in _prose(path.read_text()):
    match = _HEADING.match(line)
    if not match:
      continue
    base = slug(match.group(2))
    found.add(f'{base}-{seen[base]}' if seen[base] else base)
    seen[base] += 1
  return found


def broken_links(path: pathlib.Path) -> list[str]:
  """'page:line: target' of every relative link or image of `path` whose
  file, or whose anchor in a page, does not exist."""
  broken = []
  for number, line in _prose(path.read_text()):
    for match in _LINK.finditer(line):
      target, anchor = match.group(1), match.group(2)
      if re.match(r'^[a-z]+:', target):
        continue  # https:, mailto:
      resolved = (path.parent / target).resolve() if target else path
      where = f'{path.relative_to(_ROOT)}:{number}: {target}{anchor or ""}'
      if not resolved.exists():
        broken.append(where)
      elif (anchor and resolved.suffix == '.md'
            and anchor[1:] not in anchors(resolved)):
        broken.append(where)
  return broken


def current_pages() -> list[pathlib.Path]:
  """The pages that say what is true now: not the CHANGELOG, nor the
  benchmark pages' rounds, which name the files of their day."""
  return [_ROOT / 'README.md', _ROOT / 'BENCHMARKS.md',
          *(p for p in sorted((_ROOT / 'docs').glob('*.md'))
            if p.name != 'CHANGELOG.md')]


def missing_test_files(path: pathlib.Path) -> list[str]:
  """'page:line: path' of every test file `path` names that does not
  exist."""
  return [f'{path.relative_to(_ROOT)}:{number}: {name}'
          for number, line in enumerate(path.read_text().splitlines(), 1)
          for name in _TEST_FILE.findall(line)
          if not (_ROOT / name).exists()]


def section(path: pathlib.Path, anchor: str) -> str:
  """The text of the section of `path` under the heading whose anchor is
  `anchor`, to the next heading of its level or above ('' if none)."""
  lines = path.read_text().splitlines()
  prose = dict(_prose(path.read_text()))
  start = level = None
  for number, line in prose.items():
    match = _HEADING.match(line)
    if not match:
      continue
    if start is None and slug(match.group(2)) == anchor:
      start, level = number, len(match.group(1))
    elif start is not None and len(match.group(1)) <= level:
      return '\n'.join(lines[start - 1:number - 1])
  return '' if start is None else '\n'.join(lines[start - 1:])


def code_blocks(text: str) -> list[str]:
  """The contents of the fenced code blocks of a markdown text."""
  blocks, current = [], None
  for line in text.splitlines():
    if _FENCE.match(line.lstrip()):
      if current is None:
        current = []
      else:
        blocks.append('\n'.join(current))
        current = None
    elif current is not None:
      current.append(line)
  return blocks


def commands(text: str) -> list[list[str]]:
  """Every `python -m launch.X ...` of the code blocks, as its words
  (lines joined at a trailing backslash, comments and shell variables
  dropped)."""
  found = []
  for block in code_blocks(text):
    for line in block.replace('\\\n', ' ').splitlines():
      line = line.split('  #')[0].strip()
      if line.startswith('python -m launch.'):
        words = shlex.split(line, comments=True)
        found.append([w for w in words if not w.startswith('$')])
  return found


def command_flags(module: str) -> set[str]:
  """The flags a launch module defines (read from its source), and absl's
  own that the commands take."""
  path = _ROOT / (module.replace('.', '/') + '.py')
  names = {'help', 'helpfull', 'verbosity', 'v', 'logtostderr'}
  for node in ast.walk(ast.parse(path.read_text())):
    if (isinstance(node, ast.Call) and getattr(node.func, 'attr', '')
        .startswith('DEFINE') and node.args
        and isinstance(node.args[0], ast.Constant)):
      names.add(node.args[0].value)
  return names


def setting_names() -> set[str]:
  """Every field of the settings, dotted."""
  return {'.'.join(path) for path, _, _ in
          fields.documented(settings.Settings)}


def command_problems(words: list[str]) -> list[str]:
  """What in one command would not parse: a --config file that does not
  exist, a flag the command does not define, a --config.FIELD that is no
  setting."""
  module = words[2]
  problems = []
  if not (_ROOT / (module.replace('.', '/') + '.py')).exists():
    return [f'no module {module}']
  own, known = command_flags(module), setting_names()
  for word in words[3:]:
    if not word.startswith('--'):
      continue
    name, _, value = word[2:].partition('=')
    if name == 'config':
      if not (_ROOT / value.split(':')[0]).is_file():
        problems.append(f'--config={value}: no such file')
    elif name.startswith('config.'):
      if name[len('config.'):] not in known:
        problems.append(f'--{name}: no such setting')
    elif name.removeprefix('no') not in own:
      problems.append(f'--{name}: {module} has no such flag')
  return problems


class DocsTest(absltest.TestCase):

  def test_every_relative_link_and_image_resolves(self):
    broken = [b for page in pages() for b in broken_links(page)]
    self.assertEqual(broken, [])

  def test_every_test_file_a_page_names_exists(self):
    missing = [m for page in current_pages() for m in missing_test_files(page)]
    self.assertEqual(missing, [])

  def test_every_readme_command_parses(self):
    found = commands((_ROOT / 'README.md').read_text())
    self.assertNotEmpty(found)
    problems = {' '.join(words): command_problems(words) for words in found}
    self.assertEqual({c: p for c, p in problems.items() if p}, {})

  def test_each_headline_result_is_two_clicks_from_its_command(self):
    """The README's results table links each figure to the section that
    holds it, and that section shows the command that made it."""
    readme = (_ROOT / 'README.md').read_text()
    results = readme[readme.index('## Results'):]
    results = results[:results.index('\n## ', 1)]
    links = re.findall(r'\]\(([^)#]+\.md)#([^)]+)\)', results)
    self.assertGreaterEqual(len(links), 8)
    without = [f'{page}#{anchor}' for page, anchor in links
               if not re.search(r'^\s*(\S+ )?python (-m launch\.|\S+\.py)',
                                section(_ROOT / page, anchor), re.M)]
    self.assertEqual(without, [])

  def test_the_readme_keeps_to_its_line_budget(self):
    lines = len((_ROOT / 'README.md').read_text().splitlines())
    self.assertLessEqual(lines, README_LINES)

  def test_the_readme_example_runs(self):
    """The library example: Haiku's MLP in bfloat16 with fp8 in its first
    layer, as it says."""
    example = your_model_test.page_code(str(_ROOT / 'README.md'))
    scope = {}
    exec(example, scope)  # pylint: disable=exec-used
    self.assertEqual(scope['logits'].dtype, 'float32')
    self.assertEqual(scope['logits'].shape, (8, 10))
    precision = scope['precision']
    self.assertEqual(jnp.dtype(precision.policy.compute_dtype), jnp.bfloat16)
    self.assertTrue(precision.runs_low_bit('Linear', 'mlp/~/linear_0'))
    self.assertFalse(precision.runs_low_bit('Linear', 'mlp/~/linear_1'))

  def test_the_checks_catch_what_they_are_for(self):
    """A planted broken link, anchor and command are each found."""
    page = _ROOT / 'tests' / 'data' / 'docs_test_page.md'
    broken = broken_links(page)
    self.assertLen(broken, 2, broken)
    self.assertIn('missing.png', broken[0])
    self.assertIn('#no-such-heading', broken[1])
    self.assertEqual(missing_test_files(page), [
        'tests/data/docs_test_page.md:6: tests/library/no_such_test.py'])
    problems = command_problems(commands(page.read_text())[0])
    self.assertEqual(problems, [
        '--config=configs/none.py: no such file',
        '--config.batch_sise: no such setting',
        '--workdirr: launch.train has no such flag'])
    self.assertIn('python -m launch.train', section(page, 'a-heading'))
    self.assertEqual(section(page, 'no-such-heading'), '')
    self.assertEqual(slug('The `lab`: a [study](x.md), 2x faster!'),
                     'the-lab-a-study-2x-faster')


if __name__ == '__main__':
  absltest.main()
