"""FSDP (`parallel.strategy=fsdp`) and the precision of communication.

The state split over `batch` from its creation; steps that learn what one
device learns; checkpoints that move between meshes; and, in the library,
reductions in the dtype asked for, through the loss scale.
"""

import contextlib
import math
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import haiku_mp
from haiku_mp.update import data_parallel
from haiku_mp.update import train_state
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import checkpoint
from haiku_mp.vit.train import experiment
from tests import helpers

F32 = 'params=float32,compute=float32,output=float32'
BF16 = 'params=float32,compute=bfloat16,output=float32'


def _config(strategy, mesh_shape, policy=F32, **parallel):
  config = helpers.tiny_config(policy, dropout_rate=0.0)
  config.batch_size = config.eval_batch_size = 16
  config.data.source = 'synthetic'
  config.parallel.update(strategy=strategy, mesh_shape=mesh_shape or (1, 1),
                         **parallel)
  return config


def _steps(exp, config, state, first, last):
  losses = []
  for step in range(first, last):
    batch = helpers.random_batch(config, config.batch_size, seed=step)
    state, metrics = exp.strategy.train_step(state,
                                             exp.strategy.place_batch(batch))
    losses.append(float(exp.strategy.unreplicate(metrics['loss'])))
  return state, losses


def _kernels(tree):
  """{module path: leaf} of the 'w' leaves of a params-shaped tree."""
  return {k: v['w'] for k, v in tree.items() if 'w' in v}


class StateTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('float32_master', BF16, 'master', 'float32'),
      ('pure_bf16', 'params=bfloat16,compute=bfloat16,output=float32',
       'stochastic', 'bfloat16'),
      ('moments_8bit', 'params=bfloat16,compute=bfloat16,output=float32',
       'stochastic', 'float8_blocks'))
  def test_the_state_is_made_split_over_both_axes(self, policy, update,
                                                  moments):
    """Created in place on a 4x2 mesh: every kernel split over 'batch' on a
    dimension the rules leave free, its optimizer state alike, each device
    holding its part only; the startup lines say how much."""
    config = _config('fsdp', (4, 2), policy)
    config.precision.update(param_update=update, mu_dtype=moments,
                            nu_dtype=moments)
    exp = experiment.build(settings_lib.parse(config))
    state = exp.strategy.init_state()
    for name, kernel in _kernels(state.params).items():
      spec = kernel.sharding.spec
      self.assertIn('batch', spec, name)
      dim = list(spec).index('batch')
      self.assertEqual(kernel.addressable_shards[0].data.shape[dim],
                       kernel.shape[dim] // 4, name)
    split = [leaf for leaf in jax.tree.leaves(state.opt_state)
             if 'batch' in getattr(leaf.sharding, 'spec', ())]
    kernels = _kernels(state.params)
    # Each kernel's moments (and master copy) at least.
    self.assertGreaterEqual(len(split), 2 * len(kernels))
    held = sum(s.data.nbytes for leaf in jax.tree.leaves(state)
               for s in leaf.addressable_shards[:1]
               if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(state)
                if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))
    # 8 devices: 1/8 of the kernels, the small vectors whole on 'model'.
    self.assertLess(held / whole, 0.25)
    line = next(x for x in exp.describe() if x.startswith('Per device:'))
    self.assertRegex(line, r"^Per device: [\d.]+ MB of the state's [\d.]+ "
                           r'MB \(0\.\d+ of it\)$')

  def test_what_no_dimension_fits_stays_whole_and_is_counted(self):
    """With 8 devices on 'batch', the tiny model's 2-element and 10-class
    vectors fit no split: whole on every device, and counted."""
    exp = experiment.build(settings_lib.parse(_config('fsdp', (8, 1))))
    state = exp.strategy.init_state()
    head_bias = state.params['vit/head']['b']
    self.assertEqual(head_bias.sharding.spec, P())
    line = next(x for x in exp.describe() if x.startswith('FSDP:'))
    self.assertRegex(line, r'^FSDP: \d+ parameters \([\d.]+ MB\) stay '
                           r"whole on every device: no dimension of theirs "
                           r"divides by the 8 devices of 'batch'$")


