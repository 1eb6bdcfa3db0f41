"""The lab's bar charts, in the house style of `run_plots.py`: a value
on every bar, the legend outside the axes, an exact zero on a log axis
written as such."""

from typing import Mapping

from haiku_mp.lab import run_plots

# What a log axis shows for an exact zero, which it cannot draw as a bar.
EXACT_ZERO_TEXT = 'exact (0)'


def bar_chart(out_path: str, labels, values, ylabel: str, title: str) -> None:
  """One bar per label, each annotated with its value."""
  fig, ax = run_plots.figure(figsize=(6, 4))
  ax.bar(labels, values)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  for i, v in enumerate(values):
    ax.annotate(f'{v:.3g}', (i, v), ha='center', va='bottom')
  run_plots.save(fig, out_path)


def grouped_bar_chart(out_path: str, groups, series: Mapping[str, list],
                      ylabel: str, title: str, xlabel: str = '') -> None:
  """Bars grouped by `groups` (e.g. batch sizes), one colour per series."""
  fig, ax = run_plots.figure(figsize=(max(7, 1.6 * len(groups) + 3), 4))
  width = 0.8 / max(len(series), 1)
  for i, (name, values) in enumerate(series.items()):
    xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
    bars = ax.bar(xs, values, width, label=name)
    ax.bar_label(bars, fmt='%.3g', fontsize=7)
  ax.set_xticks(range(len(groups)), [str(g) for g in groups])
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  run_plots.legend_outside(fig)
  run_plots.save(fig, out_path)


def stacked_bar_chart(out_path: str, labels, parts: Mapping[str, list],
                      ylabel: str, title: str,
                      total_format: str = '{:,.0f}') -> None:
  """One bar per label, stacked from `parts` (name -> value per label), its
  total above it in `total_format`."""
  fig, ax = run_plots.figure(figsize=(max(6, 0.9 * len(labels) + 5), 4.5))
  bottom = [0.0] * len(labels)
  for name, values in parts.items():
    ax.bar(range(len(labels)), values, bottom=bottom, label=name)
    bottom = [b + v for b, v in zip(bottom, values)]
  for i, total in enumerate(bottom):
    ax.annotate(total_format.format(total), (i, total), ha='center',
                va='bottom', fontsize=7)
  ax.set_ylim(0, max(bottom, default=0) * 1.08 or 1)  # Room for totals.
  ax.set_xticks(range(len(labels)), labels, fontsize=7)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  run_plots.legend_outside(fig)
  run_plots.save(fig, out_path)


def horizontal_bar_chart(out_path: str, labels, values, xlabel: str,
                         title: str, log: bool = False) -> None:
  """One horizontal bar per label, in order from the top, for long labels.

  On a log axis a value of exactly 0 gets no bar (any bar would be a made-up
  tiny value) but `EXACT_ZERO_TEXT` at the axis' left edge."""
  fig, ax = run_plots.figure(figsize=(8, 0.35 * len(labels) + 1.5))
  drawn = [(i, v) for i, v in enumerate(values) if not (log and v == 0)]
  ax.barh([i for i, _ in drawn], [v for _, v in drawn])
  if log:
    ax.set_xscale('log')
    for i, v in enumerate(values):
      if v == 0:
        ax.annotate(EXACT_ZERO_TEXT, (0, i), xycoords=('axes fraction', 'data'),
                    xytext=(3, 0), textcoords='offset points', va='center',
                    fontsize=8)
  ax.set_yticks(range(len(labels)), labels, fontsize=8)
  ax.set_ylim(len(labels) - 0.5, -0.5)
  ax.set_xlabel(xlabel)
  ax.set_title(title, fontsize=9)
  run_plots.save(fig, out_path)
