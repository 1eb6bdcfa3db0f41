"""Study `sweep`: compute dtype x batch size x layout -> time and memory.

Each variant is the config with its compute dtype, batch size and parallel
layout replaced, trained on a fixed random batch (no input pipeline in the
time). It reports the compiled step's memory analysis, the median step time,
images/s, the epoch time that implies, and on a GPU the device's peak bytes in
use. With `isolate`, each variant runs in a fresh Python process, so a device's
peak is that variant's own and no compile cache or allocator state carries
over from the variant before.
"""

import json
import os
from typing import Any, Sequence

import jax

from haiku_mp.lab import charts
from haiku_mp.lab import compare
from haiku_mp.lab import isolated
from haiku_mp.lab import run_plots
from haiku_mp.lab import variants
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.parallel import sharding

# Compared as ratios to float32 at the same batch size and layout.
RATIO_FIELDS = ('median_step_sec', 'temp_size_in_bytes',
                'argument_size_in_bytes', 'device_peak_bytes')


def run(settings: settings_lib.Settings,
        dtypes: Sequence[str] = variants.DTYPES,
        batch_sizes: Sequence[int] = variants.BATCH_SIZES,
        layouts: Sequence[str] = ('single:1x1',),
        num_steps: int = 3, warmup_steps: int = 1,
        isolate: bool = True, log=print) -> dict[str, Any]:
  """Every variant's result, and ratios to float32 within this one run."""
  chosen = [(d, b, l) for l in layouts for b in batch_sizes for d in dtypes]
  configs = [variants.variant_settings(settings, *v) for v in chosen]
  for variant in configs:  # Every layout must fit the devices before any runs.
    sharding.mesh_for(variant.parallel)
  results = []
  for (dtype, batch_size, layout), variant in zip(chosen, configs):
    result = dict(dtype=dtype, layout=layout, **isolated.time_step(
        variant, num_steps, warmup_steps, isolate))
    log(json.dumps(result))
    results.append(result)
  compare.add_ratios(
      results, 'vs_float32', RATIO_FIELDS,
      is_base=lambda r: r['dtype'] == 'float32',
      same_group=lambda a, b: (a['batch_size'], a['layout']) == (
          b['batch_size'], b['layout']))
  return dict(experiment='sweep', num_steps=num_steps,
              warmup_steps=warmup_steps, isolated=isolate,
              device=str(jax.devices()[0].device_kind), results=results)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Bar charts per layout: memory and step time by batch size and dtype."""
  paths = []
  layouts = dict.fromkeys(r['layout'] for r in result['results'])
  for layout in layouts:
    rows = [r for r in result['results'] if r['layout'] == layout]
    batch_sizes = list(dict.fromkeys(r['batch_size'] for r in rows))
    dtypes = list(dict.fromkeys(r['dtype'] for r in rows))

    def series(field, scale, rows=rows, batch_sizes=batch_sizes, dtypes=dtypes):
      by_key = {(r['dtype'], r['batch_size']): r.get(field) for r in rows}
      return {d: [(by_key.get((d, b)) or 0) / scale for b in batch_sizes]
              for d in dtypes}

    on_gpu = any(r.get('device_peak_bytes') for r in rows)
    memory_field = 'device_peak_bytes' if on_gpu else 'compiled_total_bytes'
    tag = layout.replace(':', '_')
    for name, field, scale, unit in (
        ('memory', memory_field, 2**20, 'MiB'),
        ('step_time', 'median_step_sec', 1, 's'),
        ('epoch_time', 'epoch_sec', 1, 's, from step time')):
      path = os.path.join(out_dir, f'sweep_{name}_{tag}.png')
      charts.grouped_bar_chart(path, batch_sizes, series(field, scale),
                              run_plots.axis_label(field, unit),
                              f'train step, {layout} on {result["device"]}',
                              run_plots.axis_label('batch_size'))
      paths.append(path)
  return paths
