"""The advisor's files: advise.json (every number), advise.md (the flags to
paste, a row per module, the knockout ranking) and advise_histograms.png."""

import json
import math
import os
from typing import Any

import numpy as np

from haiku_mp.advisor import measurement
from haiku_mp.advisor import numerics
from haiku_mp.advisor import verdicts
from haiku_mp.lab import run_plots


def _fmt_scale(window) -> str:
  lo, hi = window['exponents']
  side = lambda k: '-' if k is None else f'2^{k}'
  return f'[{side(lo)}, {side(hi)}]'


def markdown(result: dict[str, Any]) -> str:
  """The advice as a page: what to paste, then a row per module."""
  lines = [f'# Precision advice: {result["config"]["policy"]}', '',
           f'Params from {result["params_from"]}; {result["batches"]} '
           f'batches of {result["config"]["batch_size"]}; loss scale '
           f'{result["loss_scales_seen"][0]:g}; {result["device"]}, '
           f'jax {result["jax_version"]}.', '',
           f'float16 loss-scale window: **{_fmt_scale(result["float16_window"])}**',
           '']
  for fmt, s in result['suggestions'].items():
    lines += [f'## {fmt}: keep {len(s["keep_f32"])} module(s) in float32', '',
              '```', ' \\\n  '.join(s['flags']), '```', '']
  lines += ['## Modules', '',
            '| module | class | bfloat16 | float16 | output amax | output f16 '
            'error | output f16 overflow | gradient amax | gradient below f16 '
            'normal at the loss scale | window | why float32 |',
            '|---|---|---|---|---|---|---|---|---|---|---|']
  for row in result['modules']:
    out, grad = row['output'], row['gradient']
    why = '; '.join(f'{k}: {v}' for k, v in row['reasons'].items())
    if row['same_as']:
      why = (f'same values as {row["same_as"]}' + (
          '; verdicts for its own params' if row['param_gradients'] else ''))
    lines.append(
        f'| {row["path"]} | {row["class_name"]} | {row["verdicts"]["bfloat16"]}'
        f' | {row["verdicts"]["float16"]} | {out["amax"]:.3g} | '
        f'{out["f16_relative_error"]:.2g} | {out["f16_overflow_share"]:.2g} | '
        f'{grad["amax"]:.3g} | '
        f'{grad["f16_flush_share"] + grad["f16_subnormal_share"]:.2g} | '
        f'{_fmt_scale(row["window"])} | {why} |')
  for name in measurement.MATMUL_FORMATS:
    if name in result:
      lines += matmul_markdown(result[name])
  for fmt, rows in result.get('knockout', {}).items():
    lines += ['', f'## Knockout: one module at a time in {fmt}', '',
              '| module | logits relative error | loss change | finite |',
              '|---|---|---|---|']
    lines += [f'| {r["path"]} | {r["logits_relative_error"]:.3g} | '
              f'{r["loss_change"]:+.3g} | {r["finite"]} |' for r in rows]
  c = result['cost']
  lines += ['', f'Statistics pass {c["statistics_pass_sec"]:.3f} s per batch, '
            f'{c["ratio"]:.2f}x the train step ({c["train_step_policy"]}, '
            f'{c["train_step_sec"]:.3f} s).', '']
  return '\n'.join(lines)


def matmul_flag_lines(result: dict[str, Any]) -> list[str]:
  """Per low-bit format in `result`, its heading and the flags to paste:
  `fp8 (current): --config...`."""
  return [f'{measurement.MATMUL_FORMATS[name].title} '
          f'({result[name]["choice"]}): '
          + ' '.join(result[name]['suggestion']['flags'])
          for name in measurement.MATMUL_FORMATS if name in result]


