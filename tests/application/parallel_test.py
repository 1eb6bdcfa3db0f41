"""single / pmap / pjit agree; shardings follow the rules; many processes.

Runs with 8 CPU devices (tests/conftest.py sets XLA_FLAGS before JAX starts);
a layout runs on as many of them as its mesh has: (2, 1) and (2, 2) show
both mesh axes in smaller programs than 8 devices.
"""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import contextlib
import json
import math
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from haiku_mp import errors
from haiku_mp.update import rounding
from haiku_mp.update import train_state
from haiku_mp.vit.parallel import sharding as sharding_lib
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import overview
from launch import lost_process
import tests
from tests import helpers
from tests import signal_at_step

FP16 = 'params=float32,compute=float16,output=float32'
BF16 = 'params=float32,compute=bfloat16,output=float32'
# The layouts held to one device's steps: data parallel, and both axes.
LAYOUTS = (('pmap', (2, 1)), ('pjit', (2, 2)))
BAD_STEP = 2  # This step's batch holds an inf: every strategy must skip it.


def _config(strategy, mesh_shape, policy=FP16, loss_scale='dynamic'):
  config = helpers.tiny_config(policy, loss_scale=loss_scale, dropout_rate=0.0,
                               num_layers=2)
  config.batch_size = config.eval_batch_size = 16
  config.parallel.strategy = strategy
  config.parallel.mesh_shape = mesh_shape or (1, 1)
  return config


def _devices(config):
  """The first devices, as many as the config's mesh has."""
  return jax.devices()[:math.prod(config.parallel.mesh_shape)]


def _build(config, devices=None):
  """The experiment on synthetic data, on `devices` (all by default)."""
  return experiment.build(
      experiment.on_synthetic_data(settings_lib.parse(config)),
      devices=devices)


def _setup(config, devices=None):
  return _build(config, devices).strategy


def _float_batch(config, step):
  """A random float batch; the BAD_STEP's holds an inf."""
  batch = helpers.random_batch(config, config.batch_size, seed=step)
  batch = {k: np.array(v) for k, v in batch.items()}
  if step == BAD_STEP:
    batch['image'][3, 0, 0, 0] = np.inf
  return batch


def _float_batch_without_inf(config, step):
  return helpers.random_batch(config, config.batch_size, seed=step)


def _uint8_batch(config, step):
  """A random uint8 batch (CIFAR-10's kind), augmented inside the step."""
  rng = np.random.default_rng(step)
  size = config.model.image_size
  return dict(image=rng.integers(0, 256, (config.batch_size, size, size, 3),
                                 np.uint8),
              label=rng.integers(0, 10, config.batch_size).astype(np.int32))


def _steps(config, batch_of, steps):
  """(per-step host metrics, strategy, state) after `steps` steps on
  `batch_of(config, step)`."""
  par = _setup(config, _devices(config))
  state = par.init_state()
  metrics = []
  for step in range(steps):
    state, step_metrics = par.train_step(
        state, par.place_batch(batch_of(config, step)))
    metrics.append(jax.device_get(par.unreplicate(step_metrics)))
  return metrics, par, state


def _column(metrics, key, kind=float):
  return [kind(m[key]) for m in metrics]


