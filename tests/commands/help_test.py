"""`--help` on every entry point: exit 0, the command's own flags, and every
field of its config with its default and one line of its doc in the
settings' schema; `--helpfull` stays absl's."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import ast
import collections
import re
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections

from configs import base
from haiku_mp.vit import settings
from haiku_mp.vit.settings import fields as settings_fields
from launch import command_help
from tests import helpers

# A config field's line: `  --config.PATH=VALUE` and its comment, if any.
_FIELD_LINE = re.compile(r"^  --config\.([\w.]+)=('[^']*'|\S*)(?:  (.*))?$")


def _help(module, *args):
  """`python -m module *args`, at the width help falls back to without a
  terminal (100 columns), whatever COLUMNS the tests run under."""
  columns = os.environ.get('COLUMNS')
  env = {'COLUMNS': '100'} if columns not in (None, '100') else None
  return helpers.run_module(module, *args, env=env, timeout=120)


def _field_lines(stdout):
  """{config field: [(value, comment), ...]} from a help's output."""
  fields = collections.defaultdict(list)
  for line in stdout.splitlines():
    if (match := _FIELD_LINE.match(line)):
      fields[match.group(1)].append((match.group(2), match.group(3) or ''))
  return fields


def _schema_config():
  """configs/base.py's fields less the old names kept beside the new."""
  return settings_fields.to_config_dict(settings.parse(base.get_config()))


def _base_fields(config=None, prefix=''):
  config = _schema_config() if config is None else config
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _base_fields(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}'


def _base_fields_paths(config=None, prefix=()):
  config = _schema_config() if config is None else config
  for key, value in config.items():
    yield prefix + (key,), value
    if isinstance(value, ml_collections.ConfigDict):
      yield from _base_fields_paths(value, prefix + (key,))


def _docs():
  """Each field's doc in the settings' schema, by its dotted name."""
  return {'.'.join(path): doc
          for path, doc in command_help.field_docs().items()}


class HelpCommandTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('train', 'launch.train', (), ('--config', '--workdir',
                                     '--coordinator_address',
                                     '--modules_table=false'), True),
      ('benchmark', 'launch.benchmark', (), ('--steps=5', '--dtypes',
                                             '--layouts', '--loop=false'),
       True),
      ('tabulate', 'launch.tabulate', (), ('--config', '--json=false'), True),
      ('plot', 'launch.plot', (), ('--workdirs', '--out=runs.png', '--title'),
       False),
      ('lab', 'launch.lab', (), ('--config=configs/vit_fp32.py', '--out=lab',
                                 '--batch_sizes=128,1024,4096'), True),
      ('lab_sweep', 'launch.lab', ('sweep',), ('--dtypes', '--isolate=true'),
       True),
      ('lab_advise_helpshort', 'launch.lab', ('advise', '--helpshort'),
       ('--checkpoint', '--level=stats'), True),
      ('data_export', 'launch.data', ('export',),
       ('--config=configs/base.py', '--out'), True),
  )
  def test_help_exits_0_with_own_flags(self, module, args, own_flags,
                                       takes_config):
    if '--helpshort' not in args:
      args += ('--help',)
    result = _help(module, *args)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stderr, '')
    with open(os.path.join(helpers.ROOT, *module.split('.')) + '.py') as f:
      doc = ast.get_docstring(ast.parse(f.read()))
    self.assertTrue(result.stdout.startswith(doc.splitlines()[0]))
    self.assertIn(f'python -m {module}', result.stdout)
    flag_lines = result.stdout.split('\nFlags:\n', 1)[1].split('\n\n', 1)[0]
    for flag in own_flags:
      self.assertRegex(flag_lines, rf'(?m)^  {re.escape(flag)}[= ]')
    self.assertNotIn('--verbosity', result.stdout)  # absl's: --helpfull.
    fields = _field_lines(result.stdout)
    if takes_config:
      self.assertEqual(set(fields), set(_base_fields()))
    else:
      self.assertEqual(fields, {})

  def test_train_lists_every_field_once_with_its_comment(self):
    result = _help('launch.train', '--help')
    self.assertEqual(result.returncode, 0, result.stderr)
    fields = _field_lines(result.stdout)
    want = list(_base_fields())
    self.assertLen(want, len(set(want)))
    self.assertEqual({f: len(lines) for f, lines in fields.items()},
                     {f: 1 for f in want})
    config = base.get_config()
    # The defaults, as a command line takes them.
    self.assertEqual(fields['batch_size'],
                     [('128', 'Train images per step, over every device.')])
    self.assertEqual(fields['data.augment'][0][0], 'true')
    self.assertEqual(fields['data.crop_area'][0][0], "'(0.9, 1.0)'")
    self.assertEqual(fields['precision.policy'][0][0],
                     config.precision.policy)
    self.assertIn('  --config.data.randaugment_ops=2  ', result.stdout)
    self.assertEqual(fields['data.randaugment_ops'],
                     [('2', "'randaugment': operations per image (1-14).")])
    # Every comment shown is its own field's doc (a cut one ends in '...').
    docs = _docs()
    for field, [(_, comment)] in fields.items():
      self.assertTrue(docs[field].startswith(comment.rstrip('.')), field)
      self.assertLessEqual(len(f'  --config.{field}=x  {comment}'), 130)
    self.assertEqual(fields['eval_batch_size'],
                     [('1000', 'Divides val (5,000) and test (10,000).')])
    self.assertEqual(fields['loss_scale.period'][0][1],
                     'dynamic: finite steps before the scale grows.')
    # Every setting has a doc of its own to show.
    self.assertEqual([f for f, [(_, comment)] in fields.items()
                      if not comment], [])

  def test_help_shows_the_given_config_and_loads_nothing(self):
    with tempfile.TemporaryDirectory() as tmp:
      result = _help('launch.train', '--config=configs/vit_cpu.py:bf16',
                     f'--workdir={tmp}/run', '--help')
      self.assertFalse(os.path.exists(f'{tmp}/run'))
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn('Fields of --config=configs/vit_cpu.py:bf16', result.stdout)
    fields = _field_lines(result.stdout)
    self.assertEqual(fields['model.embed_dim'][0][0], '128')
    self.assertIn('compute=bfloat16', fields['precision.policy'][0][0])

  def test_help_with_a_config_that_does_not_load_still_exits_0(self):
    result = _help('launch.tabulate', '--config=configs/vit_cpu.py:fp4',
                   '-?')
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("--config=configs/vit_cpu.py:fp4 cannot be loaded: unknown "
                  "variant 'fp4'", result.stdout)
    self.assertEqual(set(_field_lines(result.stdout)), set(_base_fields()))

  def test_helpfull_stays_absls(self):
    result = _help('launch.train', '--helpfull')
    self.assertEqual(result.returncode, 1)  # absl's status for it.
    self.assertIn('--verbosity', result.stdout)
    self.assertIn('--workdir: Directory for metrics', result.stdout)
    self.assertNotIn('--config.data.randaugment_ops', result.stdout)


class HelpTextTest(absltest.TestCase):

  def test_wanted(self):
    for argv in (['--help'], ['-help'], ['--helpshort'], ['-?'],
                 ['--config=x', '--help=true'], ['sweep', '--help']):
      self.assertTrue(command_help.wanted(['cmd', *argv]), argv)
    for argv in ([], ['--nohelp'], ['--help=false'], ['--helpfull'],
                 ['--', '--help'], ['--helper']):
      self.assertFalse(command_help.wanted(['cmd', *argv]), argv)

  def test_field_docs_follow_the_schema(self):
    docs = command_help.field_docs()
    paths = [path for path, _ in _base_fields_paths()]
    self.assertEqual(set(paths) - set(docs), set())
    self.assertEqual([path for path in paths if not docs[path]], [])
    # Groups are documented too, and listed before their own fields.
    self.assertIn('DP-SGD', docs[('privacy',)])
    order = list(docs)
    self.assertLess(order.index(('precision', 'low_bit')),
                    order.index(('precision', 'low_bit', 'modules')))

  def test_one_line(self):
    text = 'First sentence here. Then a second, longer sentence that goes on.'
    self.assertEqual(command_help.one_line(text, 100), text)
    # A sentence's end in the second half of the width, else a word's.
    self.assertEqual(command_help.one_line(text, 30), 'First sentence here.')
    self.assertEqual(command_help.one_line(text, 40),
                     'First sentence here. Then a second...')


if __name__ == '__main__':
  absltest.main()
