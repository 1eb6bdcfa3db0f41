"""Study `ladder`: the precision ladder, from finished runs. Each run's test
accuracy against what its precision keeps per parameter, in two ways:

- the matmul: the bytes per weight a GEMM reads in the run's format (a
  low-bit format's block scales included: MXFP8 one E8M0 byte per 32, NVFP4
  one E4M3 byte per 16, MXFP4 one E8M0 byte per 32; a per-tensor scale is
  nothing per weight);
- the training state: bytes per parameter of the params and what the
  optimizer keeps for them (master copy, Adam's moments, a Kahan buffer),
  read from the run's own state as `state_layout` reads it; the moving
  average (float32 in every layout, and a run may keep none), fp8 and 4-bit
  metadata and the step's counters left out.

Runs of the same variant (`variants.variant_name`: dtype, fp8 scaling, 4-bit
format or state layout) are its seeds: their mean is the point, each run a
dot beside it. A 4-bit run with a part of NVIDIA's recipe switched off, or
with Linears kept in fp8, is a variant of its own ('nvfp4 (no Hadamard)',
'nvfp4 (7 of 24 Linears in fp8)'), never a seed of the recipe's defaults.
Its bytes per weight are the mean over its low-bit Linears, weighted by
their kernels: a Linear kept in fp8 reads fp8's byte.
"""

import collections
import itertools
import json
import math
import os
from typing import Any, Callable

from matplotlib import colormaps
import numpy as np

from haiku_mp import errors
from haiku_mp.lab import run_inputs
from haiku_mp.lab import run_plots
from haiku_mp.lab import variants
from haiku_mp.update import state_layout
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import overview
from haiku_mp.vit.train import run_dir

# The parts of `state_layout.PARTS` the ladder counts as the state.
_STATE_PARTS = ('params', 'master', 'mu', 'nu', 'compensation')
# Bytes per weight a GEMM reads, per variant: the format's bits and its
# block scales (a per-tensor scale costs nothing per weight).
MATMUL_BYTES = {
    'float32': 4.0, 'bfloat16': 2.0, 'float16': 2.0,
    variants.PURE_BF16: 2.0, variants.PURE_BF16_8BIT: 2.0,
    'fp8_current': 1.0, 'fp8_delayed': 1.0, 'fp8_mx': 1.0 + 1 / 32,
    'nvfp4': 0.5 + 1 / 16, 'mxfp4': 0.5 + 1 / 32,
}


def run_row(settings: settings_lib.Settings, workdir: str,
            log: Callable[[str], None] = print) -> dict[str, Any]:
  """One finished run: its variant, seed, test accuracies and bytes."""
  path = os.path.join(workdir, run_dir.SUMMARY_FILE)
  try:
    with open(path) as f:
      summary = json.load(f)
  except (OSError, ValueError) as e:
    raise errors.ConfigError(f'--workdirs: {path} cannot be read ({e}); '
                             'the ladder takes finished runs') from None
  # The run's precision is its own, never --config's: config.json is needed.
  path = os.path.join(workdir, run_dir.CONFIG_FILE)
  if not os.path.exists(path):
    raise errors.ConfigError(f'--workdirs: no {path}; the ladder reads each '
                             'run\'s precision from it')
  settings = run_inputs.merged_config(settings, path, '--workdirs', log=log,
                                    command='ladder')
  base = variants.variant_name(settings)
  if base not in MATMUL_BYTES:
    raise errors.ConfigError(f'--workdirs: {workdir} is a {base} run; the '
                             f'ladder knows {tuple(MATMUL_BYTES)}')
  exp = experiment.build_without_data(settings)
  low_bit = [r for r in overview.module_rows(exp) if r['matmul'] != '-']
  fp8_kept = ([r['path'] for r in low_bit if r['matmul'] != base]
              if base in variants.FP4_VARIANTS else [])
  state = exp.abstract_state
  per = state_layout.per_parameter(state_layout.bytes_by_part(state),
                                   state_layout.param_count(state))
  return dict(workdir=os.path.basename(os.path.normpath(workdir)),
              variant=base + _departures(settings.precision.low_bit, base,
                                         len(fp8_kept), len(low_bit)),
              fp8_kept=fp8_kept, seed=settings.seed,
              test_accuracy=summary['test_accuracy'],
              ema_test_accuracy=summary.get('ema_test_accuracy'),
              matmul_bytes=_matmul_bytes(base, low_bit),
              state_bytes=sum(per[p] for p in _STATE_PARTS))