def matmul_markdown(judged: dict[str, Any]) -> list[str]:
  """One low-bit format's verdicts (`low_bit_advice.matmul_advice`): the
  flags, then a row per Linear with its verdict per choice and its format's
  numbers at the advice's choice."""
  fmt = measurement.MATMUL_FORMATS[judged['format']](**judged['options'])
  choice = judged['choice']
  kept = (f'{len(judged["keep_fp8"])} Linear layer(s) in '
          f'{judged["fallback"]}, ' if judged['fallback'] else '')
  timed = 'speed_gpu' in judged
  columns = (*fmt.choices, *fmt.columns, f'why not {fmt.title}')
  if timed:
    columns += (f'{judged["speed_format"]} on the {judged["speed_gpu"]} '
                '(predicted)',)
  slower = (f' ({len(judged["slower"])} of them safe in {fmt.title} but '
            f'predicted slower on the {judged["speed_gpu"]})' if timed else '')
  bf16 = len(judged['keep_bf16']) + len(judged.get('slower', []))
  lines = ['', f'## {fmt.title} ({choice}): keep {kept}'
           f'{bf16} Linear layer(s) in bfloat16{slower}', '',
           '```', ' \\\n  '.join(judged['suggestion']['flags']), '```', '',
           '| Linear | ' + ' | '.join(columns) + ' |',
           '|---' * (len(columns) + 1) + '|']
  for row in judged['modules']:
    cells = (row['path'], *(row['verdicts'][c] for c in fmt.choices),
             *fmt.cells(row, choice), '; '.join(row['reasons'].get(choice, [])))
    if timed:
      gain = row['speed']['gain']
      cells += ('no tensor cores' if gain is None else
                f'{gain:.2f}x {"faster" if row["speed"]["faster"] else "slower"}',)
    lines.append('| ' + ' | '.join(cells) + ' |')
  return lines


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Per-module log2 histograms of outputs and gradients as heat maps, with
  float16's range drawn over them (for gradients, as the window's top scale
  sees them)."""
  rows = [r for r in result['modules'] if not r['same_as']]
  exponents = np.asarray(result['exponents'])
  top = result['float16_window']['exponents'][1] or 0
  fig, axes = run_plots.figure(
      1, 2, figsize=(16, 2 + 0.28 * len(rows)), sharey=True)
  for ax, part, shift in ((axes[0], 'output', 0), (axes[1], 'gradient', top)):
    counts = np.asarray([r[part]['histogram'] for r in rows], np.float64)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    image = ax.imshow(np.log10(np.maximum(shares, 1e-7)), aspect='auto',
                      cmap='viridis', vmin=-7, vmax=0,
                      extent=(exponents[0] - 1, exponents[-1], len(rows), 0))
    for value, style in ((math.log2(numerics.FLOAT16.smallest_subnormal), ':'),
                         (math.log2(numerics.FLOAT16.smallest_normal), '--'),
                         (math.log2(numerics.FLOAT16.max), '-')):
      ax.axvline(value - shift, color='red', linestyle=style)
    seen = f'\nfloat16 at a loss scale of 2^{shift}' if shift else ''
    ax.set_title(f'{part}s{seen}')
    ax.set_xlabel(f'log2 |{part}| (red: float16 subnormal min, normal min, '
                  'max)')
    populated = exponents[counts.sum(axis=0) > 0]
    if populated.size:
      ax.set_xlim(min(populated[0] - 2, -26 - shift),
                  max(populated[-1] + 1, 17 - shift))
  labels = [f'{r["path"]} [{r["verdicts"]["float16"]}]' for r in rows]
  axes[0].set_yticks(np.arange(len(rows)) + 0.5)
  axes[0].set_yticklabels(labels, fontsize=7)
  for tick, r in zip(axes[0].get_yticklabels(), rows):
    if verdicts.KEEP in r['verdicts'].values():
      tick.set_color('red')
  fig.colorbar(image, ax=axes, label='log10 share of non-zero values')
  path = os.path.join(out_dir, 'advise_histograms.png')
  fig.savefig(path, dpi=90, bbox_inches='tight')
  return [path]


def write(result: dict[str, Any], out_dir: str) -> list[str]:
  """advise.json, advise.md and the plot in `out_dir`."""
  os.makedirs(out_dir, exist_ok=True)
  result['plots'] = [os.path.basename(p) for p in plot(result, out_dir)]
  paths = [os.path.join(out_dir, 'advise.json'),
           os.path.join(out_dir, 'advise.md')]
  with open(paths[0], 'w') as f:
    json.dump(result, f, indent=1)
  with open(paths[1], 'w') as f:
    f.write(markdown(result))
  return paths + [os.path.join(out_dir, p) for p in result['plots']]
