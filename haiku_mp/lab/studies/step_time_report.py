"""What `launch.lab speed` prints and draws: the step's matmuls (merged over
blocks) per format, the rest, the step and where low bits pay; or one
Linear's three GEMMs (`--shape`).
"""

import collections
from typing import Any, Optional

from haiku_mp.lab import charts
from haiku_mp.vit.model import forward as forward_lib


def table(result: dict[str, Any]) -> str:
  """The matmuls (merged over blocks), the rest, the step per format."""
  formats = result['formats']
  lines = []
  if 'linear' in result:
    m, k, n = result['shape']
    lines.append(f'One Linear, {m} tokens x {k} in -> {n} out, on paper for '
                 f'the {result["gpu"]}:')
    lines.append('| GEMM | ' + ' | '.join(formats) + ' |')
    lines.append('|---|' + '---|' * len(formats))
    for p, per in result['linear']['passes'].items():
      lines.append(f'| {p} | ' + ' | '.join(_us(per[f]) for f in formats) +
                   ' |')
    lines.append('| all three | ' + ' | '.join(
        _us(result['linear']['seconds'][f]) for f in formats) + ' |')
    lines.append('| speedup | ' + ' | '.join(
        f'{result["linear"]["speedup"][f]:.2f}x' for f in formats) + ' |')
    return '\n'.join(lines)
  merged = collections.OrderedDict()
  for row in result['matmuls']:
    key = (forward_lib.merge_block_indices(row['name']), row['pass'],
           (row['batch'], row['m'], row['k'], row['n']))
    entry = merged.setdefault(key, dict(count=0, seconds=collections.Counter(),
                                        low_bit=row['low_bit']))
    entry['count'] += 1
    for f in formats:
      entry['seconds'][f] += row['seconds'][f] or 0.0
  lines.append(f'The train step at batch {result["batch_size"]} on paper for '
               f'the {result["gpu"]} (a prediction; docs/speed.md):')
  lines.append('| matmul | pass | batch x M x K x N | count | ' +
               ' | '.join(formats) + ' |')
  lines.append('|---|---|---|---|' + '---|' * len(formats))
  for (name, pass_, (b, m, k, n)), entry in merged.items():
    shape = f'{m}x{k}x{n}' if b == 1 else f'{b}x{m}x{k}x{n}'
    mark = '' if entry['low_bit'] else ' (stays)'
    lines.append(f'| {name}{mark} | {pass_} | {shape} | {entry["count"]} | ' +
                 ' | '.join(_us(entry['seconds'][f]) for f in formats) + ' |')
  rest = result['rest']
  lines.append(f'| the rest: {rest["bytes"] / 1e9:,.2f} GB, {rest["kernels"]:,} '
               'kernels | | | | ' + ' | '.join(
                   _us(rest['seconds']) for _ in formats) + ' |')
  s = result['step']
  lines.append('| **step** | | | | ' + ' | '.join(
      f'**{_us(s["seconds"][f])}**' for f in formats) + ' |')
  lines.append('| speedup | | | | ' + ' | '.join(
      f'{s["speedup"][f]:.2f}x' for f in formats) + ' |')
  lines.append('| images/s | | | | ' + ' | '.join(
      f'{s["images_per_second"][f]:,.0f}' for f in formats) + ' |')
  for fmt, placed in result['where_it_pays'].items():
    lines.append(f'{fmt} where it pays: {len(placed["linears"])} of '
                 f'{len(result["linears"])} Linears, step '
                 f'{_us(placed["seconds"])} ({placed["speedup"]:.2f}x)')
  return '\n'.join(lines)


def _us(seconds: Optional[float]) -> str:
  if seconds is None:
    return '-'
  if seconds >= 1e-3:
    return f'{seconds * 1e3:,.2f} ms'
  return f'{seconds * 1e6:,.1f} us'


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Where the step's time goes per format: the matmuls that stay, the
  low-bit Linears (their casts included), the rest's bytes, its kernels."""
  path = f'{out_dir}/speed.png'
  formats = result['formats']
  if 'linear' in result:
    passes = result['linear']['passes']
    charts.stacked_bar_chart(
        path, formats, {p: [passes[p][f] * 1e6 for f in formats]
                        for p in passes},
        'microseconds (predicted)',
        f'One Linear {"x".join(map(str, result["shape"]))} on the '
        f'{result["gpu"]}, on paper', total_format='{:,.1f}')
    return [path]
  parts = result['step']['parts']
  rest = result['rest']
  kernels = rest['kernels'] * result['assumptions']['kernel_seconds']
  charts.stacked_bar_chart(
      path, formats,
      {'matmuls in the baseline': [parts[f]['matmuls'] * 1e3 for f in formats],
       'low-bit Linears (casts included)': [
           parts[f]['low_bit_linears'] * 1e3 for f in formats],
       'the rest: bytes': [(rest['seconds'] - kernels) * 1e3] * len(formats),
       'the rest: kernel costs': [kernels * 1e3] * len(formats)},
      'ms per step (predicted)',
      f'The train step on the {result["gpu"]}, batch {result["batch_size"]}, '
      'on paper', total_format='{:,.2f}')
  return [path]