def _matmul_bytes(base: str, low_bit: list[dict[str, Any]]) -> float:
  """Bytes per weight of the run's low-bit GEMMs, weighted by their
  kernels ('w'): a 4-bit run's Linears kept in fp8 read fp8's byte."""
  if not low_bit:
    return MATMUL_BYTES[base]
  kernels = [math.prod(r['params']['w']['shape']) for r in low_bit]
  reads = [MATMUL_BYTES[r['matmul'].replace(' ', '_')] for r in low_bit]
  return float(np.dot(kernels, reads) / sum(kernels))


# The 4-bit recipe's parts a run may switch off, as the ladder names them.
_FP4_PARTS = (('two_d_weights', '1-D weight blocks'),
              ('hadamard', 'no Hadamard'),
              ('stochastic_gradients', 'nearest gradients'))


def _departures(recipe: settings_lib.LowBitSettings, base: str, kept: int,
                low_bit: int) -> str:
  """' (no Hadamard, ...)': where a 4-bit run leaves NVIDIA's recipe; a
  run keeping `kept` of its `low_bit` Linears in fp8 is one of them."""
  if base not in variants.FP4_VARIANTS:
    return ''
  parts = [label for field, label in _FP4_PARTS if not getattr(recipe, field)]
  if kept:
    parts.append(f'{kept} of {low_bit} Linears in fp8')
  return f' ({", ".join(parts)})' if parts else ''


