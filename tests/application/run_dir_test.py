"""metrics.jsonl and TensorBoard: the same points, non-finite ones included."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json
import math
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from haiku_mp.vit.train import console
from haiku_mp.vit.train import run_dir
from tests import helpers


class MetricsWriterTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.workdir = self.enter_context(tempfile.TemporaryDirectory())

  def test_non_finite_values_reach_tensorboard(self):
    writer = run_dir.MetricsWriter(self.workdir)
    for step, grad_norm in ((1, 0.5), (2, np.float32(np.inf)),
                            (3, np.float32(np.nan)), (4, -math.inf)):
      writer.write(step, 'train', dict(loss=np.float32(2.0), skipped_steps=1,
                                       grad_norm=grad_norm))
    writer.close()
    scalars = helpers.tensorboard_scalars(f'{self.workdir}/tensorboard')
    self.assertEqual(scalars['train/grad_norm'],
                     [(1, 0.5), (2, math.inf), (3, 'nan'), (4, -math.inf)])
    self.assertEqual(scalars, helpers.jsonl_scalars(self.workdir))

  def test_a_restart_drops_the_points_of_the_killed_run_after_it(self):
    killed = run_dir.MetricsWriter(self.workdir)
    for step in range(1, 9):
      killed.write(step, 'train', dict(loss=float(step)))
    killed.flush()  # On disk, as if flushed just before a kill.
    run_dir.truncate_after(self.workdir, 5)  # What a resume at step 5 does.
    # Most likely within the second the killed writer opened in: the event
    # files' names must still order the resumed one after it.
    resumed = run_dir.MetricsWriter(self.workdir, start_step=5)
    for step in range(6, 11):
      resumed.write(step, 'train', dict(loss=10.0 * step))
    resumed.close()
    scalars = helpers.tensorboard_scalars(f'{self.workdir}/tensorboard')
    self.assertEqual(scalars['train/loss'],
                     [(s, float(s)) for s in range(1, 6)] +
                     [(s, 10.0 * s) for s in range(6, 11)])
    self.assertEqual(scalars, helpers.jsonl_scalars(self.workdir))

  def test_a_resume_at_the_last_step_drops_its_test_events(self):
    writer = run_dir.MetricsWriter(self.workdir)
    for step in range(1, 5):
      writer.write(step, 'train', dict(loss=1.0))
    writer.write(4, 'val', dict(loss=1.0))
    writer.write(4, 'val_ema', dict(loss=1.0))
    writer.write(4, 'test', dict(loss=1.0))
    writer.write(4, 'test_ema', dict(loss=1.0))  # Killed before the summary.
    writer.close()
    self.assertEqual(run_dir.truncate_after(self.workdir, 4), 2)
    self.assertEqual([(e['step'], e['split'])
                      for e in map(json.loads, open(f'{self.workdir}/metrics.jsonl'))],
                     [(1, 'train'), (2, 'train'), (3, 'train'), (4, 'train'),
                      (4, 'val'), (4, 'val_ema')])

  def test_progress_counts_only_the_running_clock_over_every_segment(self):
    times = iter([10.0, 12.0, 13.0, 20.0, 20.0, 21.0])
    progress = console.Progress(total_steps=10, batch_size=4, start_step=2,
                                record=dict(train_sec=6.0, train_steps=2,
                                            eval_sec=1.0),
                                clock=lambda: next(times))
    progress.start(2)  # 10.0
    progress.stop(4)  # 12.0: 2 steps in 2 s, then an evaluation.
    progress.eval_seconds += 5.0
    progress.start(4)  # 13.0
    rates = progress.update(6)  # 20.0: 2 more steps in 7 s; restarts at 20.
    progress.stop(7)  # 21.0
    progress.stop(7)  # Stopped: nothing more counts.
    self.assertEqual(rates, dict(images_per_sec=4 * 4 / 9, eta_sec=4 / (4 / 9)))
    self.assertEqual(progress.record(), dict(train_sec=16.0, train_steps=7,
                                             eval_sec=6.0))
    self.assertEqual(progress.mean_images_per_sec, 7 * 4 / 16.0)

  def test_the_summary_line_is_rounded_and_names_the_file(self):
    summary = dict(test_accuracy=0.39875, test_loss=1.65432109,
                   val_accuracy=0.4002, val_loss=1.6412345, steps=300,
                   skipped_steps=0, final_loss_scale=32768.0,
                   images_per_sec=125.64756154787665, train_time_sec=199.7,
                   eval_time_sec=25.2)
    self.assertEqual(
        console.summary_line(summary, 'runs/first/summary.json'),
        'Summary: test 39.88% (loss 1.6543), val 40.02% (loss 1.6412); 300 '
        'steps, 0 skipped, final loss scale 32768; 126 img/s, train 3m19s, '
        'eval 0m25s. Every figure: runs/first/summary.json')
    private = dict(summary, epsilon=2.314, val_accuracy=None, val_loss=None,
                   ema_test_accuracy=0.41, ema_val_accuracy=0.415)
    self.assertEqual(
        console.summary_line(private, 's.json'),
        'Summary: test 39.88% (loss 1.6543), val -; moving average: test '
        '41.00%, val 41.50%; 300 steps, 0 skipped, final loss scale 32768; '
        'epsilon 2.31; 126 img/s, train 3m19s, eval 0m25s. Every figure: '
        's.json')

  def test_flush_puts_every_point_on_disk(self):
    writer = run_dir.MetricsWriter(self.workdir)
    for step in range(1, 50):
      writer.write(step, 'train', dict(loss=1.0))
    writer.flush()  # Not closed: what a kill right after a checkpoint leaves.
    scalars = helpers.tensorboard_scalars(f'{self.workdir}/tensorboard')
    self.assertLen(scalars['train/loss'], 49)
    writer.close()


if __name__ == '__main__':
  absltest.main()
