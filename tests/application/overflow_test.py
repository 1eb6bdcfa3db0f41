"""float16 overflow storms, hysteresis, diverging runs: handled and reported."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorflow_datasets as tfds

from haiku_mp.update import loss_scaling
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import loop
from tests import helpers

OVERFLOW, FINITE = jnp.asarray(False), jnp.asarray(True)


class HysteresisTest(parameterized.TestCase):

  def _scales(self, scaler, pattern):
    adjust = jax.jit(scaler.adjust)
    state, scales = scaler.init(), []
    for finite in pattern:
      state = adjust(state, jnp.asarray(finite))
      scales.append(float(state.scale))
    return scales, state

  def test_alternating_overflows_back_off(self):
    # Finite and overflowing steps in turn: the 2nd overflow since the start
    # backs off, and so does every one after, consecutive or not.
    scaler = loss_scaling.LossScaler('dynamic', initial=1024.0, hysteresis=2,
                                     period=100)
    scales, _ = self._scales(scaler, [True, False] * 4)
    self.assertEqual(scales, [1024, 1024, 1024, 512, 512, 256, 256, 128])

  def test_burst_then_growth_restores_the_hysteresis(self):
    scaler = loss_scaling.LossScaler('dynamic', initial=1024.0, hysteresis=3,
                                     period=2, minimum=64.0)
    pattern = [False] * 5 + [True, True] + [False] * 3
    scales, state = self._scales(scaler, pattern)
    self.assertEqual(scales, [1024, 1024, 512, 256, 128,  # burst: 3rd on
                              128, 256,  # growth: 3 overflows allowed again
                              256, 256, 128])
    self.assertEqual((int(state.hysteresis), int(state.overflows)), (0, 3))
    # The floor holds.
    scales, _ = self._scales(scaler, [False] * 12)
    self.assertEqual(scales[-1], 64.0)

  @parameterized.parameters(1, 2, 3)
  def test_matches_megatron_dynamic_grad_scaler(self, k):
    """Against a plain-Python copy of Megatron-LM's DynamicGradScaler.update."""
    pattern = list(np.random.default_rng(k).random(300) < 0.7)
    scaler = loss_scaling.LossScaler('dynamic', initial=2.0**15, hysteresis=k,
                                     period=4, factor=2.0, minimum=1.0)
    scale, growth, left, expected = 2.0**15, 0, k, []
    for finite in pattern:
      if not finite:
        growth, left = 0, left - 1
        if left <= 0:
          scale = max(scale / 2, 1.0)
      else:
        growth += 1
        if growth == 4:
          growth, left, scale = 0, k, scale * 2
      expected.append(scale)
    self.assertEqual(self._scales(scaler, pattern)[0], expected)

  def test_hysteresis_one_backs_off_on_every_overflow(self):
    scaler = loss_scaling.LossScaler('dynamic', initial=1024.0, period=100)
    scales, _ = self._scales(scaler, [False, True, False, False])
    self.assertEqual(scales, [512, 512, 256, 128])

  def test_check_stops_only_when_stuck(self):
    dynamic = loss_scaling.LossScaler('dynamic', minimum=4.0,
                                      max_consecutive_skips=3)
    dynamic.check(10, scale=4.0, consecutive_skips=2, skipped_in_window=2)
    dynamic.check(10, scale=8.0, consecutive_skips=9, skipped_in_window=9)
    with self.assertRaisesRegex(loss_scaling.LossScaleError,
                                'max_consecutive_skips.*step 10'):
      dynamic.check(10, scale=4.0, consecutive_skips=3, skipped_in_window=3)
    none = loss_scaling.LossScaler('none')
    none.check(5, scale=1.0, consecutive_skips=0, skipped_in_window=0)
    with self.assertRaisesRegex(loss_scaling.LossScaleError,
                                'kind=none: non-finite'):
      none.check(5, scale=1.0, consecutive_skips=0, skipped_in_window=1)


def _events(workdir, split='train'):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [e for e in map(json.loads, f) if e['split'] == split]


