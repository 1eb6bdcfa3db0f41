"""The tests' command launcher: each command a process of its own, with its
own device count, environment and exit status."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import subprocess
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from tests import helpers

_MESH_FLAGS = ('--config=configs/vit_fp16.py', '--config.parallel.strategy=pjit',
               '--config.parallel.mesh_shape=(8,2)')


class ForkedCommandsTest(parameterized.TestCase):

  @parameterized.parameters(8, 4, 8)
  def test_each_command_sees_its_own_devices(self, devices):
    workdir = os.path.join(
        self.enter_context(tempfile.TemporaryDirectory()), 'run')
    result = helpers.run_module('launch.train', *_MESH_FLAGS,
                                f'--workdir={workdir}', devices=devices)
    self.assertEqual(result.returncode, 2, result.stderr[-2000:])
    self.assertEqual(result.stderr.strip().splitlines()[-1],
                     'error: parallel.mesh_shape=(8, 2) needs 16 devices; '
                     f'there are {devices}')
    self.assertFalse(os.path.exists(workdir))

  def test_a_test_process_that_imported_tensorflow_still_forks(self):
    self.assertTrue(helpers.forks('launch.train', devices=1))
    import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    # TensorFlow wrote its variables into this process's environment; a
    # command's starts from the process's start environment without them.
    self.assertIn('TF2_BEHAVIOR', os.environ)
    self.assertTrue(helpers.forks('launch.train', devices=1))
    self.assertTrue(helpers.forks('tests.signal_at_step', devices=8))
    self.assertFalse(helpers.forks('launch.train', env={'JAX_PLATFORMS': 'tpu'}))
    self.assertFalse(helpers.forks('tests.without_modules'))

  def test_an_environment_the_launcher_lacks_starts_afresh(self):
    # JAX reads JAX_PLATFORMS as it is imported: a launcher's forked command
    # would run on the CPU the launcher's JAX chose.
    out = os.path.join(self.enter_context(tempfile.TemporaryDirectory()), 'o')
    result = helpers.run_module('launch.lab', 'params', f'--out={out}',
                                env={'JAX_PLATFORMS': 'tpu'})
    self.assertNotEqual(result.returncode, 0)
    self.assertIn("Unable to initialize backend 'tpu'", result.stderr)


  def test_a_command_leaves_as_the_interpreter_would(self):
    """At exit: a thread's work finished, executors' idle threads stopped
    (not waited on forever), atexit functions run, buffered output written,
    and `sys.exit`'s status."""
    script = '\n'.join((
        'import atexit, concurrent.futures, sys, threading',
        'from launch import cli',
        'atexit.register(lambda: sys.stdout.write(" atexit"))',
        'concurrent.futures.ThreadPoolExecutor(1).submit(int).result()',
        'go = threading.Event()',
        # Work that outlasts the main thread's exit unless waited for.
        'threading.Thread(target=lambda: go.wait() and sys.stdout.write(',
        '    " thread" * (sum(range(3 * 10**6)) > 0))).start()',
        'sys.stdout.write("buffered")',
        'go.set()',
        'cli.leave("a message")'))
    result = subprocess.run([sys.executable, '-c', script], cwd=helpers.ROOT,
                            capture_output=True, text=True, timeout=120)
    self.assertEqual((result.returncode, result.stdout, result.stderr),
                     (1, 'buffered thread atexit', 'a message\n'))


if __name__ == '__main__':
  absltest.main()
