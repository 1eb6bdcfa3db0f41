"""Plots of runs from their metrics.jsonl: train loss and val accuracy by step."""

import json
import os
from typing import Mapping

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]


def _series(events, split, key):
  points = [(e['step'], e[key]) for e in events
            if e['split'] == split and isinstance(e.get(key), (int, float))]
  return [p[0] for p in points], [p[1] for p in points]


def plot_runs(runs: Mapping[str, list[dict]], out_path: str,
              title: str = '') -> None:
  """Train loss, val accuracy and loss scale of several runs, one PNG."""
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  for name, events in runs.items():
    axes[0].plot(*_series(events, 'train', 'loss'), label=name)
    axes[1].plot(*_series(events, 'val', 'accuracy'), marker='o', label=name)
    axes[2].plot(*_series(events, 'train', 'loss_scale'), label=name)
  for ax, ylabel in zip(axes, ('train loss', 'val accuracy',
                               'loss scale (log)')):
    ax.set_xlabel('step')
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
  axes[2].set_yscale('log', base=2)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)


def bar_chart(out_path: str, labels, values, ylabel: str, title: str) -> None:
  """One bar per label, each annotated with its value."""
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.bar(labels, values)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  for i, v in enumerate(values):
    ax.annotate(f'{v:.3g}', (i, v), ha='center', va='bottom')
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)


def grouped_bar_chart(out_path: str, groups, series: Mapping[str, list],
                      ylabel: str, title: str, xlabel: str = '') -> None:
  """Bars grouped by `groups` (e.g. batch sizes), one colour per series."""
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) + 2), 4))
  width = 0.8 / max(len(series), 1)
  for i, (name, values) in enumerate(series.items()):
    xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
    bars = ax.bar(xs, values, width, label=name)
    ax.bar_label(bars, fmt='%.3g', fontsize=7)
  ax.set_xticks(range(len(groups)), [str(g) for g in groups])
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)


def stacked_bar_chart(out_path: str, labels, parts: Mapping[str, list],
                      ylabel: str, title: str) -> None:
  """One bar per label, stacked from `parts` (name -> value per label)."""
  fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 3), 4.5))
  bottom = [0.0] * len(labels)
  for name, values in parts.items():
    ax.bar(range(len(labels)), values, bottom=bottom, label=name)
    bottom = [b + v for b, v in zip(bottom, values)]
  for i, total in enumerate(bottom):
    ax.annotate(f'{total:,.0f}', (i, total), ha='center', va='bottom',
                fontsize=7)
  ax.set_xticks(range(len(labels)), labels, fontsize=7)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)


def horizontal_bar_chart(out_path: str, labels, values, xlabel: str,
                         title: str, log: bool = False) -> None:
  """One horizontal bar per label, in order from the top, for long labels."""
  fig, ax = plt.subplots(figsize=(8, 0.35 * len(labels) + 1.5))
  ax.barh(range(len(labels)), values)
  if log:
    ax.set_xscale('log')
  ax.set_yticks(range(len(labels)), labels, fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel(xlabel)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)