@helpers.long_running
class StrategiesAgreeTest(parameterized.TestCase):
  """Every strategy takes the steps one device takes. A test's config may
  carry several features at once, so that the suite compiles one train step
  per strategy for all of them. pmap on (2, 1) and pjit on (2, 2): the
  batch axis, and the model axis with it."""

  def test_fp16_steps_with_remat_agree_and_skip_together(self):
    """Float16 with a dynamic scale (the skip and the scale's fall as well
    as the losses), and rematerialization, which changes no step: every
    layout's losses with remat are those of one device without it. (One
    device with remat: remat_test's same loss and gradients as without.)"""
    def config_for(strategy, mesh_shape, remat='dots'):
      config = _config(strategy, mesh_shape, FP16, 'dynamic')
      config.remat = remat
      return config

    plain, *_ = _steps(config_for('single', None, remat='none'), _float_batch,
                       5)
    reference = _column(plain, 'loss')
    good = [i for i in range(5) if i != BAD_STEP]
    for strategy, mesh_shape in LAYOUTS:
      metrics, *_ = _steps(config_for(strategy, mesh_shape), _float_batch, 5)
      layout = f'{strategy} {mesh_shape}'
      self.assertEqual(_column(metrics, 'grads_finite', bool),
                       [i != BAD_STEP for i in range(5)], layout)
      self.assertEqual(_column(metrics, 'loss_scale'),
                       [2.0**15] * 3 + [2.0**14] * 2, layout)
      # Each layout sums the batch in another order: float32 rounding of
      # those sums through five steps (up to 2e-6 here), not bit for bit.
      np.testing.assert_allclose(np.array(_column(metrics, 'loss'))[good],
                                 np.array(reference)[good], rtol=2e-5,
                                 err_msg=layout)
    self.assertLess(reference[-1], reference[0])

  def test_bfloat16_state_and_uint8_batches_agree(self):
    """Stochastic rounding into bfloat16 params and moments (the layout with
    draws; Kahan's buffer is rounded to nearest, as a float32 master is), on
    uint8 batches augmented inside the step, per example keyed by the
    step's key (the same images however the batch is split). The steps
    agree as the float32-master layout's do: the same losses, and the same
    weights but for a few that float32 sums in another order put across a
    rounding boundary (one bfloat16 ulp)."""
    results = {}
    for strategy, mesh_shape in (('single', None), *LAYOUTS):
      config = _config(strategy, mesh_shape, 'p=bf16,c=bf16,o=f32', 'none')
      config.model.update(num_layers=1, image_size=32, patch_size=8)
      config.precision.update(param_update='stochastic', mu_dtype='bfloat16',
                              nu_dtype='bfloat16')
      metrics, par, state = _steps(config, _uint8_batch, 3)
      results[strategy] = (_column(metrics, 'loss'),
                           jax.device_get(par.unreplicate(state)))
    want_losses, want = results['single']
    for strategy, (losses, state) in results.items():
      # Sums in another order, and the bfloat16 roundings they move: up to
      # 4e-5 here (pjit: each replica's weight gradients, a bfloat16 sum of
      # its own examples, then averaged, as under pmap).
      np.testing.assert_allclose(losses, want_losses, rtol=1e-4,
                                 err_msg=strategy)
      chex.assert_trees_all_equal_dtypes(state, want)
      weights = [(np.asarray(a, np.float32), np.asarray(b, np.float32))
                 for (path, a), b in zip(
                     jax.tree_util.tree_flatten_with_path(state.params)[0],
                     jax.tree.leaves(want.params)) if path[-1].key == 'w']
      # 3.7% (pmap) and 22% (pjit) here: the weights that sums in another
      # order (another again on another CPU) move by an ulp or an Adam step
      # (below). pjit's replicas compute their gradients as pmap's do, in a
      # shard_map whose bfloat16 roundings XLA places otherwise. At most
      # 30%. Rounding drawn from another key (per replica, or per shard)
      # moves about half of them.
      differ = sum(np.sum(a != b) for a, b in weights)
      self.assertLess(differ / sum(a.size for a, _ in weights), 0.3,
                      strategy)
      # And those by one ulp, or by one Adam step the other way where the
      # gradient is near zero (its sign then depends on the sums' order).
      # Up to 3 steps of it on pjit (one weight of 256).
      for a, b in weights:
        np.testing.assert_allclose(a, b, rtol=2.0**-7,
                                   atol=4 * config.learning_rate,
                                   err_msg=strategy)

  def test_fp8_delayed_steps_and_histories_agree(self):
    """fp8 amaxes are over the whole batch on every strategy (pmap reduces
    them over its replicas: the Linear gets the axis, whatever the scaling;
    fp8_test checks the reduction of current and delayed scaling on the
    matmul itself), so every layout takes the steps one device takes, and
    the histories stay equal."""
    results = {}
    for strategy, mesh_shape in (('single', None), *LAYOUTS):
      config = _config(strategy, mesh_shape, BF16, 'none')
      config.model.num_layers = 1
      config.precision.low_bit.update(modules='*/encoder_block_*',
                                  scaling='delayed', history_length=4)
      metrics, par, state = _steps(config, _float_batch_without_inf, 3)
      histories, _ = train_state.split_fp8(
          jax.device_get(par.unreplicate(state).params))
      results[strategy] = (_column(metrics, 'loss'), histories)
    want_losses, want_histories = results['single']
    # 3 histories per fp8 Linear, 6 Linears in the block.
    self.assertLen(jax.tree.leaves(want_histories), 3 * 6)
    for strategy, (losses, histories) in results.items():
      # The first two steps' losses agree to the sums in another order (in
      # bfloat16 around the fp8 matmuls: up to 1.6e-5 relative on pjit,
      # whose replicas compute their gradients as pmap's do); by the third,
      # Adam has moved params apart where a gradient is near zero (one
      # exactly 0 on one layout and -6e-5 on another: a whole step of the
      # learning rate), up to 4e-5 relative.
      np.testing.assert_allclose(losses[:2], want_losses[:2], rtol=4e-5,
                                 err_msg=strategy)
      np.testing.assert_allclose(losses[2], want_losses[2], rtol=1e-4,
                                 err_msg=strategy)
      # Amaxes of the first two steps agree closely; the third step's
      # output gradients come from params that Adam already moved apart
      # where gradients are near zero (as in bfloat16 without fp8), so its
      # amaxes are up to ~11% apart (pjit). A history in another unit (a
      # replica's gradient is 2x the whole batch's) would be 100% off. The
      # older ones: up to 2% (pjit, its bfloat16 sums of each replica's
      # examples).
      older = lambda tree: jax.tree.map(lambda h: h[1:], tree)
      newest = lambda tree: jax.tree.map(lambda h: h[0], tree)
      chex.assert_trees_all_close(older(histories), older(want_histories),
                                  rtol=4e-2)
      chex.assert_trees_all_close(newest(histories), newest(want_histories),
                                  rtol=0.25)


