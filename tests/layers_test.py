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
# Above the floors: the package's `__init__.py` (the public names, which
# import from every floor), and above it the programs that use the library.
FLOORS = (
    ('errors',),
    ('settings',),
    ('model',),
    ('update',),
    ('data', 'parallel', 'privacy'),
    ('train',),
    ('measure',),
    ('advisor', 'benchmarks'),
    ('studies',),
    ('report',),
    ('__init__',),
    ('configs', 'launch'),
)
_PROGRAMS = ('configs', 'launch')
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'haiku_mp'


def _absolute(node: ast.ImportFrom, module_parts: tuple[str, ...]) -> str:
  """The dotted module a `from` import names, a relative one (`from ..train
  import loop`) resolved from the importing module's package."""
  if not node.level:
    return node.module or ''
  package = module_parts[:len(module_parts) - node.level]
  return '.'.join(package + ((node.module,) if node.module else ()))


def _parts_named(module: str, names: list[str], package: pathlib.Path
                 ) -> set[str]:
  """The parts of the package (a folder, a root file, `__init__` for a name
  only the package's `__init__.py` defines) or the programs (`configs`,
  `launch`) that importing `names` from `module` (or `module` itself, for
  no names) reaches."""
  top, _, rest = module.partition('.')
  if top in _PROGRAMS:
    return {top}
  if top != package.name:
    return set()
  if rest:
    return {rest.split('.')[0]}
  parts = set()
  for name in names or ['']:
    submodule = (package / name).is_dir() or (package / f'{name}.py').exists()
    parts.add(name if name and submodule else '__init__')
  return parts


def imports_by_folder(package: pathlib.Path) -> dict[str, set[str]]:
  """folder -> the parts of the package (and the programs) its files import,
  itself left out: every name of every `import` and `from ... import`
  statement, relative ones resolved, those inside functions included."""
  found = collections.defaultdict(set)
  for path in package.rglob('*.py'):
    relative = path.relative_to(package).parts
    folder = relative[0] if len(relative) > 1 else path.stem
    module_parts = (package.name, *relative[:-1], path.stem)
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        used = _parts_named(_absolute(node, module_parts),
                            [a.name for a in node.names], package)
      elif isinstance(node, ast.Import):
        used = set().union(*(_parts_named(a.name, [], package)
                             for a in node.names))
      else:
        continue
      found[folder].update(used - {folder})
    found.setdefault(folder, set())
  return dict(found)


class LayersTest(absltest.TestCase):

  def test_every_folder_has_a_floor(self):
    placed = {f for floor in FLOORS for f in floor} - set(_PROGRAMS)
    self.assertEqual(set(imports_by_folder(_PACKAGE)), placed)

  def test_imports_point_down(self):
    self.assertEmpty(_upward(imports_by_folder(_PACKAGE)))

  def _planted(self, files: dict[str, str]) -> dict[str, set[str]]:
    """`imports_by_folder` of a planted package holding `files`."""
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    root = pathlib.Path(tmp.name) / 'haiku_mp'
    for name, text in files.items():
      (root / name).parent.mkdir(parents=True, exist_ok=True)
      (root / name).write_text(text)
    return imports_by_folder(root)

  def test_the_reader_sees_an_upward_import(self):
    """The check can fail: a model file that imports the train folder is
    found (a planted package, not the real one)."""
    found = self._planted({'model/vit.py':
                           'def f():\n  from haiku_mp.train import loop\n'})
    self.assertEqual(found, {'model': {'train'}})
    self.assertEqual(_upward(found),
                     ['model (floor 2) imports train (floor 5)'])

  def test_the_reader_sees_every_way_up(self):
    """Each form an upward import can take is found: the second name of a
    `from haiku_mp import`, a relative import, a program's module, a name of
    the package's `__init__.py`, and `__init__.py` importing a program."""
    planted = {
        'errors.py': '',
        'model/__init__.py': '',
        'model/vit.py': 'from haiku_mp import errors, train\n',
        'update/step.py': 'from ..train import loop\nfrom . import adam\n',
        'data/pipeline.py': 'import configs.base\n',
        'parallel/mesh.py': 'from launch import train\n',
        'privacy/dp.py': 'from haiku_mp import make_precision\n',
        'train/loop.py': 'import haiku_mp\n',
        '__init__.py': 'from haiku_mp.model import vit\nimport launch.lab\n',
    }
    self.assertEqual(self._planted(planted), {
        'errors': set(), 'model': {'errors', 'train'}, 'update': {'train'},
        'data': {'configs'}, 'parallel': {'launch'},
        'privacy': {'__init__'}, 'train': {'__init__'},
        '__init__': {'model', 'launch'}})
    self.assertLen(_upward(self._planted(planted)), 7)


def _upward(found: dict[str, set[str]]) -> list[str]:
  """One line per import of a part on the importer's floor or above."""
  floor_of = {f: i for i, floor in enumerate(FLOORS) for f in floor}
  return sorted(
      f'{folder} (floor {floor_of[folder]}) imports {used} '
      f'(floor {floor_of[used]})'
      for folder, used_set in found.items() if folder in floor_of
      for used in used_set if floor_of[used] >= floor_of[folder])


if __name__ == '__main__':
  absltest.main()
