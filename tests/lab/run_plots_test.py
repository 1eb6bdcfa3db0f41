"""Tests for run plots and `python -m launch.plot`."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
from matplotlib import figure as mpl_figure

from haiku_mp.lab import charts
from haiku_mp.lab.report import report
from haiku_mp.lab import run_plots
from haiku_mp.lab.studies import dot_algorithms
from haiku_mp.lab.studies import lost_updates
from haiku_mp.lab.studies import matmul
from haiku_mp.lab.studies import matmul_precision
from haiku_mp.lab.studies import memory
from haiku_mp.lab.studies import params
from haiku_mp.lab.studies import profile
from haiku_mp.lab.studies import sweep
from haiku_mp.update import state_layout
from tests import helpers

DTYPES = ('float32', 'bfloat16', 'float16')
MIB = 2**20
# A curve of points at every height of its panel, in a scattered order: a
# legend inside the axes covers some of them wherever it goes.
SCATTER_POINTS = 24
SCATTER_STRIDE = 7  # Coprime with SCATTER_POINTS: each height once.


def _scattered():
  """(step, height) pairs that fill a panel."""
  return [(s, s * SCATTER_STRIDE % SCATTER_POINTS)
          for s in range(SCATTER_POINTS)]


def _sweep_result(value=1.0):
  """Two batch sizes, every dtype's bar equally tall: bars in every corner
  of the axes, where a legend inside must cover one."""
  return dict(device='cpu', results=[
      dict(layout='single:1x1', batch_size=b, dtype=d,
           compiled_total_bytes=value * MIB, median_step_sec=value,
           epoch_sec=value) for b in (8, 16) for d in DTYPES])


def _memory_result():
  breakdown = dict(params_bytes=MIB, float32_gradient_bytes=MIB,
                   opt_state_bytes=2 * MIB, kept_activation_bytes=3 * MIB,
                   temp_size_in_bytes=4 * MIB)
  return dict(device='cpu', results=[
      dict(batch_size=b, dtype=d, breakdown=breakdown)
      for b in (8, 16) for d in DTYPES])


def _write_metrics(workdir, events):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    f.writelines(json.dumps(e) + '\n' for e in events)


def _accuracy_result(tmp, events):
  """The report's accuracy part, each dtype's run writing `events`."""
  runs = []
  for d in DTYPES:
    _write_metrics(os.path.join(tmp, d), events)
    runs.append(dict(dtype=d, seed=0, workdir=d))
  return dict(runs=runs, data_source='synthetic', device='cpu')


def _report_memory_result():
  return dict(device='cpu', quick=True, results=[
      dict(batch_size=8, dtype=d, compiled_total_bytes=MIB) for d in DTYPES])


# One tiny result per plot the lab writes: (name, plot function, result).
LAB_PLOTS = (
    ('params', params.plot, lambda tmp: dict(totals={
        d: dict(megabytes=1.0, count=1) for d in DTYPES},
        state_layouts=[dict(layout=name, per_parameter=dict(
            dict.fromkeys(state_layout.PARTS, 2.0), total=16.0))
                       for name in ('float32', 'bf16 kahan, bf16 moments')])),
    ('rounding', lost_updates.plot, lambda tmp: dict(
        step=10, learning_rate=1e-3,
        groups=[dict(name='MLP weights', lost_nearest=0.5,
                     lost_stochastic=0.01)],
        total=dict(name='all params', lost_nearest=0.4,
                   lost_stochastic=-0.01))),
    ('sweep', sweep.plot, lambda tmp: _sweep_result()),
    ('memory', memory.plot, lambda tmp: _memory_result()),
    ('precision', matmul_precision.plot, lambda tmp: dict(
        device='cpu', batch_size=8,
        matmul=[dict(dtype=d, matmul_precision=p, grads_relative_error=1e-3)
                for d in DTYPES for p in ('default', 'highest')],
        residual=[dict(dtype=d, residual_stream=s, kept_activation_bytes=MIB,
                       grads_relative_error=1e-3)
                  for d in DTYPES for s in ('compute', 'float32')])),
    ('matmul', matmul.plot, lambda tmp: dict(
        shape=[2, 2], device='cpu',
        results=[dict(dtype=d, gflops_per_sec=1.0) for d in DTYPES])),
    ('dot_algorithms', dot_algorithms.plot, lambda tmp: dict(
        device='cpu', results=[dict(algorithm='F32_F32_F32', compiles=True,
                                    relative_error=1e-7)])),
    ('profile', profile.plot, lambda tmp: dict(
        policy='p=f32,c=bf16,o=f32', batch_size=8, device='cpu', step_ms=[2.0],
        busy_ms_per_step=1.0, ms_per_step_by_module={'vit/head': 1.0})),
    ('report_benchmark', report._benchmark_plot, lambda tmp: dict(
        device='cpu', results=[dict(batch_size=8, dtype=d, images_per_sec=1.0)
                               for d in DTYPES])),
    ('report_memory', report._memory_plot, lambda tmp: _report_memory_result()),
    ('report_accuracy', report._accuracy_plot, lambda tmp: _accuracy_result(
        tmp, [dict(step=s, split='train', loss=1.0, loss_scale=1.0)
              for s in (2, 4)] + [dict(step=4, split='val', accuracy=0.5)])),
)



class PlotsTest(absltest.TestCase):

  def test_plot_from_workdirs(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    for name, scale in (('fp32', 1.0), ('fp16', 2.0**15)):
      os.makedirs(os.path.join(tmp, name))
      with open(os.path.join(tmp, name, 'metrics.jsonl'), 'w') as f:
        for step in (10, 20):
          f.write(json.dumps(dict(step=step, split='train', loss=2.0 / step,
                                  loss_scale=scale)) + '\n')
        f.write(json.dumps(dict(step=20, split='val', accuracy=0.3)) + '\n')
    self.assertLen(run_plots.read_metrics(os.path.join(tmp, 'fp16')), 3)
    out = os.path.join(tmp, 'runs.png')
    helpers.run_module('launch.plot', f'--workdirs={tmp}/fp32,{tmp}/fp16',
                       f'--out={out}', check=True)
    with open(out, 'rb') as f:
      self.assertEqual(f.read(8), b'\x89PNG\r\n\x1a\n')
    self.assertGreater(os.path.getsize(out), 10_000)

  def test_a_panel_for_the_updates_lost_when_a_run_reports_them(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    events = [dict(step=s, split='train', loss=1.0, loss_scale=1.0)
              for s in (10, 20)]
    lost = [dict(e, updates_lost=0.5) for e in events]
    for runs, panels in (({'a': events}, 3), ({'a': events, 'b': lost}, 4)):
      with mock.patch.object(run_plots, 'save') as save:
        run_plots.plot_runs(runs, os.path.join(tmp, 'runs.png'))
      fig = save.call_args.args[0]
      self.assertLen(fig.axes, panels)
      self.assertEqual(fig.axes[-1].get_ylabel(),
                       run_plots.axis_label('updates_lost', 'symmetric log')
                       if panels == 4 else
                       run_plots.axis_label('loss_scale', 'log'))
    # Shares from 1e-4 to 0.5 on one panel: linear only near 0.
    self.assertEqual(fig.axes[-1].get_yscale(), 'symlog')

  def test_lines_that_are_not_json_are_skipped_and_named(self):
    """A run killed mid-write leaves its last line cut short: what is
    readable is plotted, and one warning names the lines skipped."""
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    os.makedirs(f'{tmp}/run')
    with open(f'{tmp}/run/metrics.jsonl', 'w') as f:
      for step in (10, 20):
        f.write(json.dumps(dict(step=step, split='train', loss=1.0 / step,
                                loss_scale=1.0)) + '\n')
      f.write('{"step": 30, "split": "train", "lo\n')
      f.write(json.dumps(dict(step=30, split='val', accuracy=0.3)) + '\n')
      f.write('{"step": 40, "spl')
    out = os.path.join(tmp, 'runs.png')
    result = helpers.run_module('launch.plot', f'--workdirs={tmp}/run',
                                f'--out={out}')
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertNotIn('Traceback', result.stderr)
    [line] = result.stderr.strip().splitlines()
    self.assertRegex(line, r'^W\d{4} ')
    self.assertTrue(line.endswith(
        f'{tmp}/run/metrics.jsonl: skipped lines 3, 5, not a metrics event (a '
        'run killed while writing leaves its last line cut short); read the '
        'other 3'), line)
    self.assertGreater(os.path.getsize(out), 10_000)

  def test_the_updates_lost_label_says_what_below_zero_means(self):
    """1 - sum(applied x sign(update)) / sum(|update|) is below 0 where the
    params moved further than their updates: stochastic rounding's draws
    (unbiased, so as often as not in a window whose sum is small), a Kahan
    buffer or a float32 master paying back what earlier steps held."""
    self.assertEqual(run_plots.axis_label('updates_lost'),
                     'share of the updates lost to rounding\n(below 0: moved '
                     'further than asked)')
    self.assertEqual(run_plots.axis_label('update_lost', '%'),
                     'share of the update lost (%)\n(below 0: moved further '
                     'than asked)')

  def test_missing_workdir_is_a_clear_error(self):
    result = helpers.run_module('launch.plot', '--workdirs=/nonexistent/run')
    self.assertEqual(result.returncode, 2)
    self.assertNotIn('Traceback', result.stderr)
    self.assertEqual(result.stderr.strip().splitlines(), [
        'error: --workdirs: cannot read /nonexistent/run/metrics.jsonl (No '
        'such file or directory)'])


class FiguresTest(parameterized.TestCase):
  """The figures the lab draws, inspected after they are rendered."""

  def _figures(self, plot, result_fn):
    """The rendered figures `plot(result, out_dir)` draws."""
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    figures = []
    save = mpl_figure.Figure.savefig

    def saved(fig, *args, **kwargs):  # Rendered as it is saved.
      figures.append(fig)
      return save(fig, *args, **kwargs)

    with mock.patch.object(mpl_figure.Figure, 'savefig', saved):
      plot(result_fn(tmp), tmp)
    self.assertNotEmpty(figures)
    return figures

  @parameterized.named_parameters(
      (name, plot, result_fn) for name, plot, result_fn in LAB_PLOTS)
  def test_axis_labels_are_readable(self, plot, result_fn):
    for fig in self._figures(plot, result_fn):
      for ax in fig.axes:
        labels = [ax.get_xlabel(), ax.get_ylabel()]
        self.assertTrue(any(labels))
        for label in filter(None, labels):
          self.assertNotRegex(label, r'\w_\w')  # No raw field name.
          self.assertIn(label.split(' (')[0].split('\n')[0],
                        [v.split('\n')[0]
                         for v in run_plots.FIELD_LABELS.values()])

  def test_axis_label_adds_the_unit(self):
    self.assertEqual(run_plots.axis_label('temp_size_in_bytes', 'MiB'),
                     'compiled temp memory (MiB)')
    self.assertEqual(run_plots.axis_label('step'), 'step')
    with self.assertRaises(KeyError):
      run_plots.axis_label('no_such_field')

  @parameterized.named_parameters(
      ('sweep', sweep.plot, lambda tmp: _sweep_result()),
      ('memory', memory.plot, lambda tmp: _memory_result()),
      ('runs', report._accuracy_plot, lambda tmp: _accuracy_result(tmp, [
          dict(step=s, split=split, loss=h, accuracy=h / SCATTER_POINTS,
               loss_scale=2.0**h) for s, h in _scattered()
          for split in ('train', 'val')])))
  def test_legend_covers_no_point(self, plot, result_fn):
    for fig in self._figures(plot, result_fn):
      legends = fig.legends + [ax.get_legend() for ax in fig.axes
                               if ax.get_legend()]
      self.assertNotEmpty(legends)
      boxes = [legend.get_window_extent() for legend in legends]
      for box in boxes:
        self.assertTrue(fig.bbox.containsx(box.x0) and
                        fig.bbox.containsx(box.x1))  # Not cut off.
      for ax in fig.axes:
        for line in ax.get_lines():
          for x, y in ax.transData.transform(line.get_xydata()):
            for box in boxes:
              self.assertFalse(box.contains(x, y), (line.get_label(), x, y))
        for bar in ax.patches:
          for box in boxes:
            self.assertFalse(box.overlaps(bar.get_window_extent()))

  @parameterized.named_parameters(
      ('one_eval', [dict(step=4, split='train', loss=2.0, loss_scale=2.0**15),
                    dict(step=4, split='val', accuracy=0.25)]),
      ('two_logs', [dict(step=s, split='train', loss=2.0, loss_scale=2.0**15)
                    for s in (2, 4)] + [dict(step=4, split='val',
                                             accuracy=0.25)]))
  def test_every_panel_shows_its_points(self, events):
    fig, = self._figures(report._accuracy_plot,
                         lambda tmp: _accuracy_result(tmp, events))
    for ax in fig.axes:
      visible = [line for line in ax.get_lines() if len(line.get_xdata()) and (
          line.get_marker() not in ('None', '', None) or
          len(line.get_xdata()) >= run_plots.LINE_MIN_POINTS)]
      self.assertLen(visible, len(DTYPES), ax.get_ylabel())

  def test_panel_without_points_says_so(self):
    events = [dict(step=4, split='train', loss=2.0, loss_scale=1.0)]
    fig, = self._figures(report._accuracy_plot,
                         lambda tmp: _accuracy_result(tmp, events))
    texts = {ax.get_ylabel(): [t.get_text() for t in ax.texts]
             for ax in fig.axes}
    self.assertEqual(texts, {'train loss': [],
                             'val accuracy': [run_plots.NO_POINTS_TEXT],
                             'loss scale (log)': []})

  def test_exact_zero_is_not_a_tiny_bar(self):
    errors = dict(BF16_BF16_F32=4e-3, F32_F32_F32=1e-7, F64_F64_F64=0.0)
    result = dict(device='cpu', results=[
        dict(algorithm=a, compiles=True, relative_error=e)
        for a, e in errors.items()] + [
            dict(algorithm='F16_F16_F32', compiles=False, relative_error=None)])
    fig, = self._figures(dot_algorithms.plot, lambda tmp: result)
    ax, = fig.axes
    self.assertEqual(sorted(bar.get_width() for bar in ax.patches),
                     [1e-7, 4e-3])
    zero_row = list(errors).index('F64_F64_F64')
    self.assertEqual([(t.get_text(), t.xy[1]) for t in ax.texts],
                     [(charts.EXACT_ZERO_TEXT, zero_row)])
    self.assertEqual([t.get_text() for t in ax.get_yticklabels()],
                     list(errors))


if __name__ == '__main__':
  absltest.main()
