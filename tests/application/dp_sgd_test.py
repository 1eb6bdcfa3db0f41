"""DP-SGD on JAX Privacy: float32 sums and noise, clipping, skips, accounting."""

import math
import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp import errors
from haiku_mp.vit.data import sampling
from haiku_mp.vit.privacy import dp_sgd
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

F32 = 'float32'
BF16 = 'params=float32,compute=bfloat16,output=float32'
FP16 = 'params=float32,compute=float16,output=float32'
BATCH = 4  # The expected (Poisson) batch size.
EXAMPLES = 100


def _config(policy=F32, loss_scale='none', dropout_rate=0.0, **settings):
  """A one-block ViT (the tests compile per-example gradients) on DP-SGD."""
  config = helpers.tiny_config(policy, loss_scale=loss_scale,
                               dropout_rate=dropout_rate, num_layers=1)
  config.batch_size = BATCH
  config.data.source = 'synthetic'
  config.data.synthetic_train_examples = EXAMPLES
  config.privacy.enabled = True
  config.privacy.update(settings)
  return config


def _batch(config, size: int, real: int, seed: int = 0):
  """A padded batch of `size` rows whose first `real` are sampled."""
  batch = helpers.random_batch(config, size, seed)
  batch['mask'] = (jnp.arange(size) < real).astype(jnp.float32)
  return batch


def _private_gradients(exp):
  """The experiment's private gradients, jitted: (loss scale state, params,
  key, batch) -> (grads, loss, metrics)."""
  grads = dp_sgd.make_gradients(exp.loss_fn, exp.scaler, exp.privacy)
  return jax.jit(lambda scale, params, key, batch: grads(scale, params, key,
                                                         batch))


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel()
                         for x in jax.tree.leaves(tree)])


class PrecisionRulesTest(parameterized.TestCase):
  """JAX Privacy's rules 2 and 3 under half-precision policies."""

  @parameterized.named_parameters(
      ('bf16', BF16, 'bfloat16', 0), ('fp16', FP16, 'float16', 0),
      ('bf16_params', 'params=bfloat16,compute=bfloat16,output=float32',
       'bfloat16', 0),
      ('bf16_microbatched', BF16, 'bfloat16', 2),
      ('fp16_microbatched', FP16, 'float16', 2))
  def test_sums_and_noise_in_float32_gradients_in_compute_dtype(
      self, text, half, microbatch_size):
    config = _config(text, loss_scale='dynamic',
                     microbatch_size=microbatch_size)
    # Traced for a GPU: XLA:CPU upcasts float16 matmuls.
    config.precision.dot_platform = 'gpu'
    exp = experiment.build_without_data(settings_lib.parse(config))
    # Shapes and dtypes: a trace needs no values (no initialization compiled).
    state = exp.abstract_state
    batch = _batch(exp.settings, exp.train_batch_size, BATCH)
    grads = dp_sgd.make_gradients(exp.loss_fn, exp.scaler, exp.privacy)
    closed, out = jax.make_jaxpr(
        lambda scale, p: grads(scale, p, jax.random.key(0), batch)[0],
        return_shape=True)(state.loss_scale, state.params)
    jaxpr = closed.jaxpr
    self.assertEqual({x.dtype for x in jax.tree.leaves(out)},
                     {jnp.dtype(jnp.float32)})
    eqns = list(helpers.iter_eqns(jaxpr))
    params = jax.tree.leaves(state.params)
    shapes = {tuple(p.shape) for p in params}
    # Per-example gradients: the model's matmuls in the compute dtype.
    matmuls = [e for e in eqns if e.primitive.name in helpers.MATMUL_PRIMITIVES]
    self.assertTrue(any(half in helpers.operand_dtypes(e) for e in matmuls))
    # The sums of clipped per-example gradients: one reduction over the
    # examples per parameter, float32 in and out.
    sums = [e for e in eqns if e.primitive.name == 'reduce_sum' and
            e.params['axes'] == (0,) and
            tuple(e.outvars[0].aval.shape) in shapes]
    self.assertGreaterEqual(len(sums), len(params))
    for eqn in sums:
      self.assertEqual({str(v.aval.dtype) for v in eqn.invars + eqn.outvars},
                       {'float32'})
    if microbatch_size:  # Microbatches accumulate in a float32 loop carry.
      loops = [e for e in eqns if e.primitive.name == 'while']
      carried = [v.aval for e in loops for v in e.outvars]
      for p in params:
        self.assertIn(('float32', p.shape),
                      {(str(a.dtype), a.shape) for a in carried})
    # The noise: one float32 normal draw per parameter.
    draws = [e for e in eqns if e.primitive.name == 'erf_inv']
    self.assertEqual(sorted(tuple(e.outvars[0].aval.shape) for e in draws),
                     sorted(tuple(p.shape) for p in params))
    for eqn in draws:
      self.assertEqual(eqn.outvars[0].aval.dtype, jnp.float32)


