"""The library leaves the process alone: importing every module of
`haiku_mp`, saving and restoring a checkpoint (a failed save included),
drawing a plot, quieting the trainer or training a run change none of the
process's hooks, warnings filters, loggers, absl's verbosity, matplotlib
backend, jax's config or environment variables. A
program of one's own finds them as it left them; the commands own the
console (`launch/cli.py`, `launch/failed_saves.py`)."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import atexit
import importlib
import logging
import pkgutil
import shutil
import tempfile
import threading
import warnings

from absl import logging as absl_logging
from absl.testing import absltest
import jax
import jax.numpy as jnp
import matplotlib
import optax

import haiku_mp
from haiku_mp import errors
from haiku_mp.vit import settings as settings_lib
from launch import failed_saves
from tests import disk_full_at_step
from tests import helpers


def _process() -> dict:
  """What a library could change in the process, by identity and value."""
  loggers = [logging.getLogger()] + [
      logger for logger in logging.Logger.manager.loggerDict.values()
      if isinstance(logger, logging.Logger)]
  return dict(
      hooks=(sys.excepthook, sys.unraisablehook, threading.excepthook),
      warnings=list(warnings.filters),
      loggers={logger.name: (logger.level, list(logger.filters),
                             list(logger.handlers), logger.propagate)
               for logger in loggers},
      handler_filters={id(h): list(h.filters) for logger in loggers
                       for h in logger.handlers},
      # The backend as set, unresolved: resolving it would choose one.
      verbosity=absl_logging.get_verbosity(),
      backend=dict.__getitem__(matplotlib.rcParams, 'backend'),
      pyplot='matplotlib.pyplot' in sys.modules,
      jax_config=dict(jax.config.values),
      environ=dict(os.environ))


class ProcessAloneTest(absltest.TestCase):

  def test_imports_saves_and_plots_leave_the_process_as_found(self):
    before = _process()
    for module in pkgutil.walk_packages(haiku_mp.__path__, 'haiku_mp.'):
      importlib.import_module(module.name)
    # Modules imported for the first time may add loggers of their own (a
    # new name is no change to a logger the program had).
    before['loggers'] = {**_process()['loggers'], **before['loggers']}
    self._assert_as(_process(), before)

    from haiku_mp.vit.train import checkpoint  # pylint: disable=g-import-not-at-top
    from haiku_mp.lab import run_plots  # pylint: disable=g-import-not-at-top
    from haiku_mp.update import loss_scaling  # pylint: disable=g-import-not-at-top
    from haiku_mp.update import train_state  # pylint: disable=g-import-not-at-top
    workdir = tempfile.mkdtemp()
    # A failed save's writes may still land after it closed (checkpoint_test).
    atexit.register(shutil.rmtree, workdir, ignore_errors=True)
    state = train_state.init_train_state(
        {'w': jax.random.normal(jax.random.key(1), (8, 1024))},
        optax.adam(1e-3), loss_scaling.LossScaler('dynamic'),
        jax.random.key(0))
    ckpt = checkpoint.Checkpointer(workdir, keep=3)
    ckpt.save(1, state)
    ckpt.wait()
    abstract = jax.eval_shape(lambda: state)
    self.assertEqual(ckpt.restore_latest(abstract)[0], 1)
    # A failed save, inside the commands' console (which drops what its
    # threads print): the library changes nothing there either.
    with failed_saves.silenced():
      inside = _process()
      give_room_back = disk_full_at_step.leave_no_room(ckpt.directory)
      try:
        with self.assertRaises(errors.RunError):
          ckpt.save(2, state._replace(step=jnp.asarray(2)))
          ckpt.wait()
      finally:
        give_room_back()
      self._assert_as(_process(), inside)
    run_plots.plot_runs(
        {'run': [dict(step=1, split='train', loss=2.0, loss_scale=1.0),
                 dict(step=1, split='val', accuracy=0.5)]},
        os.path.join(workdir, 'runs.png'))
    self.assertTrue(os.path.exists(os.path.join(workdir, 'runs.png')))
    # The report's and the loop benchmark's quiet trainer: the library's own
    # state, not absl's verbosity.
    from haiku_mp.vit.train import console  # pylint: disable=g-import-not-at-top
    with console.quietly():
      self._assert_as(_process(), before)
    self._assert_as(_process(), before)

  def test_a_run_with_a_cache_of_its_own_leaves_jax_as_found(self):
    """A run's `compilation_cache_dir` holds for the run only: the
    caller's cache directory, and all of jax's config, are back after."""
    from haiku_mp.vit.train import loop  # pylint: disable=g-import-not-at-top
    config = helpers.tiny_run_config(steps=1, eval_batch_size=8,
                                     train_examples=16, eval_examples=8)
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    workdir = tmp.name
    config.compilation_cache_dir = os.path.join(workdir, 'cache')
    before = _process()
    loop.train_and_evaluate(settings_lib.parse(config),
                            os.path.join(workdir, 'run'))
    self.assertNotEmpty(os.listdir(config.compilation_cache_dir))
    self._assert_as(_process(), before)

  def _assert_as(self, after: dict, before: dict) -> None:
    """`after` as `before`, loggers made since left out."""
    after['loggers'] = {name: value for name, value in after['loggers'].items()
                        if name in before['loggers']}
    for part, found in before.items():
      self.assertEqual(after[part], found, part)


if __name__ == '__main__':
  absltest.main()
