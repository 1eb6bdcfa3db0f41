"""Checkpoints: exact resume after SIGKILL, SIGTERM, corrupt and foreign ones."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import asyncio
import atexit
import contextlib
import gc
import glob
import json
import logging
import shutil
import signal
import tempfile
import threading
from unittest import mock
import warnings

from absl import logging as absl_logging
from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from haiku_mp import errors
from haiku_mp.update import loss_scaling
from haiku_mp.update import param_updates
from haiku_mp.update import train_state
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import checkpoint
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import loop
from haiku_mp.vit.train import run_dir
from launch import failed_saves
from tests import disk_full_at_step
from tests import helpers
from tests import signal_at_step

HALF, TOTAL = 20, 40
BATCH = 16


def _flags(config, workdir, every=HALF):
  return [f'--config={config}', f'--workdir={workdir}',
          '--config.data.source=synthetic', f'--config.num_train_steps={TOTAL}',
          '--config.log_every_steps=1', f'--config.eval_every_steps={TOTAL}',
          f'--config.checkpoint_every_steps={every}', f'--config.batch_size={BATCH}',
          '--config.eval_batch_size=16',
          '--config.data.synthetic_eval_examples=16',
          # Epochs of 10 steps: the runs resume across their boundaries.
          f'--config.data.synthetic_train_examples={10 * BATCH}',
          *helpers.TINY_MODEL_FLAGS]


def _run(flags, signal_at=None, disk_full_at=None):
  """Runs launch.train to its end on one device; `signal_at` ('KILL:23')
  interrupts it, `disk_full_at` (a step, '30+close': orbax's closing fails
  too) leaves no room for that step's checkpoint."""
  env, module = {}, 'launch.train'
  if signal_at:
    env[signal_at_step.ENV] = signal_at
    module = 'tests.signal_at_step'
  if not disk_full_at:
    return helpers.run_module(module, *flags, devices=1, env=env, timeout=300)
  env[disk_full_at_step.ENV] = str(disk_full_at)
  # The file size limit that stands for the full disk would also cut the
  # compilation cache's writes short, leaving partial entries in a cache
  # other runs read: this run reads and writes a copy of its own.
  cache_flag = '--config.compilation_cache_dir='
  [shared] = [f[len(cache_flag):] for f in flags if f.startswith(cache_flag)]
  with tempfile.TemporaryDirectory() as own:
    shutil.copytree(shared, f'{own}/cache')
    flags = [f for f in flags if not f.startswith(cache_flag)]
    env['JAX_COMPILATION_CACHE_DIR'] = f'{own}/cache'
    return helpers.run_module('tests.disk_full_at_step', *flags,
                              f'{cache_flag}{own}/cache', devices=1, env=env,
                              timeout=300)