class ClippingTest(absltest.TestCase):
  """bf16 with a static loss scale; the scale is state, so one compiled
  gradient function serves every scale."""

  CLIP = 0.05

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.exp = experiment.build_without_data(settings_lib.parse(_config(
        BF16, loss_scale='static', l2_clip_norm=cls.CLIP,
        noise_multiplier=0.0)))
    cls.state = cls.exp.strategy.init_state()
    cls.gradients = staticmethod(_private_gradients(cls.exp))
    cls.batch = _batch(cls.exp.settings, cls.exp.train_batch_size, BATCH)

  def _grads(self, batch, scale):
    loss_scale = self.state.loss_scale._replace(
        scale=jnp.asarray(scale, jnp.float32))
    grads, _, metrics = self.gradients(loss_scale, self.state.params,
                                 jax.random.key(0), batch)
    return _flat(grads), metrics

  def test_each_example_is_clipped_to_c_after_unscaling(self):
    """Each example's contribution (the batch with only that example
    sampled, no noise) is its own gradient, unscaled and clipped to C."""
    exp, full, size = self.exp, self.batch, self.exp.train_batch_size

    @jax.jit
    def example_grad(params, image, label):
      one = dict(image=image[None], label=label[None])
      return jax.grad(lambda p: exp.loss_fn(p, jax.random.key(0), one)[0])(
          params)

    for i in range(BATCH):
      only_i = dict(full, mask=(jnp.arange(size) == i).astype(jnp.float32))
      grads, metrics = self._grads(only_i, 2.0**15)
      clipped = grads * BATCH  # The sum is divided by the batch size.
      self.assertLessEqual(np.linalg.norm(clipped), self.CLIP * (1 + 1e-5))
      own = _flat(example_grad(self.state.params, full['image'][i],
                               full['label'][i]))
      self.assertGreater(np.linalg.norm(own), self.CLIP)  # It was clipped.
      self.assertEqual(float(metrics['clipped_fraction']), 1.0)
      self.assertAlmostEqual(float(metrics['example_grad_norm']),
                             np.linalg.norm(own), delta=0.02 * np.linalg.norm(own))
      np.testing.assert_allclose(clipped,
                                 own * self.CLIP / np.linalg.norm(own),
                                 rtol=2e-2, atol=2e-4)

  def test_the_loss_scale_changes_nothing(self):
    """Unscaled before clipping: scales 1 and 2^12 give the same sums (a
    power of two scales bf16 gradients exactly)."""
    unscaled, metrics = self._grads(self.batch, 1.0)
    scaled, scaled_metrics = self._grads(self.batch, 2.0**12)
    np.testing.assert_allclose(scaled, unscaled, rtol=1e-5, atol=1e-9)
    self.assertAlmostEqual(float(scaled_metrics['example_grad_norm']),
                           float(metrics['example_grad_norm']), places=4)