@helpers.long_running
class StateLayoutsAgreeTest(parameterized.TestCase):

  def test_stochastic_rounding_draws_the_same_on_every_sharding(self):
    x = jnp.linspace(-3, 3, 16 * 24, dtype=jnp.float32).reshape(16, 24) + 1e-3
    key = jax.random.key(5)
    want = rounding.stochastic_round(key, x, jnp.bfloat16)
    mesh = sharding_lib.make_mesh((2, 2), jax.devices()[:4])
    for spec in (P('batch', 'model'), P(None, 'model'), P()):
      sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
      got = jax.jit(rounding.stochastic_round, static_argnums=2)(
          key, sharded, jnp.bfloat16)
      self.assertEqual(got.sharding.spec, spec)
      # Integer bits added and masked: bit for bit on any sharding and CPU.
      chex.assert_trees_all_equal(np.asarray(got), np.asarray(want))

  def test_compensation_and_moments_are_sharded_like_the_params(self):
    """One program for three kinds of state: a Kahan buffer and a bfloat16
    first moment split as their params; an 8-bit second moment's codes
    too, and each block scale lies with its block where the param's split
    falls on whole blocks, and is replicated where it does not."""
    config = _config('pjit', (2, 2), policy='p=bf16,c=bf16,o=f32')
    config.model.num_layers = 1
    config.precision.update(param_update='kahan', mu_dtype='bfloat16',
                            nu_dtype='float8_blocks', moment_block_size=16)
    par = _setup(config, _devices(config))
    state = par.init_state()
    name = 'vit/encoder_block_0/mlp_block/fc1'
    query = 'vit/encoder_block_0/attention/query'
    fc1 = state.params[name]['w']
    self.assertEqual(fc1.sharding.spec, P(None, 'model'))
    rows, columns = fc1.shape

    def check(state):
      for part in ('compensation', 'mu'):
        leaf = optax.tree_utils.tree_get(state.opt_state, part)[name]['w']
        self.assertEqual((leaf.dtype, leaf.sharding),
                         (jnp.dtype(jnp.bfloat16), fc1.sharding), part)
      nu = optax.tree_utils.tree_get(state.opt_state, 'nu')
      codes, scales = nu.codes[name]['w'], nu.scales[name]['w']
      self.assertEqual((codes.dtype, codes.sharding),
                       (jnp.dtype(jnp.float8_e4m3fn), fc1.sharding))
      self.assertEqual(scales.shape, (rows, columns // 16))
      self.assertEqual(scales.sharding.spec, P(None, 'model'))
      # query's 16 columns split in two, but its one block does not.
      self.assertEqual(nu.codes[query]['w'].sharding.spec, P(None, 'model'))
      self.assertEqual(nu.scales[query]['w'].shape, (rows, 1))
      self.assertEqual(nu.scales[query]['w'].sharding.spec, P())

    check(state)
    state, metrics = par.train_step(state, par.place_batch(
        helpers.random_batch(config, config.batch_size)))
    self.assertTrue(bool(metrics['grads_finite']))
    check(state)


@helpers.long_running
class ShardingRulesTest(parameterized.TestCase):

  def test_params_and_optimizer_state_follow_the_rules(self):
    config = _config('pjit', (2, 2))
    par = _setup(config, _devices(config))
    state = par.init_state()
    expected = {
        'attention/query': {'w': P(None, 'model'), 'b': P('model')},
        'attention/key': {'w': P(None, 'model'), 'b': P('model')},
        'attention/value': {'w': P(None, 'model'), 'b': P('model')},
        'attention/out': {'w': P('model', None), 'b': P()},
        'mlp_block/fc1': {'w': P(None, 'model'), 'b': P('model')},
        'mlp_block/fc2': {'w': P('model', None), 'b': P()},
        'ln_mlp': {'scale': P(), 'offset': P()},
    }
    for module, params in state.params.items():
      for name, value in params.items():
        suffix = next((k for k in expected if module.endswith(k)), None)
        spec = expected[suffix][name] if suffix else P()
        self.assertEqual(value.sharding.spec, spec, f'{module}/{name}')
        shard_shape = value.addressable_shards[0].data.shape
        want = tuple(d // 2 if axis == 'model' else d
                     for d, axis in zip(value.shape,
                                        tuple(spec) + (None,) * value.ndim))
        self.assertEqual(shard_shape, want, f'{module}/{name}')
    fc1 = state.params['vit/encoder_block_0/mlp_block/fc1']['w']
    self.assertEqual(fc1.addressable_shards[0].data.size * 2, fc1.size)
    adam = state.opt_state[0]
    self.assertEqual(adam.mu['vit/encoder_block_0/mlp_block/fc1']['w'].sharding,
                     fc1.sharding)
    self.assertEqual(adam.count.sharding.spec, P())

  def test_config_rule_overrides_the_defaults(self):
    config = _config('pjit', (2, 2))
    config.parallel.sharding_rules = r'.*/head/w=None,model;.*fc1/w='
    state = _setup(config, _devices(config)).init_state()
    self.assertEqual(state.params['vit/head']['w'].sharding.spec,
                     P(None, 'model'))
    self.assertEqual(
        state.params['vit/encoder_block_0/mlp_block/fc1']['w'].sharding.spec,
        P())

  def test_half_params_master_copy_is_sharded_like_the_params(self):
    config = _config('pjit', (2, 2), policy='p=bf16,c=bf16,o=f32')
    par = _setup(config, _devices(config))
    state = par.init_state()
    fc1 = state.params['vit/encoder_block_0/mlp_block/fc1']['w']
    master = state.opt_state.master['vit/encoder_block_0/mlp_block/fc1']['w']
    self.assertEqual((fc1.dtype, master.dtype), (jnp.bfloat16, jnp.float32))
    self.assertEqual(master.sharding, fc1.sharding)
    self.assertEqual(fc1.sharding.spec, P(None, 'model'))
    mu = state.opt_state.inner[0].mu['vit/encoder_block_0/mlp_block/fc1']['w']
    self.assertEqual(mu.sharding, fc1.sharding)
    images = np.zeros((16, 8, 8, 3), np.float32)
    labels = np.arange(16, dtype=np.int32) % 10
    state, metrics = par.train_step(
        state, par.place_batch(dict(image=images, label=labels)))
    self.assertTrue(bool(metrics['grads_finite']))
    fc1 = state.params['vit/encoder_block_0/mlp_block/fc1']['w']
    master = state.opt_state.master['vit/encoder_block_0/mlp_block/fc1']['w']
    np.testing.assert_array_equal(fc1, master.astype(jnp.bfloat16))
    self.assertEqual(master.sharding.spec, P(None, 'model'))

  def test_tabulate_shows_shardings(self):
    config = _config('pjit', (2, 2))
    rows = {r['path']: r for r in overview.module_rows(
        _build(config, _devices(config)))}
    fc2 = rows['vit/encoder_block_0/mlp_block/fc2']['params']
    self.assertEqual((fc2['w']['sharding'], fc2['b']['sharding']),
                     ('model,None', 'replicated'))
    text = overview.format_table(list(rows.values()))
    self.assertIn('w:None,model', text)


class BadSettingsTest(parameterized.TestCase):

  @parameterized.parameters(
      (dict(strategy='pjit', mesh_shape=(16, 1)), 'needs 16 devices'),
      (dict(strategy='pjit', mesh_shape=(3, -1)), 'does not divide'),
      (dict(strategy='pjit', mesh_shape=(8,)), 'mesh_shape'),
      (dict(strategy='pmap', mesh_shape=(4, 2)), 'data parallel only'),
      (dict(strategy='spmd', mesh_shape=(8, 1)), 'parallel.strategy'),
      (dict(strategy='pjit', mesh_shape=(8, 1), batch_size=12),
       'batch_size=12 is not divisible'),
      (dict(strategy='pjit', mesh_shape=(2, 4),
            sharding_rules='.*/head/w=None,model'), 'cannot be split 4 ways'),
      (dict(strategy='pjit', mesh_shape=(8, 1), sharding_rules='.*=batchy'),
       'unknown mesh axis'),
      (dict(strategy='pjit', mesh_shape=(8, 1), sharding_rules='(=model'),
       'bad regex'))
  def test_one_clear_error(self, settings, message):
    config = _config(settings['strategy'], settings['mesh_shape'])
    config.batch_size = settings.get('batch_size', 16)
    config.parallel.sharding_rules = settings.get('sharding_rules', '')
    with self.assertRaisesRegex(errors.ConfigError, message):
      _setup(config)


@contextlib.contextmanager
def _reserved_port():
  """A port no other process can take while in use, which the coordinator
  can still bind: this socket holds it with SO_REUSEPORT, never listening,
  and the coordinator's gRPC server binds with SO_REUSEPORT too (a port
  merely found free could be taken before the coordinator binds it)."""
  with socket.socket() as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(('127.0.0.1', 0))
    yield sock.getsockname()[1]


MULTI_FLAGS = ('--config=configs/vit_fp16.py', '--config.data.source=synthetic',
               '--config.log_every_steps=1', '--config.batch_size=16',
               '--config.eval_batch_size=16',
               '--config.data.synthetic_eval_examples=20',
               '--config.data.synthetic_train_examples=64',
               '--config.model.num_layers=1', '--config.model.embed_dim=16',
               '--config.model.mlp_dim=32', '--config.model.num_heads=2',
               '--config.model.dropout_rate=0',
               # fsdp is pjit with the state split over 'batch' as well: one
               # test of both across processes (gathers in float16).
               '--config.parallel.strategy=fsdp',
               # Two devices per process: both axes of the mesh, over both
               # processes, in the smallest programs that have them.
               '--config.parallel.mesh_shape=(2,2)')


def _two_processes(flags, workdir, signal_at_process_1=None, devices=2):
  """Runs launch.train as 2 processes of `devices` devices each; their
  (returncode, log)."""
  with _reserved_port() as port:
    commands = []
    for i in range(2):
      env, module = {'XLA_FLAGS': tests.xla_flags(devices)}, 'launch.train'
      if i == 1 and signal_at_process_1:
        env[signal_at_step.ENV] = signal_at_process_1
        module = 'tests.signal_at_step'
      commands.append((module, [
          *flags, f'--workdir={workdir}',
          f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
          f'--process_id={i}'], env))
    try:
      done = helpers.run_modules_together(commands)
    except subprocess.TimeoutExpired:
      raise AssertionError('the processes did not finish (a hang in a '
                           'collective?)') from None
  return [(d.returncode, d.stdout + d.stderr) for d in done]


def _events(workdir):
  with open(f'{workdir}/metrics.jsonl') as f:
    return [json.loads(line) for line in f]


@helpers.long_running
class MultiProcessTest(parameterized.TestCase):
  """fsdp over two processes against one (pmap's two-process runs: in
  LostProcessTest)."""

  def test_two_processes_match_one_through_a_sigterm_to_one_of_them(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    multi = f'{tmp}/multi'
    flags = [*MULTI_FLAGS, '--config.num_train_steps=6',
             '--config.eval_every_steps=6', '--config.checkpoint_every_steps=6']
    # Only process 1 (which writes no metrics) is signalled, after step 3.
    results = _two_processes(flags, multi, signal_at_process_1='TERM:3')
    saved = []
    for returncode, out in results:
      self.assertEqual(returncode, 0, out[-3000:])
      saved += re.findall(r'SIGTERM: saved a checkpoint at step (\d+)', out)
    self.assertLen(saved, 2)
    self.assertEqual(saved[0], saved[1])  # Both processes, the same step,
    self.assertEqual(os.listdir(f'{multi}/checkpoints'), [saved[0]])  # one
    self.assertFalse(os.path.exists(f'{multi}/summary.json'))  # checkpoint.
    for returncode, out in _two_processes(flags, multi):  # Resumed.
      self.assertEqual(returncode, 0, out[-3000:])
      self.assertIn(f'at step {saved[0]}.', out)
    # One process of one device, the plainest program of these steps (and
    # a smaller one to compile than fsdp's on four).
    one = f'{tmp}/one'
    helpers.run_module(
        'launch.train', *(f for f in flags if '.parallel.' not in f),
        '--config.parallel.strategy=single', f'--workdir={one}', devices=1,
        check=True)
    # One shared workdir (as on a cluster's shared filesystem); only process 0
    # writes metrics, so no event is there twice; the stop and the resume
    # change nothing.
    multi_events, one_events = _events(multi), _events(one)
    self.assertEqual([(e['step'], e['split']) for e in multi_events],
                     [(e['step'], e['split']) for e in one_events])
    for a, b in zip(multi_events, one_events):
      # Float32 rounding of sums in another order (as StrategiesAgreeTest).
      np.testing.assert_allclose(a['loss'], b['loss'], rtol=2e-5)
    self.assertEqual([e['num_examples'] for e in multi_events
                      if e['split'] != 'train'], [20, 20])


# What every test of a lost process runs: pmap over two processes of one
# device (a lost process is the same with more devices or with the state
# split, MultiProcessTest's fsdp; pmap's own two-process runs are among
# these, compiling nothing more), 10 steps, a checkpoint at 5, JAX's
# shortest heartbeat timeout, one compilation cache for all the runs.
_LOST_FLAGS = (*(f for f in MULTI_FLAGS if '.parallel.' not in f),
               '--config.parallel.strategy=pmap',
               '--config.parallel.mesh_shape=(2,1)',
               '--config.num_train_steps=10',
               '--config.eval_every_steps=10',
               '--config.checkpoint_every_steps=5',
               '--config.parallel.heartbeat_timeout_sec=5')
_LOST_STEPS, _LOST_CHECKPOINT = 10, 5
# The bound on a survivor's end after the loss, on CPU (gloo).
_LOST_BOUND_SEC = 60


def _lose_one(flags, workdir, victim, how, at_step):
  """Runs launch.train as 2 processes of 1 device, process `victim` sent
  SIG`how` after step `at_step`. Returns the survivor's (returncode,
  output), the victim's, and the survivor's seconds from the signal to its
  end (at most: to the end of both). Forked from the tests' launcher, as
  `_two_processes` runs them, but for a stopped victim, which never ends:
  started afresh, and killed once the survivor ended."""
  with _reserved_port() as port, contextlib.ExitStack() as stack:
    commands = []
    for i in range(2):
      env, module = {'XLA_FLAGS': tests.xla_flags(1)}, 'launch.train'
      if i == victim:
        env[signal_at_step.ENV] = f'{how}:{at_step}'
        module = 'tests.signal_at_step'
      commands.append((module, [
          *flags, f'--workdir={workdir}',
          f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
          f'--process_id={i}'], env))
    if how == 'STOP':
      output = stack.enter_context(tempfile.TemporaryFile('w+'))
      stopped = helpers.start_module(*commands[victim], output)
      try:
        module, args, env = commands[1 - victim]
        done = {1 - victim: helpers.run_module(module, *args, env=env,
                                               timeout=240)}
        ended = time.time()
      finally:
        stopped.kill()
        stopped.wait()
      output.seek(0)
      done[victim] = subprocess.CompletedProcess(
          stopped.args, stopped.returncode, output.read(), '')
    else:
      done = dict(enumerate(helpers.run_modules_together(commands)))
      ended = time.time()
  texts = {i: d.stdout + d.stderr for i, d in done.items()}
  mark = re.search(r'signal_at_step: SIG\w+ at ([\d.]+)', texts[victim])
  return ((done[1 - victim].returncode, texts[1 - victim]),
          (done[victim].returncode, texts[victim]),
          ended - float(mark.group(1)))


def _losses(workdir):
  return [(e['step'], e['split'], e['loss'], e['accuracy'])
          for e in _events(workdir)]


def _errors(output):
  return [line for line in output.splitlines() if line.startswith('error:')]


# The losses, each (victim, SIG..., after step). Killed as step 5 ends:
# process 0's save of step 5 (which waits for process 1) never completes, and
# no step 5 is left behind.
FROM_SCRATCH = (1, 'KILL', _LOST_CHECKPOINT)
FROM_CHECKPOINT = (0, 'KILL', 8)
NOT_RESTARTED = (1, 'STOP', 8)


def _newest(at_step):
  """The newest complete checkpoint after a loss after `at_step`."""
  return _LOST_CHECKPOINT if at_step > _LOST_CHECKPOINT else None


@helpers.long_running
class LostProcessTest(parameterized.TestCase):
  """A process lost (killed, or stopped without dying) ends every other in
  one line within the bound; the restart resumes from the newest complete
  checkpoint, its losses those of a run never interrupted, bit for bit.

  The run lost before its first checkpoint restarts from step 0: its restart
  is a run never interrupted (each step's metrics once), the reference that
  the run resumed from a checkpoint is held to, bit for bit (its steps up to
  the checkpoint were taken before the loss, the rest after it).

  The kill of process 0 and the stop of process 1, both after step 8, leave
  the same for a restart to read: the run's config, no summary, checkpoint
  5 complete and none under way (the next is 10), metrics.jsonl through
  step 8 (process 0 writes each event as its step ends, before either
  loss, and step 9 cannot end without both processes). So one restart from
  a checkpoint holds that path to the reference: the kill's, whose run is
  also pmap's resume after a SIGTERM (two runs of their own before). Every
  loss's newest complete checkpoint, what a restart would resume from, is
  checked on disk."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.addClassCleanup(shutil.rmtree, cls.tmp)
    cls.flags = [*_LOST_FLAGS,
                 f'--config.compilation_cache_dir={cls.tmp}/cache']
    cls.runs = {FROM_SCRATCH: cls._lose(FROM_SCRATCH)}
    cls._restart(cls.runs[FROM_SCRATCH])
    cls.reference = cls.runs[FROM_SCRATCH]['losses']
    # SIGTERM to process 1 after step 3: both stop at a step they agree on,
    # before 5, with a checkpoint that the run losing process 0 resumes from.
    cls.stopped = _two_processes(cls.flags, cls._workdir(FROM_CHECKPOINT),
                                 signal_at_process_1='TERM:3', devices=1)
    cls.runs[FROM_CHECKPOINT] = cls._lose(FROM_CHECKPOINT)
    cls._restart(cls.runs[FROM_CHECKPOINT])
    cls.runs[NOT_RESTARTED] = cls._lose(NOT_RESTARTED)

  @classmethod
  def _workdir(cls, loss):
    victim, how, _ = loss
    return f'{cls.tmp}/{victim}{how}'

  @classmethod
  def _lose(cls, loss):
    """Loses a process (`loss`: victim, how, after step): what the tests
    check of it."""
    victim, how, at_step = loss
    workdir = cls._workdir(loss)
    survivor, lost, seconds = _lose_one(cls.flags, workdir, victim, how,
                                        at_step)
    return dict(workdir=workdir, survivor=survivor, victim=lost,
                seconds=seconds, newest=lost_process.newest_checkpoint(
                    f'{workdir}/checkpoints'))

  @classmethod
  def _restart(cls, run):
    """Restarts both processes of the lost `run`; adds what the tests check
    of it."""
    workdir = run['workdir']
    # What a process lost while writing the last step's checkpoint would
    # leave: passed over, and that step saved anew.
    cut_short = (f'{workdir}/checkpoints/{_LOST_STEPS}'
                 '.orbax-checkpoint-tmp-1764650000')
    os.makedirs(f'{cut_short}/default')
    with open(f'{cut_short}/default/half_written', 'w') as f:
      f.write('{')
    run['restarted'] = _two_processes(cls.flags, workdir, devices=1)
    run['losses'] = _losses(workdir)
    run['newest_restarted'] = lost_process.newest_checkpoint(
        f'{workdir}/checkpoints')

  @parameterized.named_parameters(
      ('kill_process_1_as_process_0_saves', *FROM_SCRATCH),
      ('kill_process_0_the_coordinator', *FROM_CHECKPOINT),
      ('stop_process_1', *NOT_RESTARTED))
  def test_one_line_on_the_survivor(self, victim, how, at_step):
    run = self.runs[victim, how, at_step]
    (code, out), (victim_code, victim_out) = run['survivor'], run['victim']
    self.assertEqual(code, lost_process.EXIT_PROCESS_LOST, out[-3000:])
    [line] = _errors(out)
    newest = _newest(at_step)
    self.assertStartsWith(line, f'error: process {victim} of 2 was lost (')
    self.assertIn(f'process {1 - victim} stopped after step {at_step};',
                  line)
    self.assertIn(
        f'the newest complete checkpoint is step {newest}' if newest else
        'there is no complete checkpoint yet', line)
    self.assertIn('Restart: run the same command on every process again '
                  '(here: python -m launch.train --config=', line)
    for crash in ('Traceback', 'Fatal Python error', 'Check failure',
                  'coordination_service'):
      self.assertNotIn(crash, out)
    self.assertLess(run['seconds'], _LOST_BOUND_SEC)
    if how == 'KILL':  # The killed process's own parent says so too.
      self.assertEqual(victim_code, 128 + signal.SIGKILL, victim_out[-3000:])
      self.assertIn(f'error: process {victim} of 2 was killed (SIGKILL)',
                    victim_out)
    # Only complete checkpoints carry a step's name: a save cut short is a
    # temporary directory, which a restart passes over.
    self.assertEqual(run['newest'], newest)

  @parameterized.named_parameters(
      ('from_step_0', *FROM_SCRATCH),
      ('from_the_checkpoint', *FROM_CHECKPOINT))
  def test_the_restart_loses_nothing(self, victim, how, at_step):
    run = self.runs[victim, how, at_step]
    newest = _newest(at_step)
    for returncode, restarted in run['restarted']:
      self.assertEqual(returncode, 0, restarted[-3000:])
      if newest:
        self.assertIn(f'at step {newest}.', restarted)
    # The run from step 0 (the reference) has each step's metrics once; a
    # resumed run's steps up to its checkpoint are those it took before the
    # loss, so its equal losses hold the reference to them too.
    self.assertEqual([e[:2] for e in self.reference if e[1] == 'train'],
                     [(step, 'train') for step in range(1, _LOST_STEPS + 1)])
    self.assertLen(set(e[:2] for e in self.reference), len(self.reference))
    self.assertEqual(run['losses'], self.reference)
    self.assertEqual(run['newest_restarted'], _LOST_STEPS)

  def test_pmap_over_two_processes_stops_together_and_resumes(self):
    """pmap's program compiled ahead expected the global replicas' shapes
    and refused every call of a process (its own): each process's first
    step was a traceback. Stopped by a SIGTERM to process 1, then resumed
    by the run that loses process 0 after step 8; the restart of that ends
    the run, its losses (the resumed run's steps to 5 among them) those of
    the run never interrupted (`test_the_restart_loses_nothing`)."""
    saved = set()
    for returncode, out in self.stopped:
      self.assertEqual(returncode, 0, out[-3000:])
      saved.update(re.findall(r'SIGTERM: saved a checkpoint at step (\d+)',
                              out))
    self.assertLen(saved, 1)  # The same step on both processes.
    step = saved.pop()
    run = self.runs[FROM_CHECKPOINT]
    self.assertLess(int(step), _LOST_CHECKPOINT)  # The resume saved 5.
    for _, out in (run['survivor'], run['victim']):
      self.assertIn(f'Resuming from {run["workdir"]}/checkpoints at step '
                    f'{step}.', out)
    for _, out in run['restarted']:
      self.assertIn(f'test at step {_LOST_STEPS}:', out)


if __name__ == '__main__':
  absltest.main()
