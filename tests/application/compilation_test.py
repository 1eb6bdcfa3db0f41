"""`config.compilation_cache_dir`: where JAX's persistent cache goes. (That a
resumed run loads its train step from it: tests/application/checkpoint_test.py's
InterruptTest, whose every resume does.)"""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax

from haiku_mp import errors
from haiku_mp.vit.train import compilation

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
    self.assertEqual(compilation.directory(setting, backend, environ),
                     expected)

  def test_bad_settings_are_one_line_naming_the_setting(self):
    with tempfile.NamedTemporaryFile() as f:
      with self.assertRaisesRegex(errors.ConfigError,
                                  f'^compilation_cache_dir={f.name} is a file'):
        compilation.check(f.name)
    with self.assertRaisesRegex(errors.ConfigError,
                                '^compilation_cache_dir=3 must be'):
      compilation.check(3)


class ScopeTest(absltest.TestCase):

  def test_used_and_disabled_hold_inside_their_block_only(self):
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_enable_compilation_cache)
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    path = tmp.name
    with compilation.used(path) as used:
      self.assertEqual((used, jax.config.jax_compilation_cache_dir),
                       (path, path))
      with compilation.disabled():
        self.assertFalse(jax.config.jax_enable_compilation_cache)
      self.assertEqual(jax.config.jax_enable_compilation_cache, before[1])
    self.assertEqual((jax.config.jax_compilation_cache_dir,
                      jax.config.jax_enable_compilation_cache), before)


if __name__ == '__main__':
  absltest.main()