@helpers.long_running
class PrivateStepTest(absltest.TestCase):
  """The whole train step with C = infinity and no noise."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.exp = experiment.build_without_data(settings_lib.parse(_config(
        l2_clip_norm=float('inf'), noise_multiplier=0.0)))
    cls.batch = _batch(cls.exp.settings, cls.exp.train_batch_size, BATCH)

  def test_no_noise_and_no_clipping_is_the_ordinary_step(self):
    ordinary_config = _config()
    ordinary_config.privacy.enabled = False
    ordinary = experiment.build_without_data(
        settings_lib.parse(ordinary_config))
    real = {k: v[:BATCH] for k, v in self.batch.items() if k != 'mask'}
    strategy = self.exp.strategy
    # Both steps from the same state: one initialization compiled, run twice
    # (each step takes its state's buffers).
    p_state, p_metrics = strategy.train_step(strategy.init_state(),
                                             self.batch)
    o_state, o_metrics = ordinary.strategy.train_step(strategy.init_state(),
                                                      real)
    np.testing.assert_allclose(_flat(p_state.params), _flat(o_state.params),
                               rtol=1e-5, atol=1e-7)
    for name in ('loss', 'accuracy', 'grad_norm', 'num_examples'):
      self.assertAlmostEqual(float(p_metrics[name]), float(o_metrics[name]),
                             places=5, msg=name)

  def test_a_non_finite_example_skips_the_step_and_padding_never_does(self):
    batch = self.batch
    poisoned = dict(batch, image=batch['image'].at[1].set(jnp.nan))
    strategy = self.exp.strategy
    state = strategy.init_state()
    before = _flat(state.params)
    state, metrics = strategy.train_step(state, poisoned)
    self.assertFalse(bool(metrics['grads_finite']))
    self.assertEqual(int(state.skipped_steps), 1)
    np.testing.assert_array_equal(_flat(state.params), before)
    # The same NaN image as padding: zeroed by JAX Privacy, the step taken.
    padded = dict(poisoned, mask=poisoned['mask'].at[1].set(0.0))
    state, metrics = strategy.train_step(state, padded)
    self.assertTrue(bool(metrics['grads_finite']))
    self.assertEqual(int(state.skipped_steps), 1)
    self.assertEqual(float(metrics['num_examples']), BATCH - 1)


@helpers.long_running
class StateLayoutTest(absltest.TestCase):

  def test_private_steps_train_bfloat16_state_without_a_master(self):
    """DP-SGD's noisy float32 gradients take the same path into the state
    as ordinary ones: the whole state bfloat16 (but LayerNorm's params), no
    float32 copy, and the loss goes down."""
    config = _config('params=bfloat16,compute=bfloat16,output=float32',
                     l2_clip_norm=1.0, noise_multiplier=0.1)
    config.precision.update(param_update='stochastic', mu_dtype='bfloat16',
                            nu_dtype='bfloat16')
    config.learning_rate = 1e-2
    exp = experiment.build_without_data(settings_lib.parse(config))
    batch = _batch(exp.settings, exp.train_batch_size, BATCH)
    state = exp.strategy.init_state()
    losses = []
    for _ in range(8):
      state, metrics = exp.strategy.train_step(state, batch)
      losses.append(float(metrics['loss']))
    self.assertLess(losses[-1], 0.9 * losses[0])
    self.assertEqual(state.params['vit/head']['w'].dtype, jnp.bfloat16)
    self.assertEqual(
        {x.dtype.name for x in jax.tree.leaves(state.opt_state)
         if x.ndim}, {'bfloat16'})


class NoiseTest(absltest.TestCase):

  def test_one_float32_draw_with_sigma_c_over_b(self):
    settings = dp_sgd.DpSgd(l2_clip_norm=2.0, noise_multiplier=1.5,
                             batch_size=4, num_examples=100, delta=1e-5,
                             padded_batch_size=8)
    zeros = dict(w=jnp.zeros((300, 300), jnp.bfloat16),
                 b=jnp.zeros((1000,), jnp.float32))
    noisy = dp_sgd.add_noise(zeros, jax.random.key(3), settings)
    self.assertEqual({str(x.dtype) for x in jax.tree.leaves(noisy)}, {'float32'})
    values = _flat(noisy)
    expected = 1.5 * 2.0 / 4
    self.assertAlmostEqual(values.std(), expected, delta=0.01 * expected)
    self.assertAlmostEqual(values.mean(), 0.0, delta=0.01 * expected)
    again = dp_sgd.add_noise(zeros, jax.random.key(3), settings)
    np.testing.assert_array_equal(_flat(again), values)  # The key's draw.


@helpers.long_running
class StrategiesTest(parameterized.TestCase):
  """single, pmap (2x1) and pjit (2x2) on 2 and 4 of the CPU devices (the
  batch axis, and the model axis with it): the same noise and the same
  step, dropout included (each example's key is the same)."""

  def test_the_same_noise_and_step_under_every_strategy(self):
    results = {}
    for name, layout in (('single', (1, 1)), ('pmap', (2, 1)),
                         ('pjit', (2, 2))):
      config = _config(dropout_rate=0.1, noise_multiplier=2.0,
                       l2_clip_norm=0.1, microbatch_size=1)
      config.batch_size = 8
      config.parallel.strategy = name
      config.parallel.mesh_shape = layout
      exp = experiment.build(settings_lib.parse(config),
                             devices=jax.devices()[:math.prod(layout)])
      # One batch for all (24 rows: 2 or 4 devices, microbatches of 1 per
      # device).
      sampled = _batch(config, 24, 8)
      noise_only = dict(sampled, mask=jnp.zeros(24))
      strategy = exp.strategy
      runs = []
      for batch in (noise_only, sampled):
        state, metrics = strategy.train_step(
            strategy.init_state(), strategy.place_batch(
                jax.tree.map(np.asarray, batch)))
        # Host copies (a replica's view under pmap): no device op per leaf.
        params, norm = strategy.to_host((state.params, metrics['grad_norm']))
        runs.append((_flat(params), float(norm)))
      results[name] = runs
    expected_noise_norm = 2.0 * 0.1 / 8 * np.sqrt(len(results['single'][0][0]))
    self.assertAlmostEqual(results['single'][0][1], expected_noise_norm,
                           delta=0.05 * expected_noise_norm)
    for name in ('pmap', 'pjit'):
      for (params, norm), (want_params, want_norm) in zip(results[name],
                                                          results['single']):
        np.testing.assert_allclose(params, want_params, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        self.assertAlmostEqual(norm, want_norm, delta=1e-4 * want_norm,
                               msg=name)


class SamplingTest(absltest.TestCase):

  def test_poisson_batches_padded_and_replayable(self):
    settings = dp_sgd.DpSgd(1.0, 1.0, batch_size=20, num_examples=1000,
                             delta=1e-5, padded_batch_size=36,
                             microbatch_size=4)
    batches = list(sampling.poisson_batches(7, settings, total_steps=400))
    self.assertLen(batches, 400)
    sizes = []
    for indices in batches:
      self.assertEqual(len(indices) % 36, 0)
      sampled = indices[indices >= 0]
      self.assertTrue(np.all(indices[indices < 0] == -1))
      self.assertLen(set(sampled), len(sampled))  # No example twice.
      self.assertTrue(np.all(sampled < 1000))
      sizes.append(len(sampled))
    # Binomial(1000, 0.02): mean 20, std 4.4; over 400 steps.
    self.assertAlmostEqual(np.mean(sizes), 20, delta=1.0)
    self.assertAlmostEqual(np.std(sizes), np.sqrt(1000 * 0.02 * 0.98),
                           delta=0.6)
    resumed = list(sampling.poisson_batches(7, settings, 400, start_step=397))
    for a, b in zip(resumed, batches[397:]):
      np.testing.assert_array_equal(a, b)
    other_seed = next(sampling.poisson_batches(8, settings, 400))
    self.assertFalse(np.array_equal(other_seed, batches[0]))

  def test_padded_size_divides_devices_and_microbatches(self):
    # 128 + 3 * sqrt(45000 q (1 - q)) = 161.9 for q = 128 / 45000.
    self.assertEqual(dp_sgd.padded_batch_size(128, 45000, 3.0, 1), 162)
    self.assertEqual(dp_sgd.padded_batch_size(128, 45000, 3.0, 32), 192)
    self.assertEqual(dp_sgd.padded_batch_size(128, 45000, 0.0, 8), 128)


class AccountingTest(absltest.TestCase):

  def test_epsilon_is_the_accountants(self):
    from jax_privacy import accounting  # pylint: disable=g-import-not-at-top
    ours = dp_sgd.epsilon(500, 1.1, 45000, 256, 1e-5)
    direct = accounting.DpsgdTrainingAccountant(
        accounting.PldAccountantConfig()).compute_epsilon(
            500, accounting.DpParams(noise_multipliers=1.1, num_samples=45000,
                                     delta=1e-5, batch_size=256))
    self.assertEqual(ours, direct)
    self.assertEqual(dp_sgd.epsilon(0, 1.1, 45000, 256, 1e-5), 0.0)
    self.assertEqual(dp_sgd.epsilon(5, 0.0, 45000, 256, 1e-5), float('inf'))

  def test_calibration_hits_the_target_within_one_percent(self):
    # Small enough for the accountant to answer in seconds.
    config = _config(target_epsilon=2.0, delta=1e-5)
    config.batch_size = 100
    settings = dp_sgd.from_config(config.privacy, config.batch_size, 1000,
                                  total_steps=50, batch_devices=1)
    self.assertTrue(settings.calibrated)
    spent = dp_sgd.epsilon(50, settings.noise_multiplier, 1000, 100, 1e-5)
    self.assertAlmostEqual(spent, 2.0, delta=0.02)
    self.assertLessEqual(spent, 2.0)

  def test_bad_settings_name_themselves(self):
    for setting, value, message in (
        ('l2_clip_norm', 0.0, 'privacy.l2_clip_norm=0.0 must be positive'),
        ('noise_multiplier', -1.0, 'privacy.noise_multiplier=-1.0'),
        ('delta', 1.0, r'privacy.delta=1.0 must be in \(0, 1\)'),
        ('target_epsilon', -2.0, 'privacy.target_epsilon=-2.0'),
        ('microbatch_size', -1, 'privacy.microbatch_size=-1'),
        ('padding_stddevs', -1.0, 'privacy.padding_stddevs=-1.0'),
        ('l2_clip_norm', float('inf'), 'privacy.l2_clip_norm=inf bounds no')):
      config = _config(**{setting: value})
      with self.assertRaisesRegex(errors.ConfigError, message):
        settings_lib.parse(config)
    config = _config()
    config.batch_size = 200
    with self.assertRaisesRegex(errors.ConfigError, 'batch_size=200'):
      dp_sgd.from_config(config.privacy, config.batch_size, EXAMPLES, 10, 1)


if __name__ == '__main__':
  absltest.main()
