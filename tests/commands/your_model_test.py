"""docs/your_model.md's script, run as a user runs it: from a temporary
directory outside the checkout, against the installed package (no
PYTHONPATH); and the public surface it imports from."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json
import re
import subprocess
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

import haiku_mp
from haiku_mp import advisor
from haiku_mp import model
from haiku_mp import update
from tests import helpers

PAGE = os.path.join(helpers.ROOT, 'docs', 'your_model.md')
# Appended to the page's script: what the test reads of the run, as JSON.
_REPORT = '''
import json as _json, os as _os, sys as _sys
import importlib.metadata as _metadata
print(_json.dumps(dict(
    cwd=_os.getcwd(), haiku_mp=haiku_mp.__file__,
    version=_metadata.version('haiku_mp'),
    checkout_on_path=any(_os.path.isfile(_os.path.join(p or '.', 'pyproject.toml'))
                         and _os.path.isdir(_os.path.join(p or '.', 'haiku_mp'))
                         for p in _sys.path),
    runs={name: dict(loss=loss, skipped=int(state.skipped_steps),
                     scale=float(state.loss_scale.scale),
                     dtypes=sorted({str(v.dtype) for v in jax.tree.leaves(state.params)}))
          for name, (state, loss) in runs.items()},
    overrides=f16_overrides, low_bit_modules=fp8['low_bit_modules'],
    fp8_paths=[row['path'] for row in fp8['modules']],
    verdicts={p: [v.bfloat16, v.float16] for p, v in advice.verdicts.items()})))
'''


def page_code(path: str = PAGE) -> str:
  """The page's one Python block."""
  with open(path) as f:
    blocks = re.findall(r'```python\n(.*?)```', f.read(), re.S)
  if len(blocks) != 1:
    raise AssertionError(f'{path}: expected one python block, found '
                         f'{len(blocks)}')
  return blocks[0]


def run_page(page: str, name: str, report: str) -> list[str]:
  """Runs `page`'s script with `report` appended, saved as `name` in a
  temporary directory outside the checkout, against the installed package
  (no PYTHONPATH); the lines it printed."""
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  with tempfile.TemporaryDirectory() as cwd:
    script = os.path.join(cwd, name)
    with open(script, 'w') as f:
      f.write(page_code(page) + report)
    run = subprocess.run([sys.executable, script], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=900)
  if run.returncode:
    raise AssertionError(f'{name} failed:\n{run.stderr[-3000:]}')
  return run.stdout.splitlines()


@helpers.long_running
class YourModelPageTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    lines = run_page(PAGE, 'my_model.py', _REPORT)
    cls.printed = '\n'.join(lines[:-1])
    cls.report = json.loads(lines[-1])

  def test_it_ran_outside_the_checkout_on_the_installed_package(self):
    self.assertFalse(self.report['cwd'].startswith(helpers.ROOT))
    self.assertFalse(self.report['checkout_on_path'])
    self.assertEqual(self.report['version'], haiku_mp.__version__)

  def test_every_precision_trains(self):
    runs = self.report['runs']
    self.assertLen(runs, 5)
    for name, run in runs.items():
      # From ln(10) = 2.30 at init.
      self.assertLess(run['loss'], 0.5, name)
      self.assertEqual(run['skipped'], 0, name)
      self.assertLess(abs(run['loss'] - runs['float32']['loss']), 0.05, name)

  def test_float16_scale_grew_once_and_state_without_master_is_bf16(self):
    runs = self.report['runs']
    # 24 finite steps at period 20: one doubling from 2^15.
    self.assertEqual(runs['float16, loss-scaled']['scale'], 2.0**16)
    self.assertEqual(runs['bfloat16 state, no master']['dtypes'],
                     ['bfloat16'])
    self.assertEqual(runs['bfloat16']['dtypes'], ['float32'])

  def test_the_advisor_judges_every_linear_and_its_advice_runs(self):
    linears = ['mlp/~/linear_0', 'mlp/~/linear_1', 'mlp/~/linear_2']
    self.assertEqual(self.report['fp8_paths'], linears)
    self.assertContainsSubset(linears, self.report['verdicts'])
    for verdict in self.report['verdicts'].values():
      self.assertIn(verdict[0], ('bf16-ok', 'keep-f32'))
    self.assertIn(f"advised: overrides {self.report['overrides']!r}",
                  self.printed)
    for name in ('float16 as advised', 'fp8 as advised'):
      self.assertRegex(self.printed, rf'{name} +last loss 0\.\d+  skipped 0')


class PublicSurfaceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('haiku_mp', haiku_mp), ('model', model), ('update', update),
      ('advisor', advisor))
  def test_every_public_name_resolves_and_none_is_private(self, package):
    self.assertNotEmpty(package.__all__)
    for name in package.__all__:
      self.assertFalse(name.startswith('_'), name)
      self.assertTrue(hasattr(package, name), name)

  def test_the_top_level_holds_the_model_and_update_surfaces(self):
    self.assertCountEqual(haiku_mp.__all__,
                          model.__all__ + update.__all__)


if __name__ == '__main__':
  absltest.main()
