"""The package's wings and floors: the library imports neither the ViT
application nor the lab, the application not the lab, and each part
imports only parts on floors below it, so no two import each other; read
from the code's own import statements (nothing is imported)."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ast
import collections
import pathlib
import tempfile

from absl.testing import absltest

# Three wings, each on floors of its own, ground floor first: the library,
# the ViT application above it, the lab above both. A part of the package
# is a folder (`model`, `vit/train`, `lab/studies`), a file at the
# package's root (`errors`), or a wing's own root files (`lab`: the lab's
# kit). A part may import its own files and any part on a lower floor.
# The package's `__init__.py` (the library's public names) tops the
# library; above the lab, the programs that use all three.
LIBRARY = (
    ('errors',),
    ('model',),
    ('update',),
    ('advisor',),
    ('__init__',),
)
APPLICATION = (
    ('vit/settings',),
    ('vit/model',),
    ('vit/data', 'vit/parallel', 'vit/privacy'),
    ('vit/train',),
    ('vit',),
)
LAB = (
    ('lab',),
    ('lab/advisor', 'lab/benchmarks'),
    ('lab/studies',),
    ('lab/report',),
)
FLOORS = LIBRARY + APPLICATION + LAB + (('configs', 'launch'),)
_WINGS = ('vit', 'lab')
_PROGRAMS = ('configs', 'launch')
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / 'haiku_mp'
# The one part that reads ml_collections' ConfigDicts (into Settings).
_SETTINGS_PARSER = 'vit/settings/'


def _absolute(node: ast.ImportFrom, module_parts: tuple[str, ...]) -> str:
  """The dotted module a `from` import names, a relative one (`from ..train
  import loop`) resolved from the importing module's package."""
  if not node.level:
    return node.module or ''
  package = module_parts[:len(module_parts) - node.level]
  return '.'.join(package + ((node.module,) if node.module else ()))


def _part_of(relative: tuple[str, ...]) -> str:
  """The part a file belongs to, from its path inside the package."""
  if len(relative) == 1:
    return relative[0].removesuffix('.py')
  if relative[0] in _WINGS and len(relative) > 2:
    return f'{relative[0]}/{relative[1]}'
  return relative[0]


def _parts_named(module: str, names: list[str], package: pathlib.Path
                 ) -> set[str]:
  """The parts of the package (a folder, a root file, a wing's root,
  `__init__` for a name only the package's `__init__.py` defines) or the
  programs (`configs`, `launch`) that importing `names` from `module` (or
  `module` itself, for no names) reaches."""
  top, _, rest = module.partition('.')
  if top in _PROGRAMS:
    return {top}
  if top != package.name:
    return set()
  path = tuple(rest.split('.')) if rest else ()
  parts = set()
  for name in names or ['']:
    full = path + ((name,) if name else ())
    if not full:
      parts.add('__init__')
      continue
    if len(full) == 1 and not ((package / full[0]).is_dir()
                               or (package / f'{full[0]}.py').exists()):
      parts.add('__init__')  # A name the package's `__init__.py` defines.
      continue
    if full[0] in _WINGS and len(full) > 1 and (
        package / full[0] / full[1]).is_dir():
      parts.add(f'{full[0]}/{full[1]}')
    else:
      parts.add(full[0])
  return parts


def imports_by_folder(package: pathlib.Path) -> dict[str, set[str]]:
  """part -> the parts of the package (and the programs) its files import,
  itself left out: every name of every `import` and `from ... import`
  statement, relative ones resolved, those inside functions included."""
  found = collections.defaultdict(set)
  for path in package.rglob('*.py'):
    relative = path.relative_to(package).parts
    folder = _part_of(relative)
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


def files_importing(package: pathlib.Path, module: str) -> list[str]:
  """The package's files (relative paths) that import `module` or a module
  inside it, at the top or inside a function."""
  found = []
  for path in sorted(package.rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or '']
      else:
        continue
      if any(n == module or n.startswith(module + '.') for n in names):
        found.append(path.relative_to(package).as_posix())
        break
  return found


def _wing(part: str) -> str:
  if part in _PROGRAMS:
    return 'programs'
  return part.split('/')[0] if part.split('/')[0] in _WINGS else 'library'


