"""Rematerialization: what each `remat` setting keeps, and that it changes
nothing but memory."""

import functools
import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax

from configs import base
from haiku_mp import errors
from haiku_mp.lab.studies import memory
from haiku_mp.lab import variants
from haiku_mp.model import remat
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

BF16 = 'params=float32,compute=bfloat16,output=float32'
# The block-internal module classes whose outputs each setting may keep
# (`EncoderBlock`: a block's output, the next block's input).
KEPT_INSIDE = {'dots': {'Linear', 'EncoderBlock'}, 'full': {'EncoderBlock'}}


def _config(remat_setting, policy=helpers.tiny_config().precision.policy):
  # Two blocks: a block's output is kept as the next one's input.
  config = helpers.tiny_config(policy, num_layers=2)
  config.remat = remat_setting
  return config


@functools.cache
def _reference_experiment(setting, dtype):
  """The reference model itself, in `dtype` with `setting`: one build for
  every batch size its residuals are traced at (the batch is the trace's)."""
  config = base.get_config()
  config.remat = setting
  return experiment.build_without_data(variants.variant_settings(
      settings_lib.parse(config), dtype, config.batch_size, 'single:1x1'))


@functools.cache
def _reference_kept_bytes(setting, dtype, batch_size):
  """The bytes the reference model's backward pass keeps, traced abstractly
  (no FLOPs, no memory): the reference model itself."""
  return memory.residual_summary(_reference_experiment(setting, dtype),
                                 batch_size)['kept_bytes']


@helpers.long_running
class RematTest(parameterized.TestCase):

  def test_unknown_setting_is_a_config_error(self):
    with self.assertRaisesRegex(errors.ConfigError, "remat: unknown value 'some'"):
      experiment.build_without_data(settings_lib.parse(_config('some')))
    # A library call, without `build`'s check: where the blocks are wrapped.
    config = _config('some')
    forward = forward_lib.make_forward(
        config.model, forward_lib.precision_from_config(config),
        remat='some')
    with self.assertRaisesRegex(errors.ConfigError, "remat: unknown value 'some'"):
      forward.init(jax.random.key(0), forward_lib.dummy_images(config.model),
                   True)

  @parameterized.parameters('dots', 'full')
  def test_keeps_only_what_the_setting_names(self, setting):
    exp = experiment.build_without_data(
        settings_lib.parse(_config(setting, BF16)))
    classes = {c.path: c.class_name for c in exp.module_calls}
    kept = {classes[r['module']] for r in memory.saved_residuals(exp, 8)
            if r['source'] == 'activation' and 'encoder_block' in r['module']
            and 'float' in r['dtype']}
    self.assertNotEmpty(kept)
    self.assertContainsSubset(kept, KEPT_INSIDE[setting])

  @parameterized.product(setting=('dots', 'full'), batch_size=(128, 4096))
  def test_half_precision_keeps_at_most_055_of_float32(self, setting,
                                                       batch_size):
    kept = {dtype: _reference_kept_bytes(setting, dtype, batch_size)
            for dtype in ('float32', 'bfloat16', 'float16')}
    self.assertLess(kept['float32'],
                    0.25 * _reference_kept_bytes('none', 'float32', batch_size))
    self.assertLessEqual(kept['bfloat16'], 0.55 * kept['float32'])
    self.assertLessEqual(kept['float16'], 0.55 * kept['float32'])

  def test_same_params_loss_and_gradients_with_dropout(self):
    batch = helpers.random_batch(_config('none'))
    rng = jax.random.key(1)
    results = {}
    for setting in remat.CHOICES:
      exp = experiment.build_without_data(settings_lib.parse(_config(setting)))
      params = jax.jit(lambda key, images, exp=exp: exp.forward.init(
          key, images, True))(jax.random.key(0), batch['image'])
      loss = lambda p: exp.loss_fn(p, rng, batch)[0]
      results[setting] = jax.jit(jax.value_and_grad(loss))(params)
    for setting in ('dots', 'full'):
      chex.assert_trees_all_equal_shapes_and_dtypes(results[setting],
                                                    results['none'])
      chex.assert_trees_all_close(results[setting], results['none'],
                                  rtol=1e-5, atol=1e-6)


if __name__ == '__main__':
  absltest.main()
