"""The training loop: what it computes is a plain loop's, bit for bit, and it
never waits for the device between log points."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import contextlib
import json
import tempfile
import threading

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.vit.data import pipeline
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import checkpoint
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import loop
from tests import helpers

STEPS, LOG_EVERY, EVAL_EVERY, CHECKPOINT_EVERY = 12, 4, 6, 6


def _config(strategy='single'):
  config = helpers.tiny_config(
      'params=float32,compute=float16,output=float32', loss_scale='dynamic')
  config.batch_size = 8
  config.eval_batch_size = 16
  config.num_train_steps = STEPS
  config.log_every_steps = LOG_EVERY
  config.eval_every_steps = EVAL_EVERY
  config.checkpoint_every_steps = CHECKPOINT_EVERY
  config.data.source = 'synthetic'
  config.data.synthetic_train_examples = 64
  config.data.synthetic_eval_examples = 16
  config.parallel.strategy = strategy
  return config


def _plain_loop(config):
  """(final state, each step's host metrics): the strategy's own jitted step
  on the same batches, one after the other, nothing ahead, nothing
  overlapped: the loop the trainer's must equal."""
  exp = experiment.build(settings_lib.parse(config))
  strategy = exp.strategy
  splits = exp.load_splits()
  batches = exp.train_batches(splits.train, pipeline.Shard(), 0)
  state = strategy.init_state()
  metrics = []
  for _ in range(STEPS):
    state, step_metrics = strategy.train_step(
        state, strategy.place_batch(next(batches)))
    metrics.append(strategy.unreplicate(jax.device_get(step_metrics)))
  return exp, strategy.unreplicate(state), metrics


def _bits(tree):
  """Every leaf as host bytes (PRNG keys as their key data)."""
  def leaf(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)
  return jax.tree.map(leaf, tree)


def _batch_threads(before):
  """The names of haiku_mp's threads started since `before` and still alive."""
  return [t.name for t in set(threading.enumerate()) - before
          if t.name.startswith('haiku_mp')]


# What describes an array without reading its value.
_DESCRIPTION = frozenset({'shape', 'dtype', 'ndim', 'size', 'sharding', 'aval',
                          'weak_type', 'committed'})
# The ways of using an array's value that Python looks up on its type (so
# that __getattr__ never sees them).
_USES = ('__array__', '__jax_array__', '__float__', '__int__', '__bool__',
         '__index__', '__complex__', '__repr__', '__str__', '__format__',
         '__len__', '__iter__', '__getitem__', '__neg__', '__abs__', '__add__',
         '__radd__', '__sub__', '__rsub__', '__mul__', '__rmul__',
         '__truediv__', '__rtruediv__', '__pow__', '__eq__', '__ne__',
         '__lt__', '__le__', '__gt__', '__ge__')


class _Watched:
  """A device array whose every use (any attribute but its description, any
  of `_USES`) calls `on_use` first: a read of its value, or an op on it,
  seen where it happens without reaching into JAX."""

  __hash__ = object.__hash__

  def __init__(self, array, on_use):
    self.array, self.on_use = array, on_use

  def __getattr__(self, name):
    if name not in _DESCRIPTION:
      self.on_use()
    return getattr(self.array, name)


def _use(name):
  def use(self, *args, **kwargs):
    self.on_use()
    return getattr(self.array, name)(*args, **kwargs)
  return use


for _name in _USES:
  setattr(_Watched, _name, _use(_name))


def _watched(tree, on_use):
  return jax.tree.map(lambda x: _Watched(x, on_use), tree)


def _unwatched(tree):
  return jax.tree.map(lambda x: x.array if isinstance(x, _Watched) else x,
                      tree)


@helpers.long_running
class LoopTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.workdir = self.enter_context(tempfile.TemporaryDirectory())

  # pjit's and pmap's runs are single's (tests/application/parallel_test.py), their
  # batches placed by the same thread; pmap's own part, its metrics' fetch,
  # is below.
  def test_states_and_metrics_are_a_plain_loops_bit_for_bit(self):
    config = _config()
    loop.train_and_evaluate(settings_lib.parse(config), self.workdir)
    exp, expected_state, expected = _plain_loop(config)

    abstract = sharding.with_shardings(exp.abstract_state,
                                       exp.strategy.checkpoint_shardings)
    with contextlib.closing(checkpoint.Checkpointer(
        self.workdir, 3)) as checkpointer:
      step, state = checkpointer.restore_latest(abstract)
    self.assertEqual(step, STEPS)
    jax.tree.map(np.testing.assert_array_equal, _bits(state),
                 _bits(expected_state))

    with open(os.path.join(self.workdir, 'metrics.jsonl')) as f:
      train = [e for e in map(json.loads, f) if e['split'] == 'train']
    self.assertEqual([e['step'] for e in train],
                     list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)))
    for event in train:
      window = expected[event['step'] - LOG_EVERY:event['step']]
      for key in ('loss', 'accuracy', 'grad_norm', 'updates_lost'):
        # The window's mean of its values that are not NaN (skipped steps'),
        # inf as metrics.jsonl writes it.
        values = np.asarray([m[key] for m in window], np.float64)
        mean = float(values[~np.isnan(values)].mean())
        np.testing.assert_equal(float(event[key]), mean,
                                err_msg=f'step {event["step"]} {key}')
      self.assertEqual(event['loss_scale'], float(window[-1]['loss_scale']))

  def test_pmap_metrics_reach_the_host_as_their_first_replica(self):
    config = _config('pmap')
    strategy = experiment.build(settings_lib.parse(config)).strategy
    step = jax.pmap(lambda x: dict(loss=x.mean(), finite=jnp.isfinite(x)),
                    axis_name='batch')
    window = [step(jnp.full((8, 3), float(i))) for i in range(2)]
    host = strategy.to_host(window)
    self.assertEqual([(h['loss'], h['finite'].tolist()) for h in host],
                     [(0.0, [True] * 3), (1.0, [True] * 3)])
    self.assertIsInstance(host[0]['finite'], np.ndarray)

  def test_the_host_reads_no_value_between_log_points_and_stays_close(self):
    # The loop's hooks hand it each step's metrics, and its state between
    # pauses, watched: every use of their values (float(), np.asarray,
    # jax.device_get, printing, an op) is recorded with the number of steps
    # dispatched so far. Every wait for a step's metrics is recorded with
    # the step it waits for.
    config = _config()
    pauses = {0} | {s for s in range(1, STEPS + 1)
                    if s % LOG_EVERY == 0 or s % EVAL_EVERY == 0 or
                    s % CHECKPOINT_EVERY == 0}
    dispatched, reads, waits, ahead = [0], [], [], []
    step_of, kept = {}, []  # Kept alive: no other tree takes their ids.
    watched = lambda tree: _watched(tree, lambda: reads.append(dispatched[0]))

    def dispatch(step, state, batch):
      # Steps not yet waited for, this one included.
      ahead.append(dispatched[0] + 1 - max((w for _, w in waits), default=0))
      dispatched[0] += 1
      state, metrics = step(_unwatched(state), batch)
      metrics = watched(metrics)
      if dispatched[0] not in pauses:  # Evaluation and saves read the state.
        state = watched(state)
      step_of[id(metrics)] = dispatched[0]
      kept.append(metrics)
      return state, metrics

    def wait(tree):
      if id(tree) in step_of:
        waits.append((dispatched[0], step_of[id(tree)]))
      jax.block_until_ready(_unwatched(tree))
      return tree

    threads = set(threading.enumerate())
    loop.train_and_evaluate(settings_lib.parse(config), self.workdir,
                            hooks=loop.Hooks(dispatch=dispatch, wait=wait))
    self.assertEmpty(_batch_threads(threads))  # Joined at the end.

    self.assertEqual(dispatched[0], STEPS)
    # The reads were seen (at every log point), and only at pauses.
    self.assertContainsSubset(range(LOG_EVERY, STEPS + 1, LOG_EVERY), reads)
    self.assertContainsSubset(
        set(reads), pauses, 'a device value was read after the steps '
        '"missing" here, which are no log, eval or checkpoint point')
    # Between pauses the host waits only for the step steps_in_flight back,
    # never for one it has just dispatched: the device always has that many
    # queued. Every step was waited for, and at no dispatch were more than
    # steps_in_flight + 1 unfinished (XLA's queue never fills).
    k = config.steps_in_flight
    between = [(at, w) for at, w in waits if at not in pauses]
    self.assertNotEmpty(between)
    self.assertEqual([at - w for at, w in between], [k] * len(between))
    self.assertEqual(sorted(w for _, w in waits), list(range(1, STEPS + 1)))
    self.assertLessEqual(max(ahead), k + 1)

  def test_a_watched_value_records_each_use_and_no_description(self):
    # The watch the test above relies on: uses of the value are recorded,
    # its shape and dtype are not.
    uses = []
    x = _watched(jnp.arange(3.0), lambda: uses.append(1))
    self.assertEqual((x.shape, x.dtype), ((3,), jnp.float32))
    self.assertEmpty(uses)
    for use in (np.asarray, jax.device_get, lambda y: float(y[1]), str,
                lambda y: y + 1, lambda y: y.tolist(), jax.block_until_ready):
      before = len(uses)
      use(x)
      self.assertGreater(len(uses), before, use)

  def test_the_batch_thread_is_joined_when_the_loop_fails(self):
    threads = set(threading.enumerate())

    def dispatch(step, state, batch):
      if state.step >= 2:  # A step's state is read: the third step fails.
        raise RuntimeError('a failing step')
      return step(state, batch)

    with self.assertRaisesRegex(RuntimeError, 'a failing step'):
      loop.train_and_evaluate(settings_lib.parse(_config()), self.workdir,
                              hooks=loop.Hooks(dispatch=dispatch))
    self.assertEmpty(_batch_threads(threads))


if __name__ == '__main__':
  absltest.main()
