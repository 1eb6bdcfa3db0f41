"""haiku_mp as a package: installed, versioned, its core light (what
`import haiku_mp` loads needs only the core's dependencies) and every
import the package makes declared in pyproject.toml."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import ast
import functools
import importlib.metadata
import json
import re
import subprocess
import tempfile

from absl.testing import absltest

import haiku_mp
from tests import helpers

CORE = {'jax', 'dm-haiku', 'jmp', 'optax', 'numpy'}
# What the application needs and `import haiku_mp` must never load.
APPLICATION = ('tensorflow', 'tensorflow_datasets', 'orbax', 'matplotlib',
               'ml_collections', 'tensorboardX', 'jax_privacy', 'dm_pix')


def _name(requirement: str) -> str:
  return _normal(re.match(r'[A-Za-z0-9_.-]+', requirement).group(0))


def _normal(name: str) -> str:
  return re.sub(r'[-_.]+', '-', name).lower()


def _requirements(dist: str) -> tuple[list[str], dict[str, list[str]]]:
  """(the core requirements, {extra: its requirements}) of `dist`."""
  core, extras = [], {}
  for r in importlib.metadata.requires(dist) or ():
    extra = re.search(r'extra == "([^"]+)"', r)
    if extra:
      extras.setdefault(extra.group(1), []).append(_name(r))
    else:
      core.append(_name(r))
  return core, extras


def _closure(names) -> set[str]:
  """`names` and every distribution they require, transitively (extras
  left out)."""
  seen, todo = set(), list(names)
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    try:
      todo.extend(_requirements(name)[0])
    except importlib.metadata.PackageNotFoundError:
      pass
  return seen


@functools.cache
def _distributions_of() -> dict[str, list[str]]:
  return {k: [_normal(d) for d in v]
          for k, v in importlib.metadata.packages_distributions().items()}


def _third_party_imports(path: str) -> set[str]:
  """The top-level names of the non-stdlib, non-haiku_mp imports in a file,
  wherever in it they are (a function's lazy import included)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name.split('.')[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      names.add(node.module.split('.')[0])
  return {n for n in names
          if n not in sys.stdlib_module_names and n != 'haiku_mp'}


def _core_import() -> dict:
  """What a fresh process outside the checkout loads for `import haiku_mp`
  and its advisor (the top-level names of the modules it adds), and the
  package's own files."""
  code = ('import json, sys\n'
          'before = set(sys.modules)\n'
          'import haiku_mp, haiku_mp.advisor\n'
          'print(json.dumps(dict(\n'
          '    tops=sorted({m.split(".")[0] for m in set(sys.modules) - before}),\n'
          '    package=haiku_mp.__file__,\n'
          '    files=sorted(m.__file__ for n, m in sys.modules.items()\n'
          '                 if n.startswith("haiku_mp") and m.__file__))))\n')
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  with tempfile.TemporaryDirectory() as cwd:
    out = subprocess.run([sys.executable, '-c', code], cwd=cwd, env=env,
                         capture_output=True, text=True, check=True)
  return json.loads(out.stdout.splitlines()[-1])


@helpers.long_running
class PackageTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    try:
      cls.core, cls.extras = _requirements('haiku_mp')
    except importlib.metadata.PackageNotFoundError:
      raise AssertionError('haiku_mp is not installed: pip install -r '
                           'requirements.txt (it installs the checkout '
                           'with -e .)') from None
    cls.loaded = _core_import()

  def test_core_dependencies_are_what_the_core_imports(self):
    self.assertEqual(set(self.core), CORE)
    imported = set()
    for path in self.loaded['files']:
      for name in _third_party_imports(path):
        imported.update(_distributions_of()[name])
    self.assertEqual(imported - {'jaxlib'}, CORE)

  def test_import_loads_no_application_dependency(self):
    for name in APPLICATION:
      self.assertNotIn(name, self.loaded['tops'])
    # Nor a file of the other two wings: the advisor for any model is not
    # its ViT driver (the lab's).
    package = os.path.dirname(self.loaded['package'])
    wings = [os.path.relpath(path, package).split(os.sep)[0]
             for path in self.loaded['files']]
    self.assertContainsSubset({'model', 'update', 'advisor'}, set(wings))
    self.assertNoCommonElements({'vit', 'lab'}, set(wings))

  def test_every_import_of_the_package_is_declared(self):
    declared = _closure(set(self.core).union(*self.extras.values()))
    package = os.path.join(helpers.ROOT, 'haiku_mp')
    for folder, _, files in os.walk(package):
      for name in files:
        if not name.endswith('.py'):
          continue
        path = os.path.join(folder, name)
        for module in _third_party_imports(path):
          dists = set(_distributions_of()[module]) - {'jaxlib'}
          self.assertTrue(dists & declared,
                          f'{path}: {module} ({dists}) in no requirement')

  def test_the_extras_users_name(self):
    self.assertContainsSubset({'data', 'train', 'lab', 'privacy', 'test'},
                              set(self.extras))
    self.assertIn('jax-privacy', self.extras['privacy'])
    self.assertIn('matplotlib', self.extras['lab'])
    self.assertIn('orbax-checkpoint', self.extras['train'])

  def test_version_is_the_installed_one_and_in_the_changelog(self):
    self.assertEqual(haiku_mp.__version__,
                     importlib.metadata.version('haiku_mp'))
    with open(os.path.join(helpers.ROOT, 'docs', 'CHANGELOG.md')) as f:
      self.assertRegex(f.read(), rf'\n## {re.escape(haiku_mp.__version__)}\b')

  def test_every_package_folder_is_a_package(self):
    # setuptools' find_packages takes only folders with an __init__.py.
    for folder, dirs, files in os.walk(os.path.join(helpers.ROOT,
                                                    'haiku_mp')):
      dirs[:] = [d for d in dirs if d != '__pycache__']
      if any(f.endswith('.py') for f in files):
        self.assertIn('__init__.py', files, folder)


if __name__ == '__main__':
  absltest.main()
