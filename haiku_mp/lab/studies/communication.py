"""Bytes on the wire per train step: every collective of the compiled step
for a mesh and a precision of communication, its per-device memory, and the
time those bytes take on paper for given links (studies/wire_time.py).

Each variant is the config with a layout (`pjit:8x1`, `fsdp:8x1`, ...) and a
wire, `GATHER/REDUCE` (`parallel.gather_dtype` / `parallel.reduce_dtype`);
'fp8' gathers run the config with fp8 encoder blocks. A data-parallel layout
gathers nothing, so it takes each reduce dtype once.
"""

from typing import Any, Sequence

import jax

from haiku_mp import errors
from haiku_mp.lab import charts
from haiku_mp.lab import variants
from haiku_mp.lab.studies import partitioned_step
from haiku_mp.lab.studies import wire_time
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.parallel import wire_dtypes
from haiku_mp.vit.train import experiment

LAYOUTS = ('pjit:8x1', 'fsdp:8x1')
WIRES = ('float32/float32', 'compute/float32', 'compute/compute',
         'fp8/compute')


def parse_wire(text: str) -> tuple[str, str]:
  """'compute/float32' -> ('compute', 'float32'), each checked."""
  gather, sep, reduce = text.partition('/')
  if not sep:
    raise errors.ConfigError(
        f"--wires: {text!r} is not GATHER/REDUCE, e.g. 'compute/float32'")
  errors.check_choice('--wires (gather)', gather,
                      wire_dtypes.GATHER_DTYPES)
  errors.check_choice('--wires (reduce)', reduce,
                      wire_dtypes.REDUCE_DTYPES)
  return gather, reduce


def variant(settings: settings_lib.Settings, layout: str, wire: str
            ) -> settings_lib.Settings:
  """`settings` on `layout` with `wire`'s dtypes, on synthetic data."""
  gather, reduce = parse_wire(wire)
  if gather == 'fp8' and not settings.precision.low_bit.modules:
    settings = variants.in_compute_dtype(settings, 'fp8_current')
  return settings_lib.replace(
      variants.with_layout(settings, layout),
      parallel=dict(gather_dtype=gather, reduce_dtype=reduce),
      data=dict(source='synthetic'))


def _measured(settings: settings_lib.Settings, layout: str,
              wire: str) -> dict[str, Any]:
  exp = experiment.build(variant(settings, layout, wire))
  state, batch = exp.abstract_inputs()
  result = partitioned_step.step_collectives(
      exp.strategy.train_step, state, batch,
      compiler_options=exp.strategy.compiler_options)
  shardings = exp.strategy.state_shardings
  if shardings is None:
    held = whole = sum(sharding.nbytes(x)
                       for x in jax.tree.leaves(exp.abstract_state))
  else:
    held, whole = sharding.bytes_per_device(exp.abstract_state, shardings)
  rows = result['collectives']
  return dict(
      layout=layout, wire=wire, strategy=exp.settings.parallel.strategy,
      policy=exp.settings.precision.policy,
      fp8=bool(exp.settings.precision.low_bit.modules),
      batch_size=exp.settings.batch_size, source=result['source'],
      collectives=rows, compiled_collectives=result['compiled_collectives'],
      bytes=sum(r['bytes'] for r in rows),
      wire_bytes=sum(r['wire_bytes'] for r in rows),
      state_bytes_per_device=held, state_bytes=whole,
      memory=result['memory'], flops=result['flops'])


def run(settings: settings_lib.Settings,
        layouts: Sequence[str] = LAYOUTS, wires: Sequence[str] = WIRES,
        log=print) -> dict[str, Any]:
  """Every (layout, wire) variant's collectives, memory and paper times,
  with each variant's bytes as a ratio to float32/float32 on its layout."""
  for wire in wires:
    parse_wire(wire)
  results = []
  for layout in layouts:
    strategy, _ = sharding.parse_layout(layout)
    done = set()
    for wire in wires:
      gather, reduce = parse_wire(wire)
      if strategy != 'fsdp':
        if gather == 'fp8' or reduce in done:
          continue  # Nothing is gathered: one row per reduce dtype.
        done.add(reduce)
        wire = f'float32/{reduce}'
      log(f'communication: {layout} {wire}')
      results.append(_measured(settings, layout, wire))
  for row in results:
    base = next((r for r in results if r['layout'] == row['layout'] and
                 r['wire'] == 'float32/float32'), None)
    row['bytes_ratio'] = (row['bytes'] / base['bytes']
                          if base and base['bytes'] else None)
    row['paper'] = {
        link: wire_time.paper_time(row['collectives'], row['flops'], link,
                                   peak)
        for link, peak in _paper_pairs(row)}
  return dict(variants=results, links=wire_time.LINKS,
              peaks=wire_time.PEAKS)


def _paper_pairs(row: dict[str, Any]):
  peak = 'h100_fp8' if row['fp8'] else 'h100_bf16'
  return [(link, peak) for link in wire_time.LINKS]


def table(result: dict[str, Any]) -> str:
  """A Markdown table: one row per variant, bytes per step and device."""
  lines = ['| layout | gather / reduce | collectives (kind dtype xcount) | '
           'bytes | wire bytes | vs float32 | state per device | '
           'temporaries |', '|---|---|---|---|---|---|---|---|']
  for v in result['variants']:
    kinds = ', '.join(f"{r['kind']} {r['dtype']} x{r['count']}"
                      for r in v['collectives'])
    ratio = '' if v['bytes_ratio'] is None else f"{v['bytes_ratio']:.3f}"
    lines.append(
        f"| {v['layout']} | {v['wire']} | {kinds} | {v['bytes']:,.0f} | "
        f"{v['wire_bytes']:,.0f} | {ratio} | "
        f"{v['state_bytes_per_device']:,} of {v['state_bytes']:,} | "
        f"{v['memory'].get('temp_bytes', 0):,} |")
  return '\n'.join(lines)


def paper_table(result: dict[str, Any]) -> str:
  """A Markdown table: per variant and link, the communication's
  bandwidth and latency terms against the compute per step on paper, and
  which bounds the step on bandwidth alone, then with the latencies."""
  links = list(result['links'])
  lines = ['| layout | gather / reduce | ' + ' | '.join(links) + ' |',
           '|---|---|' + '---|' * len(links)]
  for v in result['variants']:
    cells = []
    for link in links:
      p = v['paper'][link]
      cells.append(f"{p['bandwidth_seconds'] * 1e3:.2f} + "
                   f"{p['latency_seconds'] * 1e3:.2f} ms comm "
                   f"({p['collectives']} collectives) / "
                   f"{p['compute_seconds'] * 1e3:.2f} ms compute: "
                   f"{p['bandwidth_bound']}; {p['bound']}")
    lines.append(f"| {v['layout']} | {v['wire']} | " + ' | '.join(cells) +
                 ' |')
  return '\n'.join(lines)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """MB each device sends per step, one bar per variant."""
  path = f'{out_dir}/communication.png'
  labels = [f"{v['layout']}\n{v['wire']}" for v in result['variants']]
  charts.grouped_bar_chart(
      path, labels, {'sent': [v['wire_bytes'] / 1e6 for v in
                              result['variants']]},
      'MB sent per device per step', 'Bytes on the wire per train step',
      xlabel='layout, gather / reduce dtype')
  return [path]
