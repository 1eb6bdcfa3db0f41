"""The commands' allocator: glibc's huge pages by default, the user's own
setting kept, nothing changed where glibc or the kernel cannot, and the
console saying which is in force."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import subprocess
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from haiku_mp.lab import hardware
from launch import allocator
from tests import helpers

_GLIBC = (2, 36)


class WantsHugePagesTest(parameterized.TestCase):

  def test_a_plain_start_on_a_new_glibc_gets_them(self):
    for mode in ('madvise', 'always'):
      self.assertTrue(allocator.wants_huge_pages({'PATH': '/bin'}, _GLIBC,
                                                 mode))

  @parameterized.named_parameters(
      ('the_users_tunables', {'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'},
       _GLIBC, 'madvise'),
      ('the_users_empty_tunables', {'GLIBC_TUNABLES': ''}, _GLIBC, 'madvise'),
      ('the_users_preload', {'LD_PRELOAD': 'libtcmalloc_minimal.so.4'},
       _GLIBC, 'madvise'),
      ('glibc_before_the_tunable', {}, (2, 34), 'madvise'),
      ('not_glibc', {}, None, 'madvise'),
      ('huge_pages_off', {}, _GLIBC, 'never'),
      ('no_transparent_huge_pages', {}, _GLIBC, None))
  def test_nothing_changes(self, env, glibc, mode):
    self.assertFalse(allocator.wants_huge_pages(env, glibc, mode))

  def test_the_kernels_mode_is_the_bracketed_one(self):
    with tempfile.NamedTemporaryFile('w', suffix='enabled') as f:
      f.write('always [madvise] never\n')
      f.flush()
      self.assertEqual(allocator.transparent_huge_pages(f.name), 'madvise')
    self.assertIsNone(allocator.transparent_huge_pages('/nonexistent/thp'))


class DescribeTest(parameterized.TestCase):
  """What the console says, from the environment the process started with."""

  @parameterized.parameters(
      (b'PATH=/bin\0GLIBC_TUNABLES=glibc.malloc.hugetlb=1\0',
       r'malloc on huge pages \(GLIBC_TUNABLES=glibc.malloc.hugetlb=1\)'),
      (b'GLIBC_TUNABLES=glibc.malloc.arena_max=2\0',
       r'malloc, GLIBC_TUNABLES=glibc.malloc.arena_max=2$'),
      (b'LD_PRELOAD=/lib/libtcmalloc_minimal.so.4\0',
       r'^LD_PRELOAD=/lib/libtcmalloc_minimal.so.4$'),
      (b'PATH=/bin\0', r'malloc, default settings$'))
  def test_the_setting_in_force(self, environ, expected):
    with tempfile.NamedTemporaryFile('wb') as f:
      f.write(environ)
      f.flush()
      self.assertRegex(hardware.allocator(f.name), expected)


class CommandTest(absltest.TestCase):
  """`python -m launch.NAME` in a fresh interpreter (a forked command keeps
  its launcher's allocator: the re-execution happens only at a start)."""

  def _machine_line(self, **env):
    env = {k: v for k, v in dict(os.environ, **env).items() if v is not None}
    result = subprocess.run([sys.executable, '-m', 'launch.machine'],
                            cwd=helpers.ROOT, env=env, text=True,
                            capture_output=True, check=True)
    [line] = result.stdout.splitlines()
    return line

  def test_a_command_starts_on_huge_pages_where_it_can(self):
    line = self._machine_line(GLIBC_TUNABLES=None, LD_PRELOAD=None)
    self.assertRegex(line, r'^Machine: .*, \d+ cores; allocator: ')
    can = allocator.wants_huge_pages({}, allocator.glibc_version(),
                                     allocator.transparent_huge_pages())
    self.assertEqual('on huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)'
                     in line, can, line)

  def test_the_users_setting_is_kept(self):
    self.assertTrue(self._machine_line(
        GLIBC_TUNABLES='glibc.malloc.arena_max=2', LD_PRELOAD=None).endswith(
            'malloc, GLIBC_TUNABLES=glibc.malloc.arena_max=2'))
    self.assertTrue(self._machine_line(
        GLIBC_TUNABLES='', LD_PRELOAD=None).endswith(
            'malloc, default settings'))


if __name__ == '__main__':
  absltest.main()
