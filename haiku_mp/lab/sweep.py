"""Experiment `sweep`: compute dtype x batch size x layout -> time and memory.

Each variant is the config with its compute dtype, batch size and parallel
layout replaced, trained on a fixed random batch (no input pipeline in the
time). It reports the compiled step's memory analysis, the median step time,
images/s, the epoch time that implies, and on a GPU the device's peak bytes in
use. With `isolate`, each variant runs in a fresh Python process, so a device's
peak is that variant's own and no compile cache or allocator state carries
over from the variant before.
"""

import copy
import json
import os
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from haiku_mp.lab import plots
from haiku_mp.model import policies
from haiku_mp.parallel import sharding
from haiku_mp.lab import compare
from haiku_mp.lab import isolated

DTYPES = ('float32', 'bfloat16', 'float16')
BATCH_SIZES = (128, 1024, 4096)
# Compared as ratios to float32 at the same batch size and layout.
RATIO_FIELDS = ('median_step_sec', 'temp_size_in_bytes',
                'argument_size_in_bytes', 'device_peak_bytes')


def in_compute_dtype(config: ml_collections.ConfigDict, dtype: str
                     ) -> ml_collections.ConfigDict:
  """A copy of `config` computing in `dtype` (params and outputs as they
  were); float16 gets dynamic loss scaling when the config has none, as
  configs/vit_fp16.py does."""
  policy = policies.parse_policy(config.precision.policy)
  name = lambda d: jnp.dtype(d).name
  text = (f'params={name(policy.param_dtype)},compute={dtype},'
          f'output={name(policy.output_dtype)}')
  policies.parse_policy(text, setting=f'sweep dtype {dtype!r}')
  config = copy.deepcopy(config)
  config.precision.policy = text
  if dtype == 'float16' and config.loss_scale.kind == 'none':
    config.loss_scale.kind = 'dynamic'
  return config


def variant_config(config: ml_collections.ConfigDict, dtype: str,
                   batch_size: int, layout: Optional[str] = None
                   ) -> ml_collections.ConfigDict:
  """`config` in the compute dtype (`in_compute_dtype`), batch size and
  layout (None: the config's own) of one variant, on synthetic data."""
  config = in_compute_dtype(config, dtype)
  if layout is not None:
    strategy, mesh_shape = sharding.parse_layout(layout)
    config.parallel.strategy = strategy
    config.parallel.mesh_shape = mesh_shape
  config.batch_size = config.eval_batch_size = batch_size
  config.data.source = 'synthetic'
  return config


def run(config: ml_collections.ConfigDict,
        dtypes: Sequence[str] = DTYPES,
        batch_sizes: Sequence[int] = BATCH_SIZES,
        layouts: Sequence[str] = ('single:1x1',),
        num_steps: int = 3, warmup_steps: int = 1,
        isolate: bool = True, log=print) -> dict[str, Any]:
  """Every variant's result, and ratios to float32 within this one run."""
  variants = [(d, b, l) for l in layouts for b in batch_sizes for d in dtypes]
  configs = [variant_config(config, *v) for v in variants]
  for variant in configs:  # Every layout must fit the devices before any runs.
    sharding.mesh_for(variant.parallel)
  results = []
  for (dtype, batch_size, layout), variant in zip(variants, configs):
    result = dict(dtype=dtype, layout=layout, **isolated.measure(
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
    for name, field, scale, ylabel in (
        ('memory', memory_field, 2**20, f'{memory_field} (MiB)'),
        ('step_time', 'median_step_sec', 1, 'median step time (s)'),
        ('epoch_time', 'epoch_sec', 1, 'epoch time (s, from step time)')):
      path = os.path.join(out_dir, f'sweep_{name}_{tag}.png')
      plots.grouped_bar_chart(path, batch_sizes, series(field, scale), ylabel,
                              f'train step, {layout} on {result["device"]}',
                              'global batch size')
      paths.append(path)
  return paths
