"""`config.compilation_cache_dir`: where JAX's persistent cache goes, and a
resumed run that loads its train step instead of compiling it."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from haiku_mp import compilation_cache
from haiku_mp import errors
from tests import helpers
from tests import signal_at_step

HOME = {'HOME': '/home/u'}


class DirectoryTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('auto_on_a_gpu', 'auto', 'gpu', HOME, '/home/u/.cache/haiku_mp/jax'),
      ('auto_on_a_tpu_with_xdg', 'auto', 'tpu',
       dict(HOME, XDG_CACHE_HOME='/c'), '/c/haiku_mp/jax'),
      ('auto_on_the_cpu', 'auto', 'cpu', HOME, None),
      ('auto_keeps_the_environments', 'auto', 'gpu',
       dict(HOME, JAX_COMPILATION_CACHE_DIR='/e'), None),
      ('a_directory_on_the_cpu', '/d/cache', 'cpu', HOME, '/d/cache'),
      ('off', '', 'gpu', HOME, None))
  def test_directory(self, setting, backend, environ, expected):
    self.assertEqual(compilation_cache.directory(setting, backend, environ),
                     expected)

  def test_bad_settings_are_one_line_naming_the_setting(self):
    with tempfile.NamedTemporaryFile() as f:
      with self.assertRaisesRegex(errors.ConfigError,
                                  f'^compilation_cache_dir={f.name} is a file'):
        compilation_cache.check(f.name)
    with self.assertRaisesRegex(errors.ConfigError,
                                '^compilation_cache_dir=3 must be'):
      compilation_cache.check(3)


class ResumeTest(absltest.TestCase):

  def test_a_resumed_run_loads_its_train_step_from_the_cache(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    flags = ('--config=configs/vit_bf16.py', f'--workdir={tmp}/run',
             f'--config.compilation_cache_dir={tmp}/cache',
             '--config.data.source=synthetic', '--config.num_train_steps=4',
             '--config.log_every_steps=2', '--config.eval_every_steps=4',
             '--config.batch_size=8', '--config.eval_batch_size=10',
             '--config.data.synthetic_eval_examples=10',
             *helpers.TINY_MODEL_FLAGS)
    # Every compile is cached, however quick (JAX's default skips those
    # under a second, as the tiny model's are).
    env = {'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'}
    first = helpers.run_module('tests.signal_at_step', *flags,
                               env=dict(env, **{signal_at_step.ENV: 'TERM:2'}))
    self.assertEqual(first.returncode, 0, first.stderr[-3000:])
    self.assertIn(f'Compilation cache: {tmp}/cache', first.stderr)
    self.assertIn('Compiled the train step', first.stderr)
    self.assertNotIn('loaded from the compilation cache', first.stderr)
    self.assertNotEmpty(os.listdir(f'{tmp}/cache'))

    resumed = helpers.run_module('launch.train', *flags, env=env)
    self.assertEqual(resumed.returncode, 0, resumed.stderr[-3000:])
    self.assertIn('at step 2.', resumed.stderr)
    self.assertRegex(resumed.stderr, r'Compiled the train step for a batch of '
                     r'8 in .*, loaded from the compilation cache\)')


if __name__ == '__main__':
  absltest.main()
