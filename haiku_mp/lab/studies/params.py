"""Study `params`: parameter count and bytes per module and param dtype,
and the whole training state per layout.

The count and bytes per module come from an abstract trace (no memory used).
Parameters are stored in the policy's param dtype; but what training keeps
is the whole state: with a float32 master copy (`param_updates.float32_master`),
half params cost 4 more bytes per param, not fewer; without one (bfloat16
params rounded stochastically or with a Kahan buffer, bfloat16 moments) the
state halves. `state_layouts` measures every layout.
"""

import os
from typing import Any, Callable

import numpy as np

from haiku_mp.lab import charts
from haiku_mp.lab import run_plots
from haiku_mp.lab.studies import state_layouts
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import overview

DTYPES = ('float32', 'float16', 'bfloat16')


def run(settings: settings_lib.Settings,
        log: Callable[[str], None] = print) -> dict[str, Any]:
  """{'modules': [...], 'totals': {dtype: {count, bytes, megabytes}},
  'state_layouts': [the state's parts per layout]}."""
  rows = overview.module_rows(experiment.build_without_data(settings))
  modules = [dict(path=r['path'], param_count=r['param_count'],
                  **{f'bytes_{d}': r['param_count'] * np.dtype(d).itemsize
                     for d in DTYPES})
             for r in rows if r['param_count']]
  count = sum(m['param_count'] for m in modules)
  totals = {d: dict(count=count, bytes=count * np.dtype(d).itemsize,
                    megabytes=count * np.dtype(d).itemsize / 1e6)
            for d in DTYPES}
  float32 = totals['float32']['bytes']
  return dict(experiment='params', modules=modules, totals=totals,
              state_layouts=state_layouts.rows(settings, compile_step=False,
                                               log=log),
              note=(f'MB = 1e6 bytes: {count:,} float32 params are '
                    f'{float32 / 1e6:.2f} MB ({float32 / 2**20:.2f} MiB).'))


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  path = os.path.join(out_dir, 'params.png')
  dtypes = list(result['totals'])
  charts.bar_chart(path, dtypes,
                  [result['totals'][d]['megabytes'] for d in dtypes],
                  run_plots.axis_label('megabytes', 'MB'),
                  f'{result["totals"]["float32"]["count"]:,} parameters')
  return [path, state_layouts.plot(
      result['state_layouts'], state_layouts.out_path(out_dir, 'params'),
      f'{result["totals"]["float32"]["count"]:,} parameters: the whole '
      'training state (Adam) per layout')]
