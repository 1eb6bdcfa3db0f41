"""DP-SGD on JAX Privacy: float32 sums and noise, clipping, accounting."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp import errors
from haiku_mp import experiment
from haiku_mp import privacy
from tests import helpers

BF16 = 'params=float32,compute=bfloat16,output=float32'
FP16 = 'params=float32,compute=float16,output=float32'
BATCH = 4


def _setup(policy, dropout_rate=0.0):
  config = helpers.tiny_config(policy, dropout_rate=dropout_rate)
  config.batch_size = BATCH
  exp = experiment.build_without_data(config)
  params = exp.init_state().params
  return exp, params, helpers.random_batch(config, BATCH)


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel()
                         for x in jax.tree.leaves(tree)])


class ClippedSumTest(parameterized.TestCase):

  @parameterized.named_parameters(('bf16', BF16, 'bfloat16'),
                                  ('fp16', FP16, 'float16'))
  def test_half_gradients_clipped_and_summed_in_float32(self, policy, half):
    exp, params, batch = _setup(policy)
    clip = 0.05
    settings = privacy.DpSgd(clip, 0.0, BATCH).check()
    run = privacy.clipped_sum(exp.loss_fn, settings)
    summed, norms = run(params, jax.random.key(0), batch)
    for leaf in jax.tree.leaves(summed):
      self.assertEqual(leaf.dtype, jnp.float32)
    # Every per-example gradient is larger than C here: all are clipped.
    self.assertTrue(np.all(np.asarray(norms) > clip))
    # The per-example gradients are the model's own, in the compute dtype
    # (as a GPU runs them: XLA:CPU's float16 matmuls are upcast).
    with helpers.dots_as_on('gpu'):
      dots = helpers.eqns_of(privacy.clipped_sum(exp.loss_fn, settings),
                             params, jax.random.key(0), batch)
    self.assertTrue(any(half in helpers.operand_dtypes(e) for e in dots))
    # Against each example's gradient clipped and summed here in float64.
    expected = 0
    for i in range(BATCH):
      one = jax.tree.map(lambda x: x[i:i + 1], batch)
      grad = _flat(jax.grad(lambda p: exp.loss_fn(p, jax.random.key(0),
                                                  one)[0])(params))
      expected = expected + grad * min(1.0, clip / np.linalg.norm(grad))
    np.testing.assert_allclose(_flat(summed), expected, rtol=2e-2, atol=1e-4)
    self.assertLessEqual(np.linalg.norm(_flat(summed)), BATCH * clip * 1.001)

  def test_no_noise_and_no_clipping_is_the_ordinary_gradient(self):
    exp, params, batch = _setup('float32')
    settings = privacy.DpSgd(float('inf'), 0.0, BATCH)
    summed, _ = privacy.clipped_sum(exp.loss_fn, settings)(
        params, jax.random.key(0), batch)
    private = privacy.add_noise(summed, jax.random.key(1), settings)
    ordinary = jax.grad(lambda p: exp.loss_fn(p, jax.random.key(0),
                                              batch)[0])(params)
    np.testing.assert_allclose(_flat(private), _flat(ordinary), rtol=1e-5,
                               atol=1e-7)


class NoiseTest(absltest.TestCase):

  def test_one_float32_draw_with_sigma_c_over_b(self):
    settings = privacy.DpSgd(l2_clip_norm=2.0, noise_multiplier=1.5,
                             batch_size=4)
    zeros = dict(w=jnp.zeros((300, 300), jnp.bfloat16),
                 b=jnp.zeros((1000,), jnp.float32))
    noisy = privacy.add_noise(zeros, jax.random.key(3), settings)
    self.assertEqual({str(x.dtype) for x in jax.tree.leaves(noisy)}, {'float32'})
    values = _flat(noisy)
    expected = 1.5 * 2.0 / 4
    self.assertAlmostEqual(values.std(), expected, delta=0.01 * expected)
    self.assertAlmostEqual(values.mean(), 0.0, delta=0.01 * expected)
    again = privacy.add_noise(zeros, jax.random.key(3), settings)
    np.testing.assert_array_equal(_flat(again), values)  # The key's draw.


class AccountingTest(absltest.TestCase):

  def test_epsilon_is_the_accountants(self):
    from jax_privacy import accounting  # pylint: disable=g-import-not-at-top
    ours = privacy.epsilon(500, 1.1, 45000, 256, 1e-5)
    direct = accounting.DpsgdTrainingAccountant(
        accounting.PldAccountantConfig()).compute_epsilon(
            500, accounting.DpParams(noise_multipliers=1.1, num_samples=45000,
                                     delta=1e-5, batch_size=256))
    self.assertEqual(ours, direct)
    self.assertEqual(privacy.epsilon(0, 1.1, 45000, 256, 1e-5), 0.0)

  def test_calibration_hits_the_target_within_one_percent(self):
    sigma = privacy.calibrate_noise(8.0, 1000, 45000, 256, 1e-5)
    spent = privacy.epsilon(1000, sigma, 45000, 256, 1e-5)
    self.assertAlmostEqual(spent, 8.0, delta=0.08)

  def test_bad_settings_name_themselves(self):
    for settings, message in (
        (privacy.DpSgd(0.0, 1.0, 8), 'privacy.l2_clip_norm=0.0'),
        (privacy.DpSgd(1.0, -1.0, 8), 'privacy.noise_multiplier=-1.0'),
        (privacy.DpSgd(1.0, 1.0, 8, 3), 'privacy.microbatch_size=3')):
      with self.assertRaisesRegex(errors.ConfigError, message):
        settings.check()
    with self.assertRaisesRegex(errors.ConfigError, 'target_epsilon=0'):
      privacy.calibrate_noise(0, 10, 100, 10, 1e-5)


if __name__ == '__main__':
  absltest.main()
