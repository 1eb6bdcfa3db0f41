"""`report.md`: the lab report's parts, each as a table, from their JSON.

Kept apart from running the parts (report.py): the markdown is rewritten from
whatever parts' JSON an output directory holds, so parts run one command at a
time still make one report.
"""

import json
import os
from typing import Any, Sequence


def mib(value) -> str:
  """Bytes as a table's MiB cell ('-' when not measured)."""
  return '-' if value is None else f'{value / 2**20:,.1f}'


def mfu(row) -> str:
  """A row's model FLOPs utilization as a cell ('n/a' without a ceiling)."""
  return 'n/a' if row['mfu'] is None else f'{row["mfu"]:.3f}'


def _ratio(row, field) -> str:
  value = (row.get('vs_float32') or {}).get(field)
  return '-' if value is None else f'{value:.2f}x'


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  return (['| ' + ' | '.join(header) + ' |',
           '|' + '---|' * len(header)] +
          ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows])


def _benchmark_md(r) -> list[str]:
  rows = []
  for x in r['results']:
    if not x['fits']:
      rows.append([x['batch_size'], x['dtype'], 'does not fit', '', '', '',
                   '', ''])
      continue
    rows.append([x['batch_size'], x['dtype'], x['dot_form'],
                 f'{x["step_time_s"] * 1e3:.1f}', f'{x["images_per_sec"]:.0f}',
                 _ratio(x, 'images_per_sec'), mfu(x),
                 f'{x["matmul_ceiling_flops"] / 1e9:,.0f} '
                 f'({x["matmul_ceiling_size"]}^3)'])
  notes = [f'- {x["dtype"]} batch {x["batch_size"]}: MFU n/a, {x["mfu_note"]}.'
           for x in r['results'] if x['fits'] and x.get('mfu_note')]
  return _table(('batch', 'dtype', 'dot form', 'ms/step', 'img/s',
                 'img/s vs f32', 'MFU', 'ceiling GFLOP/s (matmul)'), rows) + (
                     ['', *notes] if notes else [])


def where_measured(r) -> str:
  """Where the memory part measured: a fresh process per variant gives each
  its own peak; in one process (--quick) the peaks are not each one's own."""
  return ('one variant per process' if r.get('isolated', not r['quick']) else
          'every variant in one process')


def _memory_md(r) -> list[str]:
  rows = [[x['batch_size'], x['dtype'],
           mib(x.get('device_peak_bytes')) if x['fits'] else 'does not fit',
           mib(x.get('compiled_total_bytes')),
           mib(x['kept_activation_bytes']),
           mib((x.get('params_bytes') or 0) + (x.get('opt_state_bytes') or 0)),
           _ratio(x, 'device_peak_bytes'), _ratio(x, 'kept_activation_bytes')]
          for x in r['results']]
  return [f'Measured with {where_measured(r)}.', '', *_table(
      ('batch', 'dtype', 'device peak MiB', 'compiled MiB',
       'activations kept MiB', 'params + opt state MiB', 'peak vs f32',
       'kept vs f32'), rows), '', *_fixed_share(r)]


def _fixed_share(r) -> list[str]:
  """Why half precision moves the peak little at a small batch: the share of
  float32's compiled bytes that no activation dtype changes."""
  lines = []
  for x in r['results']:
    total = x.get('compiled_total_bytes')
    if x['dtype'] != 'float32' or not total:
      continue
    fixed = 2 * x['params_bytes'] + x['opt_state_bytes']  # + the gradients.
    lines.append(
        f'- batch {x["batch_size"]}: params, their float32 gradients and the '
        f'optimizer state are {100 * fixed / total:.0f}% of float32\'s '
        f'compiled bytes; the activations kept for backward '
        f'{100 * x["kept_activation_bytes"] / total:.0f}%.')
  return lines


def _precision_md(r) -> list[str]:
  rows = [[x['dtype'], x['matmul_precision'],
           x.get('same_program_as') or '',
           f'{x["grads_relative_error"]:.2e}', f'{x["logits_relative_error"]:.2e}',
           f'{x["median_step_sec"] * 1e3:.1f}'] for x in r['matmul']]
  return _table(('dtype', 'matmul precision', 'same program as',
                 'grad rel. error vs f64', 'logit rel. error', 'ms/step'),
                rows)


def _matmul_md(r) -> list[str]:
  return _table(('dtype', 'computed as', 'ms', 'GFLOP/s', 'time vs first'),
                [[x['dtype'], x['computed_dtype'], f'{x["median_sec"] * 1e3:.2f}',
                  f'{x["gflops_per_sec"]:.0f}', f'{x["time_vs_first"]:.2f}']
                 for x in r['results']])


def _dot_md(r) -> list[str]:
  rows = []
  for x in r['results']:
    operands = x['operand_dtype'] + (' (x64 on, a process of its own)'
                                     if x.get('x64') else '')
    if x['compiles']:
      rows.append([x['algorithm'], operands, 'yes',
                   x['result_dtype'], f'{x["relative_error"]:.1e}',
                   f'{x["median_sec"] * 1e3:.2f}'])
    else:
      rows.append([x['algorithm'], operands, 'no: ' + x['error'][:120],
                   '', '', ''])
  return _table(('algorithm', 'operands', 'runs', 'result', 'rel. error',
                 'ms'), rows)


def _accuracy_md(r) -> list[str]:
  rows = [[x['dtype'], x['seed'], x['steps'], f'{100 * x["test_accuracy"]:.2f}',
           f'{x["test_loss"]:.4f}', x['skipped_steps'],
           f'{x["final_loss_scale"]:g}', f'{x["images_per_sec"]:.0f}']
          for x in r['runs']]
  lines = _table(('dtype', 'seed', 'steps', 'test acc %', 'test loss',
                  'skipped', 'final scale', 'img/s'), rows)
  gaps = ', '.join(f'{d} {g:+.2f} points ({"within" if r["target_met"][d] else "outside"} '
                   f'{r["target_points"]})'
                   for d, g in r['gap_points_vs_float32'].items())
  return lines + ['', f'Mean test accuracy vs float32: {gaps}.']


# Each part's section of report.md, in the report's order: title, table.
SECTIONS = dict(benchmark=('Step benchmark', _benchmark_md),
                 memory=('Memory per variant', _memory_md),
                 precision=('Matmul precision', _precision_md),
                 matmul=('The seeds\' jnp.dot(A, A.T)', _matmul_md),
                 dot_algorithms=('Dot algorithms', _dot_md),
                 accuracy=('Accuracy parity', _accuracy_md))


def write(out_dir: str) -> str:
  """`report.md` from every part's JSON in `out_dir`."""
  lines = ['# haiku_mp lab report', '']
  for part, (title, table) in SECTIONS.items():
    path = os.path.join(out_dir, f'{part}.json')
    if not os.path.exists(path):
      continue
    with open(path) as f:
      result = json.load(f)
    lines += [f'## {title}', '',
              f'{result["device"]} ({result["backend"]}, {result["devices"]} '
              f'devices), jax {result["jax_version"]}, CPU '
              f'{result["cpu"]["model"]}, {result["date"]}'
              f'{", --quick" if result["quick"] else ""}; '
              f'{result["seconds"]:.0f} s.',
              f'Command: `{result["command"]}`' if result['command'] else '',
              '', *table(result), '',
              *(f'![{p}]({p})' for p in result['plots']), '']
  path = os.path.join(out_dir, 'report.md')
  with open(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  return path