class LayersTest(absltest.TestCase):

  def test_every_folder_has_a_floor(self):
    placed = {f for floor in FLOORS for f in floor} - set(_PROGRAMS)
    self.assertEqual(set(imports_by_folder(_PACKAGE)), placed)

  def test_imports_point_down(self):
    self.assertEmpty(_upward(imports_by_folder(_PACKAGE)))

  def test_no_two_modules_share_a_file_name(self):
    """A name says which module it is: `precision.py` in a traceback or an
    import is one file (the package's and the commands')."""
    names = collections.Counter(
        path.name for root in (_PACKAGE, _PACKAGE.parent / 'launch')
        for path in root.rglob('*.py') if path.name != '__init__.py')
    self.assertEqual([n for n, count in names.items() if count > 1], [])

  def test_the_wings_stay_apart(self):
    """The library imports neither the application nor the lab; the
    application does not import the lab."""
    self.assertEmpty(_crossings(imports_by_folder(_PACKAGE)))

  def test_only_the_settings_read_configs(self):
    """Below the launchers a run is its typed settings: the ConfigDicts of
    config files and flags are parsed in `vit/settings` and nowhere else."""
    self.assertEqual(
        [f for f in files_importing(_PACKAGE, 'ml_collections')
         if not f.startswith(_SETTINGS_PARSER)], [])

  def test_the_config_reader_sees_every_form(self):
    """The check can fail: `import`, `from ... import` and an import inside
    a function are each found (a planted package)."""
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    root = pathlib.Path(tmp.name) / 'haiku_mp'
    files = {'a.py': 'import ml_collections\n',
             'b/c.py': 'from ml_collections import config_dict\n',
             'd.py': 'def f():\n  import ml_collections.config_dict\n',
             'e.py': 'import ml_collections_other\n'}
    for name, text in files.items():
      (root / name).parent.mkdir(parents=True, exist_ok=True)
      (root / name).write_text(text)
    self.assertEqual(files_importing(root, 'ml_collections'),
                     ['a.py', 'b/c.py', 'd.py'])

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
    """The check can fail: a library file that imports the trainer is
    found (a planted package, not the real one)."""
    found = self._planted({
        'model/policies.py': 'def f():\n  from haiku_mp.vit.train import loop\n',
        'vit/train/loop.py': ''})
    self.assertEqual(found, {'model': {'vit/train'}, 'vit/train': set()})
    self.assertEqual(_upward(found),
                     ['model (floor 1) imports vit/train (floor 8)'])
    self.assertEqual(_crossings(found), ['model imports vit/train'])

  def test_the_reader_sees_every_way_up(self):
    """Each form an upward import can take is found: the second name of a
    `from haiku_mp import`, a relative import, a program's module, a wing's
    root file, and `__init__.py` importing the application and a program."""
    planted = {
        'errors.py': '',
        'model/__init__.py': '',
        'model/policies.py': 'from haiku_mp import errors, lab\n',
        'update/step.py': 'from ..vit.train import loop\nfrom . import adam\n',
        'vit/model/vit.py': '',
        'vit/data/pipeline.py': 'import configs.base\n',
        'vit/parallel/mesh.py': 'from launch import train\n',
        'vit/train/loop.py': 'from haiku_mp.lab import timing\n',
        'lab/timing.py': 'from haiku_mp.lab.studies import memory\n',
        'lab/studies/memory.py': 'import haiku_mp\n',
        '__init__.py': 'from haiku_mp.vit.model import vit\nimport launch.lab\n',
    }
    found = self._planted(planted)
    self.assertEqual(found, {
        'errors': set(), 'model': {'errors', 'lab'}, 'update': {'vit/train'},
        'vit/model': set(), 'vit/data': {'configs'},
        'vit/parallel': {'launch'}, 'vit/train': {'lab'},
        'lab': {'lab/studies'}, 'lab/studies': {'__init__'},
        '__init__': {'vit/model', 'launch'}})
    self.assertLen(_upward(found), 8)
    self.assertEqual(_crossings(found), [
        '__init__ imports launch', '__init__ imports vit/model',
        'model imports lab', 'update imports vit/train',
        'vit/data imports configs', 'vit/parallel imports launch',
        'vit/train imports lab'])


def _crossings(found: dict[str, set[str]]) -> list[str]:
  """One line per import from one wing into a wing it may not use."""
  allowed = {'library': {'library'}, 'vit': {'library', 'vit'},
             'lab': {'library', 'vit', 'lab'},
             'programs': {'library', 'vit', 'lab', 'programs'}}
  return sorted(f'{part} imports {used}'
                for part, used_set in found.items() for used in used_set
                if _wing(used) not in allowed[_wing(part)])


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