class OverflowStormTest(parameterized.TestCase):

  def test_absurd_initial_scale_falls_then_training_goes_on(self):
    config = helpers.tiny_config(
        'params=float32,compute=float16,output=float32', loss_scale='dynamic')
    config.loss_scale.initial = 2.0**40
    config.loss_scale.factor = 4.0
    config.batch_size = config.eval_batch_size = 16
    config.num_train_steps = 40
    config.log_every_steps = 1
    config.eval_every_steps = 40
    config.checkpoint_every_steps = 40
    config.learning_rate = 3e-3
    config.model.update(image_size=32, patch_size=8, dropout_rate=0.0)
    config.data.augment = False
    workdir = self.enter_context(tempfile.TemporaryDirectory())
    # 16 fixed examples (a no-op download under mock_data): learnable.
    with self.assertLogs(level='WARNING') as logs, \
        tfds.testing.mock_data(num_examples=16):
      summary = loop.train_and_evaluate(settings_lib.parse(config), workdir)
    events = _events(workdir)
    skipped = [e['step'] for e in events if e['window_skipped_steps']]
    self.assertNotEmpty(skipped)
    self.assertEqual(skipped, list(range(1, len(skipped) + 1)))  # The first.
    scales = [e['loss_scale'] for e in events]
    self.assertEqual(scales[0], 2.0**40)
    for k in range(len(skipped)):  # Divided by the factor on each overflow.
      self.assertEqual(scales[k + 1], scales[k] / 4)
    self.assertEqual(summary['skipped_steps'], len(skipped))
    self.assertLess(len(skipped), 20)
    finite_losses = [e['loss'] for e in events[len(skipped):]]
    self.assertLess(np.mean(finite_losses[-5:]), finite_losses[0])
    self.assertIn('non-finite gradients in vit/', '\n'.join(logs.output))
    restored = ocp.StandardCheckpointer().restore(
        os.path.join(workdir, 'checkpoints', '40', 'default'))
    for leaf in jax.tree.leaves((restored['params'], restored['opt_state'])):
      self.assertTrue(np.isfinite(leaf).all())


@helpers.long_running
class DivergenceTest(parameterized.TestCase):

  def _run(self, workdir, *flags):
    return helpers.run_module(
        'launch.train', *flags, f'--workdir={workdir}',
        '--config.data.source=synthetic', '--config.num_train_steps=30',
        '--config.log_every_steps=1', '--config.eval_every_steps=30',
        '--config.checkpoint_every_steps=1', '--config.batch_size=16',
        '--config.eval_batch_size=16',
        '--config.data.synthetic_eval_examples=16',
        '--config.data.synthetic_train_examples=64', *helpers.TINY_MODEL_FLAGS,
        '--config.learning_rate=1e38')

  # Without dynamic scaling (float32 or bfloat16: the same check of the same
  # loss scale, kind=none), and at the floor.
  @parameterized.named_parameters(
      ('bf16', ['--config=configs/vit_bf16.py'], 'loss_scale.kind=none'),
      ('fp16_at_floor', ['--config=configs/vit_fp16.py',
                         '--config.loss_scale.initial=1',
                         '--config.loss_scale.max_consecutive_skips=3'],
       'loss_scale.max_consecutive_skips'))
  def test_diverging_run_stops_with_one_line(self, flags, message):
    workdir = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                           'run')
    result = self._run(workdir, *flags)
    self.assertNotEqual(result.returncode, 0)
    last = result.stderr.strip().splitlines()[-1]
    self.assertTrue(last.startswith('error: '), last)
    self.assertIn(message, last)
    self.assertNotIn('Traceback', result.stderr)
    steps = sorted(int(s) for s in os.listdir(f'{workdir}/checkpoints'))
    self.assertNotEmpty(steps)
    restored = ocp.StandardCheckpointer().restore(
        os.path.join(workdir, 'checkpoints', str(steps[-1]), 'default'))
    for leaf in jax.tree.leaves(restored['params']):
      self.assertTrue(np.isfinite(leaf).all())
    self.assertFalse(os.path.exists(f'{workdir}/summary.json'))


if __name__ == '__main__':
  absltest.main()
