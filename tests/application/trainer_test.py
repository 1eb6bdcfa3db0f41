"""End-to-end tests of the training loop and `python -m launch.train`."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import glob
import json
import re
import signal
import subprocess
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
import tensorflow_datasets as tfds

from configs import vit_recipe
from haiku_mp.model import half_dot
from haiku_mp.vit.data import npz_source
from haiku_mp.vit.data import pipeline
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import checkpoint
from haiku_mp.vit.train import loop
from haiku_mp.vit.train import run_dir
from tests import helpers

ROOT = helpers.ROOT
TRAIN_KEYS = {'step', 'split', 'loss', 'accuracy', 'loss_scale',
              'skipped_steps', 'images_per_sec', 'learning_rate', 'grad_norm',
              'window_skipped_steps', 'updates_lost'}
SUMMARY_KEYS = {'test_accuracy', 'test_loss', 'val_accuracy', 'val_loss',
                'train_time_sec', 'steps', 'skipped_steps', 'peak_memory_bytes',
                'images_per_sec', 'final_loss_scale'}


def _tiny_run_config(policy='params=float32,compute=float16,output=float32',
                     loss_scale='dynamic'):
  return helpers.tiny_run_config(policy, loss_scale)


CLI_TINY = ('--config.num_train_steps=4', '--config.log_every_steps=1',
            '--config.eval_every_steps=4', '--config.batch_size=8',
            '--config.eval_batch_size=10',
            '--config.data.synthetic_eval_examples=10',
            '--config.data.synthetic_train_examples=64',
            '--config.model.num_layers=1', '--config.model.embed_dim=16',
            '--config.model.mlp_dim=16', '--config.model.num_heads=2')
# absl's log line: level and date, time, thread, then `file.py:line]`.
LOG_LINE = re.compile(r'^([IWEF])\d{4} [\d:.]+\s+\d+ ([\w.]+):\d+\]')
OWN_FILES = {os.path.basename(f) for f in glob.glob(f'{ROOT}/haiku_mp/**/*.py',
                                                     recursive=True) +
             glob.glob(f'{ROOT}/launch/*.py')}


def _read_jsonl(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


@helpers.long_running
class TrainerTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.workdir = self.enter_context(tempfile.TemporaryDirectory())

  def test_synthetic_run_writes_its_files_and_is_recognized_as_finished(self):
    config = _tiny_run_config()
    self.assertIsNone(
        run_dir.finished_summary(settings_lib.parse(config), self.workdir))
    summary = loop.train_and_evaluate(settings_lib.parse(config), self.workdir)
    events = _read_jsonl(self.workdir)
    train = [e for e in events if e['split'] == 'train']
    self.assertEqual([e['step'] for e in train], [2, 4, 6])
    for event in train:
      self.assertEqual(set(event), TRAIN_KEYS)
      self.assertEqual(event['loss_scale'], 2.0**15)
    self.assertEqual([(e['step'], e['num_examples']) for e in events
                      if e['split'] == 'val'], [(3, 20), (6, 20)])
    self.assertEqual([e['step'] for e in events if e['split'] == 'test'], [6])
    with open(os.path.join(self.workdir, 'summary.json')) as f:
      on_disk = json.load(f)
    self.assertContainsSubset(SUMMARY_KEYS, set(on_disk))
    self.assertEqual(on_disk['steps'], 6)
    self.assertEqual(on_disk['test_accuracy'], summary['test_accuracy'])
    self.assertNotEmpty(glob.glob(os.path.join(
        self.workdir, 'tensorboard', 'events.out.tfevents.*')))
    with open(os.path.join(self.workdir, 'config.json')) as f:
      self.assertEqual(json.load(f)['precision']['policy'],
                       'params=float32,compute=float16,output=float32')
    # Finished: run again, it returns the summary, its data not loaded.
    on_disk = run_dir.finished_summary(settings_lib.parse(config), self.workdir)
    self.assertEqual(on_disk['test_accuracy'], summary['test_accuracy'])
    self.assertEqual(on_disk['steps'], 6)
    with mock.patch.object(pipeline, 'load') as load:
      self.assertEqual(
          loop.train_and_evaluate(settings_lib.parse(config), self.workdir),
          on_disk)
    load.assert_not_called()
    longer = _tiny_run_config()
    longer.num_train_steps = 7  # Another run: it goes on from step 6.
    self.assertIsNone(
        run_dir.finished_summary(settings_lib.parse(longer), self.workdir))
    cached = _tiny_run_config()  # The same run, its programs kept elsewhere.
    cached.compilation_cache_dir = os.path.join(self.workdir, 'cache')
    self.assertEqual(
        run_dir.finished_summary(settings_lib.parse(cached), self.workdir),
        on_disk)

  def test_any_exit_closes_writer_and_checkpointer_and_restores_sigterm(self):
    """A KeyboardInterrupt after three steps (not even an Exception) still
    closes the run's resources and gives the SIGTERM and SIGINT handlers
    back."""
    error = KeyboardInterrupt
    make_batches = pipeline.train_batches

    def failing_batches(*args):
      batches = make_batches(*args)
      for _ in range(3):
        yield next(batches)
      raise error('the data went away')

    closed = []
    close_writer = run_dir.MetricsWriter.close
    close_checkpointer = checkpoint.Checkpointer.close
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with mock.patch.object(pipeline, 'train_batches', failing_batches), \
        mock.patch.object(run_dir.MetricsWriter, 'close', lambda w: (
            closed.append('writer'), close_writer(w))), \
        mock.patch.object(checkpoint.Checkpointer, 'close', lambda c: (
            closed.append('checkpointer'), close_checkpointer(c))):
      with self.assertRaisesRegex(error, 'the data went away'):
        loop.train_and_evaluate(settings_lib.parse(_tiny_run_config()),
                                self.workdir)
    self.assertCountEqual(closed, ['writer', 'checkpointer'])
    self.assertEqual((signal.getsignal(signal.SIGTERM),
                      signal.getsignal(signal.SIGINT)), before)
    # Three steps ran (the third evaluated); the fourth's batch raised.
    self.assertEqual([(e['step'], e['split']) for e in
                      _read_jsonl(self.workdir)], [(2, 'train'), (3, 'val')])

  def test_mock_tfds_run_learns(self):
    config = _tiny_run_config('float32', 'none')
    config.model.image_size = 32
    config.model.patch_size = 8
    config.data.source = 'tfds'
    config.num_train_steps = 30
    config.eval_every_steps = 30
    config.log_every_steps = 5
    config.model.dropout_rate = 0.0
    config.data.augment = False
    config.learning_rate = 3e-3
    with tfds.testing.mock_data(num_examples=8):
      loop.train_and_evaluate(settings_lib.parse(config), self.workdir)
    losses = [e['loss'] for e in _read_jsonl(self.workdir)
              if e['split'] == 'train']
    # 8 examples memorized: the last window's loss is 0.68 of the first's
    # here. Asking for 0.85 (half the fall) leaves another CPU's rounding of
    # the same steps no say; a run that learns nothing stays near 1.
    self.assertLess(losses[-1], losses[0] * 0.85)

  def test_the_recipe_trains_in_float16(self):
    """Every recipe setting on (configs/vit_recipe.py) in one compiled step:
    augmentation policy, erasing, mixing, smoothing, drop path, decay, the
    moving average."""
    config = vit_recipe.get_config('fp16')
    config.model.update(helpers.tiny_config().model.to_dict())
    # Two blocks: drop path's rate rises from 0 in the first.
    config.model.update(dict(image_size=32, patch_size=8, dropout_rate=0.0,
                             drop_path_rate=0.1, num_layers=2))
    config.data.source = 'tfds'
    config.batch_size = 8
    config.eval_batch_size = 8
    config.num_train_steps = 40
    config.warmup_steps = 5
    config.log_every_steps = 10
    config.eval_every_steps = 40
    config.checkpoint_every_steps = 40
    config.learning_rate = 3e-3
    config.ema_horizon = 0.25  # A decay of 0.9 over 40 steps.
    with tfds.testing.mock_data(num_examples=8):
      loop.train_and_evaluate(settings_lib.parse(config), self.workdir)
    events = _read_jsonl(self.workdir)
    train = [e for e in events if e['split'] == 'train']
    # 0.78 here; 0.9 asks for half that fall (the same steps on another CPU
    # round otherwise, the draws are the same).
    self.assertLess(train[-1]['loss'], 0.9 * train[0]['loss'])
    self.assertEqual(train[-1]['skipped_steps'], 0)
    # The params' moving average evaluated beside them: a different model.
    self.assertEqual([(e['step'], e['split']) for e in events
                      if e['split'] != 'train'],
                     [(40, 'val'), (40, 'val_ema'), (40, 'test'),
                      (40, 'test_ema')])
    with open(os.path.join(self.workdir, 'summary.json')) as f:
      summary = json.load(f)
    self.assertNotEqual(summary['ema_test_loss'], summary['test_loss'])
    self.assertEqual(summary['ema_val_accuracy'], events[-3]['accuracy'])

  def test_real_cifar10_few_steps(self):
    helpers.skip_without_real_data(self)
    config = _tiny_run_config()
    config.model.image_size = 32
    config.model.patch_size = 8
    config.data.source = 'tfds'
    config.data.data_dir = helpers.real_data_dir()
    config.data.download = False
    # Ten steps read 320 train images; val and test are read and evaluated
    # whole (reading all 45,000 train images took 5.6 s of the test's 11).
    config.data.train_split = 'train[:320]'
    config.batch_size = 32
    config.eval_batch_size = 1000
    config.num_train_steps = 10
    config.eval_every_steps = 10
    summary = loop.train_and_evaluate(settings_lib.parse(config), self.workdir)
    events = _read_jsonl(self.workdir)
    self.assertEqual([(e['split'], e['num_examples']) for e in events
                      if e['split'] in ('val', 'test')],
                     [('val', 5000), ('test', 10000)])
    test = [e for e in events if e['split'] == 'test'][0]
    self.assertEqual((summary['test_accuracy'], summary['test_loss']),
                     (test['accuracy'], test['loss']))
    self.assertEqual(summary['skipped_steps'], 0)


@helpers.long_running
class PrivateRunTest(absltest.TestCase):

  def test_epsilon_in_every_report_counts_the_steps_taken(self):
    """float16 from a loss scale of 2^16: per-example gradients (each of
    one example's loss, larger than a batch mean's) overflow at first; those
    steps are skipped, the scale backs off, and they spend no privacy."""
    config = _tiny_run_config()
    # The first step overflows from 2^15 / 1.25 up (not at 2^15 / 1.5): 2^16
    # is at least 2.5x past it, which no other CPU's rounding undoes.
    config.loss_scale.initial = 2.0**16
    config.model.num_layers = 1
    config.data.synthetic_train_examples = 200
    config.privacy.enabled = True
    config.privacy.noise_multiplier = 1.3
    config.privacy.microbatch_size = 4
    workdir = self.enter_context(tempfile.TemporaryDirectory())
    with self.assertLogs('absl', 'INFO') as logs:
      summary = loop.train_and_evaluate(settings_lib.parse(config), workdir)
    taken = summary['private_steps']
    # Skipped as in ordinary training: the dynamic scale backed off.
    self.assertGreater(summary['skipped_steps'], 0)
    self.assertLess(summary['final_loss_scale'], 2.0**16)
    self.assertEqual(taken, 6 - summary['skipped_steps'])
    from jax_privacy import accounting  # pylint: disable=g-import-not-at-top
    direct = lambda steps: accounting.DpsgdTrainingAccountant(
        accounting.PldAccountantConfig()).compute_epsilon(
            steps, accounting.DpParams(noise_multipliers=1.3, num_samples=200,
                                       delta=1e-5, batch_size=8))
    self.assertEqual(summary['epsilon'], direct(taken))
    self.assertLess(summary['epsilon'], direct(6))
    with open(os.path.join(workdir, 'summary.json')) as f:
      self.assertEqual(json.load(f)['epsilon'], summary['epsilon'])
    events = _read_jsonl(workdir)
    for event in events:
      if event['split'] == 'train':
        skipped = event['skipped_steps']
        self.assertEqual(event['epsilon'],
                         direct(event['step'] - skipped) if
                         event['step'] > skipped else 0.0)
        self.assertContainsSubset({'num_examples', 'example_grad_norm',
                                   'clipped_fraction'}, set(event))
    val = [e for e in events if e['split'] == 'val']
    self.assertEqual([e['step'] for e in val], [3, 6])
    self.assertEqual(val[-1]['epsilon'], summary['epsilon'])
    self.assertTrue(any(re.search(r'step 6/6 .* eps [\d.]+ \|', line)
                        for line in logs.output))
    self.assertTrue(any('DP-SGD: clip 1, noise multiplier 1.3' in line
                        for line in logs.output))


@helpers.long_running
class LaunchTrainTest(parameterized.TestCase):

  def _run(self, workdir, *flags, fresh=False):
    """`launch.train`; `fresh`: in a new interpreter, as a user starts it
    (its console as they see it), not forked from one with its libraries
    imported (`helpers.run_module`)."""
    args = ['--config=configs/vit_fp16.py', f'--workdir={workdir}',
            '--config.data.source=synthetic', *flags]
    if fresh:
      return subprocess.run([sys.executable, '-m', 'launch.train', *args],
                            cwd=ROOT, capture_output=True, text=True)
    return helpers.run_module('launch.train', *args)

  def test_train_from_the_command_line_with_a_readable_console(self):
    workdir = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                           'run')
    result = self._run(workdir, *CLI_TINY, fresh=True)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertTrue(os.path.exists(os.path.join(workdir, 'summary.json')))
    # The first window (one step, right after the start) has a real rate.
    first = _read_jsonl(workdir)[0]
    self.assertEqual((first['split'], first['step']), ('train', 1))
    self.assertGreater(first['images_per_sec'], 0)
    # The console: the run's own lines, not its libraries' INFO chatter.
    err = result.stderr
    sources = {m.group(2) for m in map(LOG_LINE.match, err.splitlines())
               if m and m.group(1) == 'I'}
    self.assertContainsSubset({'train.py', 'loop.py', 'checkpoint.py'},
                              sources)
    self.assertContainsSubset(sources, OWN_FILES)  # No orbax, JAX, ... INFO.
    for expected in ('Config: configs/vit_fp16.py --config.data.source=',
                     'Data (synthetic): train 64, val 10, test 10 in memory',
                     'Devices: ', half_dot.matmuls_line(
                         'auto', ['float16'], jax.default_backend()),
                     'Model: 16 modules, ',
                     f'; every module: {workdir}/modules.txt',
                     'Compiled the train step',
                     'step 1/4 [25%]', 'ETA', 'step 4/4', 'val at step 4:',
                     'test at step 4:', 'Saved checkpoint ',
                     '/checkpoints/4 (', 'Summary: test ',
                     f'. Every figure: {workdir}/summary.json'):
      self.assertIn(expected, err)
    self.assertNotIn("'images_per_sec':", err)  # No raw dict of the summary.
    self.assertNotIn('before training went on', err)  # None follows.
    self.assertNotIn('oneDNN', err)
    self.assertNotIn('Metadata', err)  # orbax has a checkpoint.py too.
    self.assertNotIn('config.json', err)  # Named before it was written.
    # The module table: in the workdir, not on the console.
    self.assertNotIn('Modules:', err)
    with open(os.path.join(workdir, 'modules.txt')) as f:
      table = f.read()
    self.assertIn('vit/encoder_block_0/mlp_block/fc1', table)
    # Every library's INFO lines and the table are one flag away.
    verbose = self._run(f'{workdir}_verbose', *CLI_TINY, '--verbosity=1',
                        '--modules_table')
    self.assertIn('checkpoint_manager.py', verbose.stderr)
    self.assertIn('Modules:\n' + table.rstrip('\n'), verbose.stderr)

  @parameterized.parameters(
      ('--config.precision.policy=p=f32,c=f12', 'precision.policy'),
      ('--config.precision.overrides=*/nothing:f32', "'*/nothing'"),
      ('--config.loss_scale.kind=dynamc', 'loss_scale.kind'),
      ('--config.batch_size=0', 'batch_size=0'),
      ('--config.data.source=imagenet', 'data.source'))
  def test_bad_input_one_line_error_and_no_workdir(self, flag, message):
    workdir = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                           'run')
    result = self._run(workdir, flag)
    self.assertNotEqual(result.returncode, 0)
    last_line = result.stderr.strip().splitlines()[-1]
    self.assertTrue(last_line.startswith('error: '), last_line)
    self.assertIn(message, last_line)
    self.assertNotIn('Traceback', result.stderr)
    self.assertFalse(os.path.exists(workdir))

  @parameterized.named_parameters(
      ('is_a_file', '', 'is a file, not a directory'),
      ('under_a_file', 'run/deeper', 'is not writable (Not a directory: '))
  def test_workdir_that_cannot_be_written_stops_before_the_data(
      self, below, message):
    blocker = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                           'a_file')
    with open(blocker, 'w') as f:
      f.write('not a directory')
    workdir = os.path.join(blocker, below) if below else blocker
    # TFDS data that is not there, and may not be downloaded: the workdir's
    # error comes first, before the data is even looked for.
    result = self._run(workdir, '--config.data.source=tfds',
                       f'--config.data.data_dir={blocker}_data',
                       '--config.data.download=false')
    self.assertEqual(result.returncode, 2, result.stderr[-3000:])
    self.assertEqual(result.stderr.strip().splitlines()[-1],
                     f'error: --workdir={workdir} {message}'
                     + (f'{blocker})' if below else ''))
    self.assertNotIn('Data (', result.stderr)  # Not loaded first.

  def test_arrays_run_needs_no_tensorflow(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    rng = np.random.default_rng(0)
    arrays = {f'{s}_image': rng.integers(0, 256, (n, 32, 32, 3), np.uint8)
              for s, n in (('train', 40), ('test', 10))}
    arrays.update({f'{s}_label': rng.integers(0, 10, n).astype(np.int32)
                   for s, n in (('train', 40), ('test', 10))})
    path = os.path.join(tmp, 'cifar10.npz')
    npz_source.save(path, arrays)
    workdir = os.path.join(tmp, 'run')
    result = helpers.run_module(
        'tests.without_modules', 'tensorflow,tensorflow_datasets',
        'launch.train', '--config=configs/vit_bf16.py', f'--workdir={workdir}',
        '--config.data.source=arrays', f'--config.data.arrays_path={path}',
        '--config.data.train_split=train[:30]',
        '--config.data.val_split=train[30:]', '--config.model.patch_size=8',
        *CLI_TINY)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    events = _read_jsonl(workdir)
    self.assertEqual([(e['split'], e['num_examples']) for e in events
                      if e['split'] in ('val', 'test')],
                     [('val', 10), ('test', 10)])

  def test_unknown_config_key_fails(self):
    result = self._run('unused', '--config.batch_sise=3')
    self.assertNotEqual(result.returncode, 0)
    self.assertIn('batch_sise', result.stderr)


if __name__ == '__main__':
  absltest.main()
