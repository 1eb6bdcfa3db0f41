"""Plots of runs from their metrics.jsonl, and the house style of every plot.

Every axis label comes from `FIELD_LABELS` (the fields of metrics.jsonl and
of the lab's results), legends sit outside the axes (so they never cover a
bar or a point), and a series of one point is drawn as a marker. The lab's
bar charts (`lab/charts.py`) draw with the same `figure`,
`legend_outside` and `save`."""

import json
import os
from typing import Mapping

from absl import logging
# Figures without pyplot: no backend is chosen, and a program's own stays.
from matplotlib import figure as mpl_figure

# Readable axis labels of the fields the plots draw (a result's or a
# metrics.jsonl event's key); `axis_label` adds the unit.
FIELD_LABELS = {
    'step': 'step',
    'loss': 'train loss',
    'accuracy': 'val accuracy',
    'loss_scale': 'loss scale',
    'batch_size': 'global batch size',
    'megabytes': 'parameter memory',
    'state': 'training state',
    # 1 - sum(applied x sign(update)) / sum(|update|): below 0 where rounding
    # moved the params further along their updates than they asked (a
    # stochastic rounding's draws, a Kahan buffer or a float32 master paying
    # back what earlier steps held), so a second line says what that means.
    'update_lost': 'share of the update lost\n(below 0: moved further than '
                   'asked)',
    'updates_lost': 'share of the updates lost to rounding\n(below 0: moved '
                    'further than asked)',
    'params': 'params',
    'breakdown': 'train step memory',
    'device_peak_bytes': 'device peak memory',
    'compiled_total_bytes': 'compiled memory, total',
    'temp_size_in_bytes': 'compiled temp memory',
    'kept_activation_bytes': 'activations kept for backward',
    'median_step_sec': 'median step time',
    'epoch_sec': 'epoch time',
    'images_per_sec': 'throughput',
    'gflops_per_sec': 'matmul throughput',
    'matmul_precision': 'matmul precision',
    'grads_relative_error': 'gradient relative error vs float64',
    'relative_error': 'relative error vs float64',
    'ms_per_step_by_module': 'op self time per step',
}
# A line needs two points; a shorter series is drawn as markers alone.
LINE_MIN_POINTS = 2
# The share of the updates lost runs from about 1e-4 either side of 0
# (stochastic rounding's draws) to about 0.5 in a schedule's last steps (a
# learning rate near 0 asks for updates float32 params cannot take): on a
# symmetric log scale, linear within this of 0, both stay readable.
LOST_LINEAR_WITHIN = 1e-3
NO_POINTS_TEXT = 'no points to draw'
_DPI = 100


def axis_label(field: str, unit: str = '') -> str:
  """`FIELD_LABELS[field]`, with the unit in parentheses at the end of its
  first line (a KeyError for a field without a readable label, so none
  reaches a plot raw)."""
  first, newline, rest = FIELD_LABELS[field].partition('\n')
  return f'{first} ({unit}){newline}{rest}' if unit else FIELD_LABELS[field]


# Skipped lines a warning names one by one; more are counted.
_LINES_NAMED = 5


def read_metrics(workdir: str) -> list[dict]:
  """The events of `workdir`/metrics.jsonl. A line that is no event (not
  JSON: a run killed mid-write leaves its last line cut short) is skipped,
  and one warning names the lines skipped."""
  path = os.path.join(workdir, 'metrics.jsonl')
  events, skipped = [], []
  with open(path, errors='replace') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        event = json.loads(line)
      except ValueError:
        event = None
      if isinstance(event, dict) and 'step' in event and 'split' in event:
        events.append(event)
      else:
        skipped.append(number)
  if skipped:
    named = ', '.join(map(str, skipped[:_LINES_NAMED]))
    if len(skipped) > _LINES_NAMED:
      named += f' and {len(skipped) - _LINES_NAMED} more'
    logging.warning(
        '%s: skipped line%s %s, not a metrics event (a run killed while '
        'writing leaves its last line cut short); read the other %d',
        path, 's' if len(skipped) > 1 else '', named, len(events))
  return events


def _series(events, split, key):
  points = [(e['step'], e[key]) for e in events
            if e['split'] == split and isinstance(e.get(key), (int, float))]
  return [p[0] for p in points], [p[1] for p in points]


def figure(*args, **kwargs):
  """(figure, axes) as `pyplot.subplots(*args, **kwargs)` makes them, with a
  constrained layout that makes room for a legend outside; the figure is
  pyplot's never (which would choose a backend for the whole process)."""
  figure_args = {k: kwargs.pop(k) for k in ('figsize', 'dpi') if k in kwargs}
  fig = mpl_figure.Figure(layout='constrained', **figure_args)
  return fig, fig.subplots(*args, **kwargs)


def legend_outside(fig) -> None:
  """One legend for all axes, right of them: `loc='best'` still covers a
  point when the data fill every corner."""
  by_label = {}
  for ax in fig.axes:
    for handle, label in zip(*ax.get_legend_handles_labels()):
      by_label.setdefault(label, handle)
  if by_label:
    fig.legend(by_label.values(), by_label.keys(), loc='outside right upper')


def save(fig, out_path: str) -> None:
  fig.savefig(out_path, dpi=_DPI)


def plot_runs(runs: Mapping[str, list[dict]], out_path: str,
              title: str = '') -> None:
  """Train loss, val accuracy and loss scale of several runs, one PNG, and
  the share of the updates rounding lost when a run reports it."""
  panels = [('train', 'loss', ''), ('val', 'accuracy', ''),
            ('train', 'loss_scale', 'log')]
  if any('updates_lost' in e for events in runs.values() for e in events):
    panels.append(('train', 'updates_lost', 'symmetric log'))
  fig, axes = figure(1, len(panels), figsize=(5 * len(panels), 4.2))
  for ax, (split, key, unit) in zip(axes, panels):
    drawn = False
    for name, events in runs.items():
      steps, values = _series(events, split, key)
      # Val accuracy is sparse (an eval per epoch): always show its points.
      few = len(steps) < LINE_MIN_POINTS or split == 'val'
      # Plotted even when empty, so a run keeps its colour in every panel.
      ax.plot(steps, values, marker='o' if few else None, label=name)
      drawn = drawn or bool(steps)
    if not drawn:
      ax.text(0.5, 0.5, NO_POINTS_TEXT, transform=ax.transAxes,
              ha='center', va='center')
    ax.set_xlabel(axis_label('step'))
    ax.set_ylabel(axis_label(key, unit))
    ax.grid(alpha=0.3)
  axes[2].set_yscale('log', base=2)
  if len(panels) > 3:
    axes[3].set_yscale('symlog', linthresh=LOST_LINEAR_WITHIN)
  legend_outside(fig)
  if title:
    fig.suptitle(title)
  save(fig, out_path)