def run(settings: settings_lib.Settings, workdirs: list[str],
        log: Callable[[str], None] = print) -> dict[str, Any]:
  """Every run's row and, per variant, the seeds' mean."""
  rows = [run_row(settings, w, log) for w in workdirs]
  by_variant = collections.defaultdict(list)
  for r in rows:
    by_variant[r['variant'], tuple(r['fp8_kept'])].append(r)
  # Runs keeping as many Linears in fp8, but other ones, are told apart by
  # a letter (the paths would fill the plot); the log names their Linears.
  shared = collections.Counter(name for name, _ in by_variant)
  lettered = collections.Counter()
  for (name, _), runs in by_variant.items():
    if shared[name] > 1:
      letter = chr(ord('A') + lettered[name])
      lettered[name] += 1
      for r in runs:
        r['variant'] = f'{name} [{letter}]'
  means = []
  for runs in by_variant.values():
    name = runs[0]['variant']
    accuracy = [r['test_accuracy'] for r in runs]
    means.append(dict(variant=name, seeds=len(runs),
                      test_accuracy=float(np.mean(accuracy)),
                      matmul_bytes=runs[0]['matmul_bytes'],
                      state_bytes=runs[0]['state_bytes'],
                      fp8_kept=runs[0]['fp8_kept']))
    kept = (f'; fp8 in {";".join(runs[0]["fp8_kept"])}'
            if runs[0]['fp8_kept'] else '')
    log(f'ladder {name}: {100 * means[-1]["test_accuracy"]:.2f}% test over '
        f'{len(runs)} run(s), matmul {runs[0]["matmul_bytes"]:.3g} bytes per '
        f'weight, state {runs[0]["state_bytes"]:.2f} bytes per parameter'
        + kept)
  means.sort(key=lambda m: (-m['matmul_bytes'], -m['state_bytes']))
  return dict(experiment='ladder', runs=rows, variants=means)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Two panels: test accuracy against the matmul's bytes per weight and
  against the state's bytes per parameter; a point per variant (its seeds'
  mean), a dot per run."""
  path = os.path.join(out_dir, 'precision_ladder.png')
  fig, axes = run_plots.figure(1, 2, figsize=(13, 4.8), sharey=True)
  shown = [100 * r['test_accuracy'] for r in result['runs']]
  gap = _LABEL_GAP * max(max(shown) - min(shown), 1.0)
  for ax, key, label in (
      (axes[0], 'matmul_bytes', 'the matmul: bytes per weight'),
      (axes[1], 'state_bytes', 'the training state: bytes per parameter')):
    xs = [m[key] for m in result['variants']]
    # Where each label ends, as a ratio along the log axis: its characters'
    # share of the panel's width, of the x span (and the axis' margins).
    octaves = _X_MARGINS * math.log2(max(xs) / min(xs)) / _PANEL_CHARS
    ends = [x * _LABEL_SHIFT * 2 ** (len(m['variant']) * octaves)
            for x, m in zip(xs, result['variants'])]
    heights = label_heights(xs, [100 * m['test_accuracy']
                                 for m in result['variants']], gap, ends)
    for m, height, color in zip(result['variants'], heights,
                                itertools.cycle(_COLORS)):
      runs = [r for r in result['runs'] if r['variant'] == m['variant']]
      line = ax.plot([m[key]], [100 * m['test_accuracy']], 'o', color=color,
                     label=m['variant'])[0]
      ax.plot([r[key] for r in runs], [100 * r['test_accuracy'] for r in runs],
              '.', color=line.get_color(), alpha=0.5)
      moved = abs(height - 100 * m['test_accuracy']) > gap / 4
      ax.annotate(m['variant'], (m[key], 100 * m['test_accuracy']),
                  xytext=(m[key] * _LABEL_SHIFT, height), fontsize=8,
                  va='center', color=line.get_color() if moved else 'black',
                  arrowprops=dict(arrowstyle='-', color=line.get_color(),
                                  alpha=0.5) if moved else None)
    ax.set_xscale('log', base=2)
    ticks = _spaced(sorted({m[key] for m in result['variants']}))
    ax.set_xticks(ticks, [f'{t:.3g}' for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(label + ' (log scale)')
    ax.grid(True, alpha=0.3)
  axes[0].set_ylabel('test accuracy (%)')
  fig.suptitle('The precision ladder: accuracy against what each format '
               'keeps (a point per variant, its seeds\' mean; dots: runs)')
  run_plots.save(fig, path)
  return [path]


# Ticks closer than this ratio share one label (NVFP4's 0.5625 bytes per
# weight and MXFP4's 0.53125 printed over each other); the points keep theirs.
_TICK_RATIO = 1.25


def _clusters(xs: list[float], ends: list[float]) -> list[list[int]]:
  """The indices of `xs` in increasing x, grouped: a point joins the group
  before it while its x is short of where a label in that group ends."""
  groups, end = [], 0.0
  for i in sorted(range(len(xs)), key=lambda i: xs[i]):
    if groups and xs[i] < end:
      groups[-1].append(i)
      end = max(end, ends[i])
    else:
      groups.append([i])
      end = ends[i]
  return groups


def _spaced(ticks: list[float]) -> list[float]:
  """The smallest of each cluster of `ticks` (a tick's label reaching
  `_TICK_RATIO` along): one label per cluster."""
  return [ticks[group[0]]
          for group in _clusters(ticks, [t * _TICK_RATIO for t in ticks])]


# Twenty colours, the ten strong ones first: the ladder has more variants
# than matplotlib's cycle of ten (float32 and NVFP4 shared its blue).
_COLORS = colormaps['tab20'].colors[0::2] + colormaps['tab20'].colors[1::2]

# A label's height, as a share of the accuracies' span: about one line of
# 8-point text on the figure's 4.8-inch panels. Labels sit this ratio to the
# right of their point (the x axes are log scale).
_LABEL_GAP = 0.045
_LABEL_SHIFT = 1.06
# About how many 8-point characters fit across one of the figure's 13-inch
# pair of panels, and the share matplotlib adds to an axis' data span.
_PANEL_CHARS = 75
_X_MARGINS = 1.1


def label_heights(xs: list[float], ys: list[float], gap: float,
                  ends: list[float] | None = None) -> list[float]:
  """Heights for labels of points (xs, ys), at least `gap` apart among
  points whose labels may meet (a label ends at its `ends` x, by default
  `_TICK_RATIO` along), moved as little as can be (least squares).
  Written here because matplotlib places a label where it is told: the
  ladder's close points (float16 beside `pure_bf16_8bit`, NVFP4 beside
  MXFP4) printed over each other."""
  heights = list(ys)
  if ends is None:
    ends = [x * _TICK_RATIO for x in xs]
  for group in _clusters(xs, ends):
    group.sort(key=lambda i: ys[i])
    # Order kept and gaps met: label k sits at z_k + k * gap for the
    # non-decreasing z nearest to y_k - k * gap (pool adjacent violators).
    blocks = []  # [sum, count] of pooled z's.
    for k, i in enumerate(group):
      blocks.append([ys[i] - k * gap, 1])
      while (len(blocks) > 1 and blocks[-2][0] / blocks[-2][1]
             > blocks[-1][0] / blocks[-1][1]):
        total, count = blocks.pop()
        blocks[-1][0] += total
        blocks[-1][1] += count
    k = 0
    for total, count in blocks:
      for _ in range(count):
        heights[group[k]] = total / count + k * gap
        k += 1
  return heights