def _train_events(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [e for e in map(json.loads, f) if e['split'] == 'train']


def _tiny_state(width):
  params = {'linear': {'w': jnp.ones((3, width)), 'b': jnp.zeros((width,))}}
  return train_state.init_train_state(
      params, optax.adam(1e-3), loss_scaling.LossScaler('dynamic'),
      jax.random.key(0))


def _digest(directory):
  """Every file under `directory`: {relative path: bytes}."""
  files = {}
  for path in sorted(glob.glob(f'{directory}/**', recursive=True)):
    if os.path.isfile(path):
      with open(path, 'rb') as f:
        files[os.path.relpath(path, directory)] = f.read()
  return files


def _read_json(path):
  with open(path) as f:
    return json.load(f)


def _error_lines(stderr):
  return [line for line in stderr.splitlines() if line.startswith('error:')]


@helpers.long_running
class InterruptTest(parameterized.TestCase):
  """Ctrl-C, SIGTERM, a full disk, a corrupt checkpoint, a re-run: each ends
  with the run an uninterrupted one would have been, and loses nothing."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    cls.straight = f'{cls._tmp.name}/straight'
    # The class's runs share a compilation cache of their own
    # (config.compilation_cache_dir) that keeps what the suite's keeps
    # (`tests`: programs of 0.1 s and more): the straight run compiles the
    # train step, and every later start, a resume included, loads it.
    cls.cache = f'--config.compilation_cache_dir={cls._tmp.name}/cache'
    proc = _run([*_flags('configs/vit_fp16.py', cls.straight), cls.cache])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'loaded from the compilation cache' not in proc.stderr

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    self.workdir = os.path.join(
        self.enter_context(tempfile.TemporaryDirectory()), 'run')
    self.flags = [*_flags('configs/vit_fp16.py', self.workdir, every=10),
                  self.cache]

  def _assert_finishes_as_the_straight_run(self, resumed_at):
    proc = _run(self.flags)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertIn(f'at step {resumed_at}.', proc.stderr)
    # A fresh and a resumed run lower the same program: one cache entry.
    self.assertRegex(proc.stderr, r'Compiled the train step for a batch of '
                     rf'{BATCH} in .*, loaded from the compilation cache\)')
    self.assertNotIn('Metadata file does not exist', proc.stderr)
    events = _train_events(self.workdir)
    self.assertEqual([e['step'] for e in events], list(range(1, TOTAL + 1)))
    self.assertEqual([e['loss'] for e in events],
                     [e['loss'] for e in _train_events(self.straight)])
    chex.assert_trees_all_equal(_raw_checkpoint(self.workdir, TOTAL),
                                _raw_checkpoint(self.straight, TOTAL))
    self.assertEqual(helpers.tensorboard_scalars(f'{self.workdir}/tensorboard'),
                     helpers.jsonl_scalars(self.workdir))
    return proc, events

  def _assert_stopped_at_7_by(self, name, code, by, arrival):
    proc = _run(self.flags, signal_at=f'{name}:7')
    self.assertEqual(proc.returncode, code, proc.stderr[-3000:])
    self.assertIn(arrival, proc.stderr)  # As it arrives, before the save.
    self.assertLess(proc.stderr.index(arrival),
                    proc.stderr.index('saved a checkpoint at step 7'))
    self.assertIn(f'{by}: saved a checkpoint at step 7; stopping. Run the '
                  'same command to resume.', proc.stderr)
    self.assertNotIn('Traceback', proc.stderr)
    self.assertEqual(os.listdir(f'{self.workdir}/checkpoints'),
                     ['7'])  # The step the signal arrived in; no more ran.
    self.assertLen(_train_events(self.workdir), 7)
    self.assertFalse(os.path.exists(f'{self.workdir}/summary.json'))

  def test_ctrl_c_saves_and_stops(self):
    # Its checkpoint is SIGTERM's (below, resumed exactly).
    self._assert_stopped_at_7_by(
        'INT', 130, 'Ctrl-C (SIGINT)', 'Ctrl-C: finishing the steps under '
        'way, then saving a checkpoint (Ctrl-C again stops at once, without '
        'saving).')

  def test_sigterm_saves_and_the_resumed_run_is_exact(self):
    self._assert_stopped_at_7_by(
        'TERM', 0, 'SIGTERM', 'SIGTERM: finishing the steps under way, then '
        'saving a checkpoint and stopping.')
    _, events = self._assert_finishes_as_the_straight_run(resumed_at=7)
    # The first window after the start and after the resume: one step each,
    # with a real rate (compilation happens before it).
    self.assertGreater(events[0]['images_per_sec'], 0)
    self.assertGreater(events[7]['images_per_sec'], 0)
    # The summary covers both segments: with a window per step, the train
    # time is the sum of every window's (and of the log writes after the
    # last window of each segment, a millisecond or two), the rate the
    # run's mean.
    summary = _read_json(f'{self.workdir}/summary.json')
    windows = sum(BATCH / e['images_per_sec'] for e in events)
    self.assertAlmostEqual(summary['train_time_sec'], windows,
                           delta=1e-2 * windows)
    self.assertAlmostEqual(summary['images_per_sec'],
                           TOTAL * BATCH / summary['train_time_sec'], places=6)
    self.assertGreater(summary['eval_time_sec'], 0)
    straight = _read_json(f'{self.straight}/summary.json')
    for key in ('val_accuracy', 'val_loss', 'test_accuracy', 'test_loss',
                'steps', 'skipped_steps', 'final_loss_scale'):
      self.assertEqual(summary[key], straight[key], key)

  def _assert_killed_at(self, step, flush, resumed_at=None):
    proc = _run(self.flags, signal_at=f'KILL:{step}{flush}')
    self.assertEqual(proc.returncode, -signal.SIGKILL, proc.stderr[-3000:])
    if resumed_at:
      self.assertIn(f'at step {resumed_at}.', proc.stderr)
    checkpoints = [str(s) for s in range(10, step, 10)]
    self.assertEqual(sorted(os.listdir(f'{self.workdir}/checkpoints')),
                     checkpoints)
    self.assertEqual([e['step'] for e in _train_events(self.workdir)],
                     list(range(1, step + 1)))

  def test_sigkill_flushed_or_not_and_an_unrestorable_checkpoint(self):
    """One run killed twice, 3 steps past a checkpoint each time, its newest
    checkpoint then truncated, then run to its end and run once more: it
    ends as the straight run did, and the run again changes nothing.

    A kill's metrics.jsonl events must not be there twice after the resume.
    Its TensorBoard points are lost with the process (the first kill), or on
    disk (flushed, as the writer's background flush may have done: the
    second): then they must not show twice either."""
    self._assert_killed_at(13, '')
    self._assert_killed_at(23, '+flush', resumed_at=10)
    for path in glob.glob(f'{self.workdir}/checkpoints/20/**', recursive=True):
      if os.path.isfile(path):
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 2)
    broken = _digest(f'{self.workdir}/checkpoints/20')
    proc, _ = self._assert_finishes_as_the_straight_run(resumed_at=10)
    warning = next(line for line in proc.stderr.splitlines()
                   if 'cannot be restored' in line)
    self.assertIn('/checkpoints/20 cannot be restored (unreadable: ', warning)
    self.assertNotIn('<bound method', warning)
    # Kept, renamed, for a user who wants it; step 20 saved anew.
    self.assertEqual(_digest(f'{self.workdir}/checkpoints/20.unrestorable'),
                     broken)
    self.assertIn(f'Saved checkpoint {self.workdir}/checkpoints/20 (',
                  proc.stderr)
    # The same command on the finished run (its compilation cache aside: it
    # changes how a run gets its programs, not what it computes).
    before = _digest(self.workdir)
    proc = _run(_flags('configs/vit_fp16.py', self.workdir, every=10))
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertIn('This run is complete (step 40 of 40): nothing to do. Its '
                  f'summary: {self.workdir}/summary.json', proc.stderr)
    self.assertNotIn('Compiled', proc.stderr)
    self.assertNotIn('Data (', proc.stderr)  # Not even loaded.
    self.assertEqual(_digest(self.workdir), before)

  def test_a_second_ctrl_c_stops_at_once_without_saving(self):
    proc = _run(self.flags, signal_at='INT:12+again')
    self.assertEqual(proc.returncode, 130, proc.stderr[-3000:])
    self.assertNotIn('Traceback', proc.stderr)
    self.assertEqual(
        [line for line in proc.stderr.splitlines() if 'Ctrl-C' in line][-1],
        'interrupted: a second Ctrl-C: stopped at once, without saving; the '
        'newest checkpoint is kept')
    # Step 12's save never began: the newest checkpoint, the one a resume
    # starts from (as the other tests' resumes do), is step 10's.
    self.assertEqual(os.listdir(f'{self.workdir}/checkpoints'), ['10'])

  def test_a_full_disk_is_one_line_and_the_next_run_resumes(self):
    # A full disk also fails orbax's closing (its metadata writes): an error
    # of orbax on the main thread, after the save's. It replaced the save's
    # error, and the hooks that hide a failed save's threads hid it too: the
    # run ended with status 1 and not a line (1 of 8 runs on a small tmpfs).
    proc = _run(self.flags, disk_full_at='30+close')
    self.assertEqual(proc.returncode, 1, proc.stderr[-3000:])
    self.assertNotIn('Traceback', proc.stderr)
    self.assertNotIn('Event loop is closed', proc.stderr)
    error_lines = _error_lines(proc.stderr)
    self.assertEqual(
        [line.split(' (')[0] for line in error_lines],
        [f'error: --workdir={self.workdir}: could not save the checkpoint of '
         'step 30'])
    self.assertIn('the last good checkpoint is step 20', error_lines[0])
    self.assertLess(len(proc.stderr.splitlines()), 60,  # Not 1,381 lines.
                    proc.stderr[-3000:])
    # The write fails in the background; the next log point finds it, a step
    # or a few later, and stops the run there.
    steps = [e['step'] for e in _train_events(self.workdir)]
    self.assertEqual(steps, list(range(1, len(steps) + 1)))
    self.assertBetween(len(steps), 30, TOTAL)
    self.assertEqual(helpers.tensorboard_scalars(f'{self.workdir}/tensorboard'),
                     helpers.jsonl_scalars(self.workdir))
    self._assert_finishes_as_the_straight_run(resumed_at=20)

  def test_a_config_json_edited_by_hand_is_named_not_silently_rewritten(self):
    shutil.copytree(self.straight, self.workdir)
    config_json = f'{self.workdir}/config.json'
    saved = _read_json(config_json)
    with open(config_json, 'w') as f:
      json.dump(dict(saved, label_smoothing=0.1), f)
    proc = _run([*_flags('configs/vit_fp16.py', self.workdir), self.cache])
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertIn(f'{config_json} differs from this command\'s config '
                  "(label_smoothing 0.1 -> 0.0): this command's settings "
                  'apply from step 40 on, and config.json now holds them.',
                  proc.stderr)
    self.assertEqual(_read_json(config_json), saved)


def _raw_checkpoint(workdir, step):
  """A checkpoint as orbax reads it back without a target: nested arrays."""
  path = os.path.join(workdir, 'checkpoints', str(step), 'default')
  return ocp.StandardCheckpointer().restore(path)


class CheckpointerTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.workdir = self.enter_context(tempfile.TemporaryDirectory())
    # Each Checkpointer is closed (its save in flight finished) before the
    # directory goes.
    checkpointer = checkpoint.Checkpointer
    self.enter_context(mock.patch.object(
        checkpoint, 'Checkpointer', lambda *args, **kwargs: self.enter_context(
            contextlib.closing(checkpointer(*args, **kwargs)))))

  def test_keeps_the_last_k_and_restores_exactly(self):
    ckpt = checkpoint.Checkpointer(self.workdir, keep=2)
    state = _tiny_state(4)
    # A loss scale mid-run: counters and the hysteresis left are restored too.
    state = state._replace(loss_scale=loss_scaling.LossScaleState(
        jnp.float32(512.0), jnp.int32(7), jnp.int32(1), jnp.int32(2)))
    for step in (1, 2, 3):
      ckpt.save(step, state._replace(step=jnp.asarray(step)))
    self.assertEqual(ckpt.all_steps(), [2, 3])
    step, restored = ckpt.restore_latest(jax.eval_shape(lambda: state))
    self.assertEqual((step, int(restored.step)), (3, 3))
    chex.assert_trees_all_equal(restored.params, state.params)
    chex.assert_trees_all_equal(jax.random.key_data(restored.rng),
                                jax.random.key_data(state.rng))
    chex.assert_trees_all_equal(restored.loss_scale, state.loss_scale)

  def test_half_params_and_their_master_copy_restore_exactly(self):
    params = {'w': jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(2, 3)}
    optimizer = param_updates.float32_master(optax.adam(1e-3))
    state = train_state.init_train_state(
        jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), optimizer,
        loss_scaling.LossScaler('none'), jax.random.key(0))
    state = state._replace(opt_state=state.opt_state._replace(
        master={'w': params['w'] + 1e-4}))  # Not representable in bfloat16.
    ckpt = checkpoint.Checkpointer(self.workdir, keep=1)
    ckpt.save(1, state)
    _, restored = ckpt.restore_latest(jax.eval_shape(lambda: state))
    self.assertEqual(restored.params['w'].dtype, jnp.bfloat16)
    chex.assert_trees_all_equal(restored.opt_state, state.opt_state)
    chex.assert_trees_all_equal(restored.params, state.params)

  def test_corrupt_latest_falls_back_to_the_previous(self):
    ckpt = checkpoint.Checkpointer(self.workdir, keep=3)
    state = _tiny_state(4)
    ckpt.save(1, state._replace(step=jnp.asarray(1)))
    ckpt.save(2, state._replace(step=jnp.asarray(2)))
    ckpt.wait()  # Its files are written in the background.
    for path in glob.glob(f'{ckpt.directory}/2/**/*', recursive=True):
      if os.path.isfile(path):
        with open(path, 'wb') as f:
          f.write(b'garbage')
    with self.assertLogs(level='WARNING') as logs:
      step, restored = ckpt.restore_latest(jax.eval_shape(lambda: state))
    self.assertEqual((step, int(restored.step)), (1, 1))
    self.assertIn('cannot be restored', '\n'.join(logs.output))

  def test_an_unrestorable_step_is_set_aside_when_asked_and_saved_again(self):
    ckpt = checkpoint.Checkpointer(self.workdir, keep=3)
    state = _tiny_state(4)
    ckpt.save(1, state._replace(step=jnp.asarray(1)), dict(train_sec=1.5))
    ckpt.save(2, state._replace(step=jnp.asarray(2)), dict(train_sec=3.0))
    ckpt.wait()  # Its files are written in the background.
    for path in glob.glob(f'{ckpt.directory}/2/**/*', recursive=True):
      if os.path.isfile(path):
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 2)
    abstract = jax.eval_shape(lambda: state)
    before = _digest(ckpt.directory)
    step, _ = ckpt.restore_latest(abstract)  # A reader (the advisor).
    self.assertEqual(step, 1)
    self.assertEqual(_digest(ckpt.directory), before)
    step, _ = ckpt.restore_latest(abstract, set_aside_unrestorable=True)
    self.assertEqual((step, ckpt.all_steps()), (1, [1]))
    self.assertEqual(ckpt.run_record(1), dict(train_sec=1.5))
    self.assertEqual(
        {p.replace('2.unrestorable/', '2/'): v for p, v in
         _digest(ckpt.directory).items()}, before)
    ckpt.save(2, state._replace(step=jnp.asarray(2)), dict(train_sec=2.5))
    step, restored = ckpt.restore_latest(abstract)
    self.assertEqual((step, int(restored.step)), (2, 2))
    self.assertEqual(ckpt.run_record(2), dict(train_sec=2.5))

  def test_a_failed_save_is_one_error_and_what_it_leaves_prints_nothing(self):
    """The checkpointer raises one error and touches no hook; the commands'
    console (`failed_saves.silenced`, entered here as `cli.run` enters it)
    drops what the failed writes leave, and gives the hooks back."""
    owners = ((sys, 'excepthook'), (sys, 'unraisablehook'),
              (threading, 'excepthook'))
    loggers = (logging.getLogger('asyncio'), absl_logging.get_absl_logger())
    found = lambda: ([getattr(o, n) for o, n in owners],
                     [list(l.filters) for l in loggers], list(warnings.filters))
    before = found()
    # orbax does not wait for the rest of a failed save's TensorStore writes:
    # given room back, some still create files in the checkpoint's temporary
    # folder after it has closed (a run stops then, and they stop with it).
    # Removed at the end of the test, the folder could gain a file between
    # two of rmtree's steps (once in a dozen suite runs); it goes with the
    # process instead.
    workdir = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    ckpt = checkpoint.Checkpointer(workdir, keep=3)
    # Random params: files that do not compress to nothing.
    state = train_state.init_train_state(
        {'w': jax.random.normal(jax.random.key(1), (8, 1024))},
        optax.adam(1e-3), loss_scaling.LossScaler('dynamic'),
        jax.random.key(0))
    ckpt.save(1, state)
    ckpt.wait()
    self.assertEqual(found(), before)
    with failed_saves.silenced():
      give_room_back = disk_full_at_step.leave_no_room(ckpt.directory)
      try:
        with self.assertRaisesRegex(
            errors.RunError, 'could not save the checkpoint of step 2 .*the '
            'last good checkpoint is step 1'):
          ckpt.save(2, state._replace(step=jnp.asarray(2)))
          ckpt.wait()
      finally:
        give_room_back()
      # What TensorStore's writes leave once orbax has closed its event loop
      # (seen in a full-disk run's output): futures whose exception was set,
      # never raised (no traceback), and never retrieved; coroutines never
      # awaited. Freed later, at any time, they print nothing.
      loop = asyncio.new_event_loop()
      future = loop.create_future()
      future.set_exception(ValueError('OUT_OF_RANGE: Error writing "rng/0"'))
      coroutine = asyncio.sleep(0)
      with self.assertNoLogs('asyncio'), \
          warnings.catch_warnings(record=True) as shown:
        del future, coroutine
        gc.collect()
      loop.close()
      self.assertEqual([str(w.message) for w in shown], [])
    self.assertEqual(found(), before)

  def test_a_save_keeps_the_state_the_next_step_donates(self):
    # The save returns once the state is off the device; the next train step
    # then donates the state's buffers and writes over them while the files
    # are still being written. The checkpoint holds the state as it was.
    state = _tiny_state(4)
    state = state._replace(params=jax.tree.map(
        lambda p: jax.random.normal(jax.random.key(1), p.shape), state.params))
    # A copy on the host (not a view of the device's buffers, which
    # would keep the step from donating them).
    expected = jax.tree.map(np.array, _storable(state))
    step = jax.jit(lambda s: s._replace(
        step=s.step + 1, params=jax.tree.map(lambda p: -p - 1, s.params),
        opt_state=jax.tree.map(lambda x: x + 1, s.opt_state),
        rng=jax.random.split(s.rng)[0]), donate_argnums=0)
    ckpt = checkpoint.Checkpointer(self.workdir, keep=1)
    ckpt.save(1, state)
    after = jax.block_until_ready(step(state))
    self.assertNotEqual(int(after.step), int(expected.step))
    _, restored = ckpt.restore_latest(jax.eval_shape(lambda: after))
    chex.assert_trees_all_equal(_storable(restored), expected)

  def test_a_failed_saves_leftovers_are_not_restored_and_it_saves_again(self):
    # What a failed save leaves (its temporary folder, files half written)
    # is no step: a resume takes the last good one, and saves that step anew.
    ckpt = self.enter_context(contextlib.closing(
        checkpoint.Checkpointer(self.workdir, keep=3)))
    state = _tiny_state(4)
    ckpt.save(1, state._replace(step=jnp.asarray(1)))
    ckpt.wait()
    # The temporary folder of step 2's failed save, half written.
    leftover = f'{ckpt.directory}/2{ocp.path.atomicity.TMP_DIR_SUFFIX}'
    shutil.copytree(f'{ckpt.directory}/1', leftover)
    for path in glob.glob(f'{leftover}/**/*', recursive=True):
      if os.path.isfile(path):
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 2)
    resumed = self.enter_context(contextlib.closing(  # A new run's.
        checkpoint.Checkpointer(self.workdir, keep=3)))
    step, restored = resumed.restore_latest(jax.eval_shape(lambda: state))
    self.assertEqual((step, int(restored.step), resumed.all_steps()),
                     (1, 1, [1]))
    resumed.save(2, state._replace(step=jnp.asarray(2)))
    step, restored = resumed.restore_latest(jax.eval_shape(lambda: state))
    self.assertEqual((step, int(restored.step)), (2, 2))
    self.assertFalse(os.path.exists(leftover))

  def test_a_log_window_comes_back_from_the_run_record_as_it_was(self):
    # The host metrics of the steps since the last log point, as a resumed
    # run's first log window reads them: a skipped step's NaN and inf, its
    # flags per gradient leaf, float32 values summarized bit for bit.
    window = [dict(loss=np.float32(2.3025851), accuracy=np.float32(0.0625),
                   grad_norm=np.float32(np.inf),
                   updates_lost=np.float32(np.nan),
                   loss_scale=np.float32(32768.0), grads_finite=np.bool_(False),
                   nonfinite_grads=np.array([True, False]),
                   consecutive_skips=np.int32(1), skipped_steps=np.int32(1)),
              dict(loss=np.float32(2.3011513), accuracy=np.float32(0.125),
                   grad_norm=np.float32(1.1681389),
                   updates_lost=np.float32(-3.5762787e-07),
                   loss_scale=np.float32(16384.0), grads_finite=np.bool_(True),
                   nonfinite_grads=np.array([False, False]),
                   consecutive_skips=np.int32(0), skipped_steps=np.int32(1))]
    ckpt = checkpoint.Checkpointer(self.workdir, keep=1)
    ckpt.save(1, _tiny_state(4), dict(
        train_sec=1.5, log_window=run_dir.window_record(window)))
    record = ckpt.run_record(1)  # Read back from its file.
    restored = run_dir.window_from_record(record['log_window'])
    means = ('loss', 'accuracy', 'grad_norm', 'updates_lost')
    np.testing.assert_equal(run_dir.window_summary(restored, means),
                            run_dir.window_summary(window, means))
    jax.tree.map(np.testing.assert_array_equal, restored, window)
    # Steps saved by a run without a metric this one has (DP-SGD turned on
    # at the resume, say): it is averaged over the steps that have it.
    summary = run_dir.window_summary(
        [*restored, dict(window[1], clipped_fraction=np.float32(0.25))],
        (*means, 'clipped_fraction'))
    self.assertEqual(summary['clipped_fraction'], 0.25)

  def test_the_logged_save_time_excludes_the_steps_still_queued(self):
    calls = []

    def clock():
      calls.append('clock')
      return float(len(calls))

    ckpt = checkpoint.Checkpointer(
        self.workdir, keep=3, clock=clock,
        ready=lambda x: (calls.append('ready'), x)[1])
    ckpt.save(1, _tiny_state(4))
    # The state made ready before the save's clock starts: the steps still
    # queued are not the save's time.
    self.assertEqual(calls, ['ready', 'clock', 'clock'])
    with self.assertLogs(level='INFO') as logs:
      ckpt.wait()
    self.assertRegex('\n'.join(logs.output), r'Saved checkpoint .*/1 \(')

  def test_checkpoint_of_another_model_is_a_clear_error(self):
    with contextlib.closing(checkpoint.Checkpointer(self.workdir, 3)) as other:
      other.save(1, _tiny_state(4))
    ckpt = checkpoint.Checkpointer(self.workdir, keep=3)
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                'no checkpoint in .*checkpoints can be restored'):
      ckpt.restore_latest(jax.eval_shape(lambda: _tiny_state(5)))

  def test_no_checkpoint(self):
    ckpt = checkpoint.Checkpointer(self.workdir, keep=3)
    self.assertIsNone(ckpt.restore_latest(jax.eval_shape(
        lambda: _tiny_state(4))))


def _off_the_log_grid_config():
  """tests/application/loop_test.py's run (its programs are in the compilation cache):
  12 steps, logged every 4, checkpointed every 6, float16 with dynamic loss
  scaling. Step 6's checkpoint is no log point: the steps 5 and 6 it
  covers are in the log window of step 8."""
  config = helpers.tiny_config(
      'params=float32,compute=float16,output=float32', loss_scale='dynamic')
  config.batch_size, config.eval_batch_size = 8, 16
  config.num_train_steps, config.log_every_steps = 12, 4
  config.eval_every_steps = config.checkpoint_every_steps = 6
  config.data.source = 'synthetic'
  config.data.synthetic_train_examples = 64
  config.data.synthetic_eval_examples = 16
  return config


class ResumedLogTest(absltest.TestCase):

  def test_a_resume_off_the_log_grid_logs_the_uninterrupted_windows(self):
    # A full disk at step 12's save (after its log and evaluation: until
    # then the run is an uninterrupted one), then a resume from step 6. Its
    # log window at step 8 averaged steps 7 and 8 only, not 5 to 8: one
    # logged loss differed (issue 48's runs, whose disk filled a checkpoint
    # later under load, at one off the log grid), every step's the same.
    workdir = self.enter_context(tempfile.TemporaryDirectory())
    config = _off_the_log_grid_config()
    save = checkpoint.Checkpointer.save

    def no_room_at_12(self, step, *args, **kwargs):
      if step == 12:
        raise errors.RunError('could not save the checkpoint of step 12')
      return save(self, step, *args, **kwargs)

    with mock.patch.object(checkpoint.Checkpointer, 'save', no_room_at_12), \
        self.assertRaisesRegex(errors.RunError, 'step 12'):
      loop.train_and_evaluate(settings_lib.parse(config), workdir)
    uninterrupted = _train_events(workdir)
    self.assertEqual([e['step'] for e in uninterrupted], [4, 8, 12])
    with self.assertLogs(level='INFO') as logs:
      loop.train_and_evaluate(settings_lib.parse(config), workdir)
    self.assertIn(f'{workdir}/checkpoints at step 6.', '\n'.join(logs.output))
    resumed = _train_events(workdir)
    for event in (*uninterrupted, *resumed):
      del event['images_per_sec']  # A rate: each run's own.
    self.assertEqual(resumed, uninterrupted)


def _layout_config(update='master', mu='float32', nu='float32'):
  """The tiny model in bfloat16 with clipping, decay and an average, as the
  fixture `tests/data/checkpoint_before_layouts` was saved with."""
  config = helpers.tiny_config(
      'params=bfloat16,compute=bfloat16,output=float32')
  config.data.source = 'synthetic'
  config.weight_decay, config.grad_clip_norm, config.ema_decay = 0.05, 1.0, 0.5
  config.num_train_steps = 10
  config.model.patch_init = 'xavier_uniform'  # The init of its time.
  config.precision.update(param_update=update, mu_dtype=mu, nu_dtype=nu)
  return config


def _steps(exp, config, state, first, last):
  for step in range(first, last):
    batch = helpers.random_batch(config, 8, seed=step)
    state, _ = exp.strategy.train_step(state, exp.strategy.place_batch(batch))
  return state


@helpers.long_running
class StateLayoutCheckpointTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.workdir = self.enter_context(tempfile.TemporaryDirectory())

  # Every kind of state a layout adds, each in one step: the stochastic
  # rounding's draws and 8-bit moments (codes and block scales), the
  # compensation and bfloat16 nu, the master copy and bfloat16 mu. (Rounding
  # to nearest with float32 moments keeps no state that these do not.)
  @parameterized.parameters(('kahan', 'float32', 'bfloat16'),
                            ('master', 'bfloat16', 'float32'),
                            ('stochastic', 'float8_blocks', 'float8_blocks'))
  def test_a_resume_is_bit_exact(self, update, mu, nu):
    """Saved after 2 steps, restored, 2 more: the state 4 straight steps
    make, the stochastic rounding's draws and the compensation included."""
    config = _layout_config(update, mu, nu)
    exp = experiment.build(settings_lib.parse(config))
    straight = _steps(exp, config, exp.strategy.init_state(), 0, 4)
    with contextlib.closing(checkpoint.Checkpointer(self.workdir, 1)) as ckpt:
      ckpt.save(2, _steps(exp, config, exp.strategy.init_state(), 0, 2))
    with contextlib.closing(checkpoint.Checkpointer(self.workdir, 1)) as ckpt:
      step, restored = ckpt.restore_latest(exp.abstract_state)
    self.assertEqual(step, 2)
    resumed = _steps(exp, config, exp.strategy.place_state(restored), 2, 4)
    chex.assert_trees_all_equal(_storable(resumed),
                                _storable(straight))
    chex.assert_trees_all_equal_dtypes(resumed, straight)

  def _restore_fixture(self, config):
    """The fixture's step-2 checkpoint, restored as a run of `config` would,
    and the arrays it holds as orbax reads them back with no target."""
    shutil.copytree(os.path.join(helpers.ROOT, 'tests', 'data',
                                 'checkpoint_before_layouts'),
                    self.workdir, dirs_exist_ok=True)
    exp = experiment.build(settings_lib.parse(config))
    with contextlib.closing(checkpoint.Checkpointer(self.workdir, 1)) as ckpt:
      step, restored = ckpt.restore_latest(exp.abstract_state)
    self.assertEqual(step, 2)
    stored = ocp.StandardCheckpointer().restore(
        os.path.join(self.workdir, 'checkpoints', '2', 'default'))
    return exp, restored, stored

  def test_a_checkpoint_from_before_the_layouts_restores_and_goes_on(self):
    """Saved by the code before `precision.param_update` and the moment
    dtypes existed (two steps of `_layout_config()`): it restores into the
    default layout, every array equal to the one the fixture holds.

    The fixture is the two steps taken now, up to the rounding of the
    machine that saved it, and its run goes on from it.

    The fixture was computed on another CPU: XLA:CPU's code, and so its
    float32 rounding, differs between instruction sets (a Xeon's and an
    EPYC's mu differed by 1.2e-6 relative on elements that are sums with
    cancellation). Each leaf agrees within a few units in the last place
    of its dtype, measured against the leaf's largest element; a bfloat16
    param may round the other way where its float32 master sits on a tie.
    """
    config = _layout_config()
    exp, state, stored = self._restore_fixture(config)
    self.assertIsInstance(state.opt_state, param_updates.MasterState)
    restored, stored = _by_name(_storable(state)), _by_name(stored)
    self.assertSameElements(restored, stored)
    for name, array in restored.items():
      with self.subTest(name):
        chex.assert_trees_all_equal(array, stored[name])
        chex.assert_trees_all_equal_dtypes(array, stored[name])
    now = _by_name(_storable(
        _steps(exp, config, exp.strategy.init_state(), 0, 2)))
    self.assertSameElements(restored, now)
    for name, array in now.items():
      with self.subTest(name):
        chex.assert_trees_all_equal_dtypes(restored[name], array)
        if jnp.issubdtype(array.dtype, jnp.floating):
          largest = float(np.max(np.abs(np.asarray(array, np.float32))))
          ulp = float(jnp.finfo(array.dtype).eps) * largest
          chex.assert_trees_all_close(restored[name], array, rtol=0,
                                      atol=_FOREIGN_CPU_ULPS * ulp)
        else:
          chex.assert_trees_all_equal(restored[name], array)
    _steps(exp, config, exp.strategy.place_state(state), 2, 3)


# How far a leaf of the fixture may be from the same steps computed on
# another CPU, in units in the last place of the leaf's largest element: a
# gradient one unit off makes Adam's nu, its square, two off (1.4 seen on a
# Xeon against the EPYC's fixture); a different step would be far more.
_FOREIGN_CPU_ULPS = 4


def _by_name(tree) -> dict:
  """A tree's arrays by their path, as orbax names them ('a.b.0.c')."""
  return {'.'.join(str(getattr(k, 'name', getattr(k, 'key',
                                                  getattr(k, 'idx', k))))
                   for k in path): jnp.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _storable(state):
  return jax.device_get(state._replace(rng=jax.random.key_data(state.rng)))


if __name__ == '__main__':
  absltest.main()
