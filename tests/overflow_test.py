"""float16 overflow storms, hysteresis, diverging runs: handled and reported."""

import json
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorflow_datasets as tfds

from haiku_mp import loss_scaling
from haiku_mp import trainer
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERFLOW, FINITE = jnp.asarray(False), jnp.asarray(True)


class HysteresisTest(parameterized.TestCase):

  def test_backs_off_on_every_kth_consecutive_overflow(self):
    scaler = loss_scaling.LossScaler('dynamic', initial=1024.0, hysteresis=3,
                                     minimum=256.0)
    adjust = jax.jit(scaler.adjust)
    state, scales = scaler.init(), []
    for finite in (False, False, False, True, False, False, False, False,
                   False, False):
      state = adjust(state, jnp.asarray(finite))
      scales.append(float(state.scale))
    self.assertEqual(scales, [1024, 1024, 512, 512, 512, 512, 256, 256, 256,
                              256])  # The floor holds too.
    self.assertEqual(int(state.overflows), 6)

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
      summary = trainer.train_and_evaluate(config, workdir)
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


class DivergenceTest(parameterized.TestCase):

  def _run(self, workdir, *flags):
    return subprocess.run(
        [sys.executable, '-m', 'launch.train', *flags, f'--workdir={workdir}',
         '--config.data.source=synthetic', '--config.num_train_steps=30',
         '--config.log_every_steps=1', '--config.eval_every_steps=30',
         '--config.checkpoint_every_steps=1', '--config.batch_size=16',
         '--config.eval_batch_size=16',
         '--config.data.synthetic_eval_examples=16',
         '--config.model.num_layers=1', '--config.model.embed_dim=16',
         '--config.model.mlp_dim=16', '--config.model.num_heads=2',
         '--config.learning_rate=1e38'],
        cwd=ROOT, capture_output=True, text=True)

  @parameterized.named_parameters(
      ('fp32', ['--config=configs/vit_fp32.py'], 'loss_scale.kind=none'),
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
