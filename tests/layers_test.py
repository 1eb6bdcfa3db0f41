"""The library's floors: each folder of `haiku_mp` imports only folders on
floors below it, so no two folders import each other, read from the code's
own import statements (nothing is imported)."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ast
import collections
import pathlib
import tempfile

from absl.testing import absltest

# Ground floor first; a folder may import its own floor's files and any
# folder on a lower floor. `errors.py` is a file at the package's root.
FLOORS = (
    ('errors',),
    ('model',),
    ('update',),
    ('data', 'parallel', 'privacy'),
    ('train',),
    ('measure',),
    ('advisor', 'benchmarks'),
    ('studies',),
    ('report',),
)
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'haiku_mp'


def _part(module: str) -> str:
  """The folder (or root file) of `haiku_mp` a dotted name lies in."""
  return module.split('.')[1]


def imports_by_folder(package: pathlib.Path) -> dict[str, set[str]]:
  """folder -> the folders of the package its files import (itself left
  out), from `import` and `from ... import` statements anywhere in a file,
  those inside functions included."""
  found = collections.defaultdict(set)
  for path in package.rglob('*.py'):
    relative = path.relative_to(package).parts
    folder = relative[0] if len(relative) > 1 else path.stem
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f'{node.module}.{a.name}' for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        continue
      for name in names:
        if name.startswith('haiku_mp.') and _part(name) != folder:
          found[folder].add(_part(name))
          break
    found.setdefault(folder, set())
  return dict(found)


class LayersTest(absltest.TestCase):

  def test_every_folder_has_a_floor(self):
    placed = {f for floor in FLOORS for f in floor}
    self.assertEqual(set(imports_by_folder(_PACKAGE)) - {'__init__'}, placed)

  def test_imports_point_down(self):
    floor_of = {f: i for i, floor in enumerate(FLOORS) for f in floor}
    upward = sorted(
        f'{folder} (floor {floor_of[folder]}) imports {used} '
        f'(floor {floor_of[used]})'
        for folder, used_set in imports_by_folder(_PACKAGE).items()
        if folder in floor_of
        for used in used_set if floor_of[used] >= floor_of[folder])
    self.assertEmpty(upward)

  def test_the_reader_sees_an_upward_import(self):
    """The check can fail: a model file that imports the train folder is
    found (a planted package, not the real one)."""
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    root = pathlib.Path(tmp.name) / 'haiku_mp'
    (root / 'model').mkdir(parents=True)
    (root / 'model' / 'vit.py').write_text(
        'def f():\n  from haiku_mp.train import loop\n')
    self.assertEqual(imports_by_folder(root), {'model': {'train'}})


if __name__ == '__main__':
  absltest.main()
