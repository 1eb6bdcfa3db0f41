"""Every bad input of README's table: one line naming it, non-zero exit,
no traceback, and the existing run directory and checkpoint untouched."""

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--config.data.source=synthetic', '--config.num_train_steps=2',
        '--config.log_every_steps=1', '--config.eval_every_steps=2',
        '--config.checkpoint_every_steps=1', '--config.batch_size=8',
        '--config.eval_batch_size=8', '--config.data.synthetic_eval_examples=8',
        '--config.model.num_layers=1', '--config.model.embed_dim=16',
        '--config.model.mlp_dim=16', '--config.model.num_heads=2']


def _train(workdir, *flags, devices=8):
  env = dict(os.environ,
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')
  return subprocess.run(
      [sys.executable, '-m', 'launch.train', '--config=configs/vit_fp16.py',
       f'--workdir={workdir}', *TINY, *flags],
      cwd=ROOT, env=env, capture_output=True, text=True)


def _digest(directory):
  """A hash of every file (path and bytes) under `directory`."""
  h = hashlib.sha256()
  for path in sorted(glob.glob(f'{directory}/**', recursive=True)):
    if os.path.isfile(path):
      h.update(os.path.relpath(path, directory).encode())
      with open(path, 'rb') as f:
        h.update(f.read())
  return h.hexdigest()


class BadInputTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.finished = os.path.join(cls.tmp, 'finished')
    result = _train(cls.finished)
    assert result.returncode == 0, result.stderr[-3000:]

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp)
    super().tearDownClass()

  def _assert_one_line_error(self, result, message):
    self.assertNotEqual(result.returncode, 0)
    self.assertNotIn('Traceback', result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    self.assertIn(message, last)

  @parameterized.named_parameters(
      ('unknown_config_key', ['--config.batch_sise=3'], 'batch_sise'),
      ('malformed_override', ['--config.precision.overrides=head'],
       "malformed entry 'head'"),
      ('invalid_policy', ['--config.precision.policy=p=f32,cc=f16'],
       'precision.policy'),
      ('unknown_dtype', ['--config.precision.policy=p=f32,c=float8'],
       "Unknown dtype 'float8'"),
      ('unknown_matmul_precision',
       ['--config.precision.matmul_precision=fastest'],
       "precision.matmul_precision: unknown value 'fastest'"),
      ('unknown_residual_stream', ['--config.precision.residual_stream=f32'],
       "precision.residual_stream: unknown value 'f32'"),
      ('non_positive_batch', ['--config.batch_size=-8'], 'batch_size=-8'),
      ('batch_not_divisible', ['--config.parallel.strategy=pmap',
                               '--config.parallel.mesh_shape=(8,1)',
                               '--config.batch_size=12'],
       'batch_size=12 is not divisible'),
      ('mesh_too_large', ['--config.parallel.strategy=pjit',
                          '--config.parallel.mesh_shape=(8,2)'],
       'needs 16 devices; there are 8'),
      ('unknown_strategy', ['--config.parallel.strategy=dp'],
       "parallel.strategy: unknown strategy 'dp'"),
      ('unknown_loss_scale', ['--config.loss_scale.kind=auto'],
       'loss_scale.kind'),
      ('non_positive_layer_norm_epsilon',
       ['--config.model.layer_norm_epsilon=0'],
       'model.layer_norm_epsilon=0 must be positive'),
      ('checkpoint_of_another_model', ['--config.model.embed_dim=32',
                                       '--config.num_train_steps=4'],
       'can be restored'))
  def test_existing_run_untouched(self, flags, message):
    before = _digest(self.finished)
    self._assert_one_line_error(_train(self.finished, *flags), message)
    self.assertEqual(_digest(self.finished), before)

  def test_missing_or_empty_data_dir_offline(self):
    empty = self.enter_context(tempfile.TemporaryDirectory())
    workdir = os.path.join(empty, 'run')
    result = _train(workdir, '--config.data.source=tfds',
                    f'--config.data.data_dir={empty}',
                    '--config.data.download=false')
    self._assert_one_line_error(result, 'data.data_dir')
    self.assertFalse(os.path.exists(workdir))

  def test_workdir_not_writable(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    blocker = os.path.join(tmp, 'a_file')
    with open(blocker, 'w') as f:
      f.write('not a directory')
    result = _train(os.path.join(blocker, 'run'))
    self._assert_one_line_error(result, 'is not writable')

  def test_corrupt_checkpoint_falls_back_or_stops_cleanly(self):
    workdir = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                           'run')
    shutil.copytree(self.finished, workdir)
    steps = sorted(os.listdir(f'{workdir}/checkpoints'), key=int)
    self.assertEqual(steps, ['1', '2'])
    for path in glob.glob(f'{workdir}/checkpoints/2/**', recursive=True):
      if os.path.isfile(path):
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 2)
    # The newest is truncated: the run resumes from step 1 and finishes.
    result = _train(workdir, '--config.num_train_steps=3')
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertIn('cannot be restored', result.stderr)
    self.assertIn('at step 1.', result.stderr)
    # Every checkpoint corrupt: one line, and nothing rewritten.
    for path in glob.glob(f'{workdir}/checkpoints/**', recursive=True):
      if os.path.isfile(path):
        with open(path, 'wb') as f:
          f.write(b'\0')
    before = _digest(workdir)
    result = _train(workdir, '--config.num_train_steps=5')
    self._assert_one_line_error(result, 'can be restored')
    self.assertEqual(_digest(workdir), before)


if __name__ == '__main__':
  absltest.main()