@helpers.long_running
class LearnsTest(parameterized.TestCase):
  """On 2 and 4 of the devices: a (2, 1) mesh splits the state over 'batch'
  alone, a (2, 2) one over both axes; more devices split no other way."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One device's losses, once for every mesh that is held to them.
    _, cls.single_losses = _steps(*cls._run(_config('single', None)), 0, 4)

  @parameterized.parameters(((2, 1),), ((2, 2),))
  def test_float32_communication_takes_one_devices_steps(self, mesh_shape):
    """Gathers and reductions in float32: the losses of one device, to the
    rounding of float32 sums in another order."""
    config = _config('fsdp', mesh_shape, gather_dtype='float32',
                     reduce_dtype='float32')
    exp, _, state = self._run(config)
    _, losses = _steps(exp, config, state, 0, 4)
    np.testing.assert_allclose(losses, self.single_losses, rtol=2e-5)
    self.assertLess(losses[-1], losses[0])

  @staticmethod
  def _run(config):
    """(experiment, config, state) on as many devices as the mesh has."""
    devices = jax.devices()[:math.prod(config.parallel.mesh_shape)]
    exp = experiment.build(settings_lib.parse(config), devices=devices)
    return exp, config, exp.strategy.init_state()

  def test_delayed_fp8_histories_travel_with_the_split_state(self):
    """fp8 with delayed scaling under fsdp, its weights gathered in fp8: the
    amax histories stay whole (every replica scales alike) and roll on."""
    config = _config('fsdp', (2, 1), BF16, gather_dtype='fp8')
    config.precision.low_bit.update(modules='Linear', scaling='delayed',
                                history_length=4)
    exp, _, state = self._run(config)
    state, losses = _steps(exp, config, state, 0, 2)
    self.assertTrue(np.all(np.isfinite(losses)))
    histories, trained = train_state.split_fp8(state.params)
    self.assertNotEmpty(jax.tree.leaves(histories))
    for leaf in jax.tree.leaves(histories):
      self.assertEqual(leaf.sharding.spec, P())
      self.assertGreater(float(jnp.max(leaf)), 0.0)  # amaxes recorded.
    self.assertIn('batch', _kernels(trained)['vit/encoder_block_0/mlp_block/fc1'
                                             ].sharding.spec)
    # The eval step, a plain jit over the split params, names no axis.
    batch = helpers.random_batch(config, config.batch_size)
    metrics = exp.strategy.eval_step(state.params,
                                     exp.strategy.place_batch(batch))
    self.assertTrue(np.isfinite(float(metrics['loss'])))


class CheckpointAcrossMeshesTest(absltest.TestCase):

  def test_a_checkpoint_moves_between_meshes(self):
    """Saved under fsdp on 8 devices after 2 steps: resumed there it is
    bit for bit the straight run; restored on one device and on a pjit 4x2
    mesh it holds the same values and trains on."""
    config = _config('fsdp', (8, 1))
    exp = experiment.build(settings_lib.parse(config))
    straight, _ = _steps(exp, config, exp.strategy.init_state(), 0, 4)
    saved, _ = _steps(exp, config, exp.strategy.init_state(), 0, 2)
    saved_host = jax.device_get(saved)
    workdir = self.enter_context(tempfile.TemporaryDirectory())
    with contextlib.closing(checkpoint.Checkpointer(workdir, 1)) as ckpt:
      ckpt.save(2, saved)
    for strategy, mesh_shape in (('fsdp', (8, 1)), ('single', None),
                                 ('pjit', (4, 2))):
      with self.subTest(strategy):
        other = _config(strategy, mesh_shape)
        other_exp = experiment.build(settings_lib.parse(other))
        abstract = sharding.with_shardings(
            other_exp.abstract_state, other_exp.strategy.checkpoint_shardings)
        with contextlib.closing(checkpoint.Checkpointer(workdir, 1)) as ckpt:
          step, restored = ckpt.restore_latest(abstract)
        self.assertEqual(step, 2)
        chex.assert_trees_all_equal(jax.device_get(restored), saved_host)
        state = other_exp.strategy.place_state(restored)
        resumed, losses = _steps(other_exp, other, state, 2, 4)
        if strategy == 'fsdp':
          chex.assert_trees_all_equal(jax.device_get(resumed),
                                      jax.device_get(straight))
        self.assertTrue(np.all(np.isfinite(losses)))


def _toy_loss(params, rng, batch):
  del rng
  loss = jnp.sum(params['w'] * batch['x']) / batch['x'].shape[0]
  return loss, {}


class DataParallelTest(parameterized.TestCase):
  """The library's DataParallel under pmap, on a linear loss whose gradient
  is each replica's mean input."""

  def _step(self, reduce_dtype, scale):
    scaler = haiku_mp.LossScaler('static', initial=scale)
    step = haiku_mp.make_train_step(
        _toy_loss, optax.sgd(1.0), scaler,
        axis_name=haiku_mp.DataParallel('batch', reduce_dtype))
    params = {'w': jnp.zeros([4])}
    state = haiku_mp.init_train_state(params, optax.sgd(1.0), scaler,
                                      jax.random.key(0))
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (8,) + x.shape),
                         state)
    # Every replica's gradient: 10,000 x the scale in float16 range, their
    # sum over the 8 replicas beyond it (65,504).
    x = jnp.full((8, 2, 4), 10_000.0)
    return jax.pmap(step, axis_name='batch')(state, {'x': x})

  def test_a_float16_reduction_that_overflows_is_skipped(self):
    state, metrics = self._step(jnp.float16, 4.0)
    self.assertFalse(bool(metrics['grads_finite'][0]))
    self.assertEqual(int(state.skipped_steps[0]), 1)
    chex.assert_trees_all_equal(state.params['w'], jnp.zeros([8, 4]))

  def test_the_same_reduction_in_float32_is_applied(self):
    state, metrics = self._step(jnp.float32, 4.0)
    self.assertTrue(bool(metrics['grads_finite'][0]))
    np.testing.assert_allclose(state.params['w'][0], -10_000.0)

  @parameterized.parameters((jnp.float32, None, 1e-6),
                            (jnp.bfloat16, 'bfloat16', 0.03))
  def test_a_split_parameter_gets_its_shard_of_the_mean(self, reduce_dtype,
                                                        wire, atol):
    """Split on dimension 1 over 8 devices: gathered whole for the loss,
    each replica's gradient is its shard of the mean over replicas. In
    bfloat16 the gathered weight's gradient and the sum are rounded."""
    mesh = jax.make_mesh((8,), ('batch',),
                         axis_types=(jax.sharding.AxisType.Auto,))
    parallel = haiku_mp.DataParallel(
        'batch', reduce_dtype, {'w': data_parallel.Layout(dim=1, wire=wire)})
    x = jax.random.normal(jax.random.key(1), (8, 3, 16))

    def local(w, x):
      def loss(w32):
        whole = parallel.whole(w32, {'w': w})
        return jnp.sum(whole['w'].astype(jnp.float32) * x[0])
      return jax.grad(loss)({'w': w})

    grads = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P(None, 'batch'), P('batch')),
        out_specs=P(None, 'batch'), check_vma=False))(jnp.zeros((3, 16)), x)
    np.testing.assert_allclose(grads['w'], jnp.mean(x, axis=0), rtol=0,
                               atol=atol)


if __name__ == '__main__':
  absltest.main()
