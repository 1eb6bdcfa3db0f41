"""The training state per layout: bytes per parameter, part by part.

The seeds asked whether bfloat16 params halve what training keeps. What
decides it is the whole state: params, a float32 master copy, Adam's two
moments, a Kahan buffer, fp8 histories, the moving average. Each layout is
the config with only `precision.policy`'s param dtype, `param_update`,
`mu_dtype` and `nu_dtype` changed. Its parts are read from the built state
(`state_layout.bytes_by_part`); compiled, the train step's argument bytes
less the batch's are the state XLA holds, which the parts must add up to.
"""

import os
from typing import Any, Callable, Optional

import jax

from haiku_mp.lab import charts
from haiku_mp.lab import run_plots
from haiku_mp.lab import timing
from haiku_mp.model import policy_strings
from haiku_mp.update import state_layout
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment

LAYOUTS = state_layout.STATE_LAYOUTS


def layout_config(settings: settings_lib.Settings, name: str
                  ) -> settings_lib.Settings:
  """`settings` in the layout `name` (one of `LAYOUTS`)."""
  params, update, mu, nu = LAYOUTS[name]
  return settings_lib.replace(settings, precision=dict(
      policy=policy_strings.with_dtypes(settings.precision.policy,
                                        'precision.policy', params=params),
      param_update=update, mu_dtype=mu, nu_dtype=nu))


def _batch_bytes(exp: experiment.Experiment) -> int:
  _, batch = exp.abstract_inputs()
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch))


def row(settings: settings_lib.Settings, name: str,
        compile_step: bool) -> dict[str, Any]:
  """One layout's parts (bytes, and bytes per parameter) and, compiled, the
  state's bytes as XLA counts them."""
  exp = experiment.build_without_data(layout_config(settings, name))
  state = exp.abstract_state
  sizes = state_layout.bytes_by_part(state)
  count = state_layout.param_count(state)
  result = dict(layout=name, policy=exp.settings.precision.policy,
                param_update=exp.settings.precision.param_update,
                mu_dtype=exp.settings.precision.mu_dtype,
                nu_dtype=exp.settings.precision.nu_dtype,
                param_count=count, bytes=sizes,
                state_bytes=sum(sizes.values()),
                per_parameter=state_layout.per_parameter(sizes, count))
  if compile_step:
    stats = timing.compile_experiment(exp).stats
    compiled = stats['argument_size_in_bytes'] - _batch_bytes(exp)
    result.update(
        argument_size_in_bytes=stats['argument_size_in_bytes'],
        output_size_in_bytes=stats['output_size_in_bytes'],
        temp_size_in_bytes=stats['temp_size_in_bytes'],
        compiled_total_bytes=stats['compiled_total_bytes'],
        compiled_state_bytes=compiled,
        compiled_bytes_per_parameter=compiled / max(count, 1),
        compile_sec=stats['compile_sec'])
  return result


def line(result: dict[str, Any]) -> str:
  """A progress line: the layout's bytes per parameter, in all and by part."""
  per = result['per_parameter']
  parts = ', '.join(f'{p} {per[p]:.2f}' for p in state_layout.PARTS
                    if per[p] >= 0.005 and p != 'other')
  compiled = ''
  if 'compiled_bytes_per_parameter' in result:
    compiled = (f'; compiled step\'s state '
                f'{result["compiled_bytes_per_parameter"]:.2f}')
  return (f'state {result["layout"]}: {per["total"]:.2f} bytes per parameter '
          f'({parts}){compiled}')


def rows(settings: settings_lib.Settings, compile_step: bool,
         names: Optional[list[str]] = None,
         log: Callable[[str], None] = print) -> list[dict[str, Any]]:
  """`row` for every layout in `names` (all of `LAYOUTS` by default)."""
  results = []
  for name in names or LAYOUTS:
    results.append(row(settings, name, compile_step))
    log(line(results[-1]))
  return results


def plot(results: list[dict[str, Any]], path: str, title: str) -> str:
  """The seeds' parameter-size bars, redrawn as the whole training state per
  layout, stacked by part."""
  labels = [r['layout'].replace(', ', ',\n') for r in results]
  parts = {p: [r['per_parameter'][p] for r in results]
           for p in state_layout.PARTS if p != 'other' and
           any(r['per_parameter'][p] for r in results)}
  charts.stacked_bar_chart(path, labels, parts,
                          run_plots.axis_label('state', 'bytes per parameter'),
                          title, total_format='{:.2f}')
  return path


def out_path(out_dir: str, stem: str) -> str:
  return os.path.join(out_dir, f'{stem}_state_layouts.png')
