"""Study `memory`: what the train step keeps in memory, per dtype and batch.

Two views:
- backend-independent: the residuals the backward pass keeps (JAX's
  saved-residuals analysis of `jax.vjp` of the loss, traced abstractly, so any
  batch size costs no memory), attributed to module paths through the name
  stack Haiku gives every module call;
- backend-specific: XLA's memory analysis of the compiled train step.

Together they give a breakdown per dtype and batch size: params, gradients,
optimizer state, activations kept for the backward pass, and the compiled
step's temporaries. Beside them, the training state per layout
(`state_layouts`): bytes per parameter, part by part and as the compiled
step's arguments hold them.
"""

import collections
import math
import os
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
import numpy as np

from haiku_mp.lab import charts
from haiku_mp.lab import compare
from haiku_mp.lab import run_plots
from haiku_mp.lab import timing
from haiku_mp.lab import variants
from haiku_mp.lab.studies import state_layouts
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit.train import experiment

OUTSIDE_MODEL = '(loss, outside the model)'
_TRANSFORM = re.compile(r'^\w+\((.*)\)$')  # 'jvp(vit)' -> 'vit'.


def module_path(name_stack: str) -> str:
  """'jvp(vit)/encoder_block_0/attention' -> 'vit/encoder_block_0/attention'."""
  parts = []
  for part in name_stack.split('/'):
    while (match := _TRANSFORM.match(part)):
      part = match.group(1)
    if part:
      parts.append(part)
  return '/'.join(parts)


def _nbytes(aval) -> int:
  return math.prod(aval.shape) * _dtype(aval).itemsize


def _dtype(aval):
  """The aval's dtype; JAX's extended ones (the rng keys a rematerialized
  block keeps to redraw its dropout masks) as they are."""
  if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
    return aval.dtype
  return np.dtype(aval.dtype)


def saved_residuals(exp: experiment.Experiment,
                    batch_size: int) -> list[dict[str, Any]]:
  """Every residual of the loss's vjp: shape, dtype, bytes, and its source.

  `source` is 'param' (a parameter itself: no extra memory), 'literal', or
  'activation' (computed in the forward pass, kept for the backward pass);
  `module` is the path of the module that computed it.
  """
  loss_fn = exp.loss_fn
  images = forward_lib.dummy_images(exp.settings.model, batch_size)
  params = exp.abstract_state.params
  batch = dict(image=jax.ShapeDtypeStruct(images.shape, jnp.float32),
               label=jax.ShapeDtypeStruct((batch_size,), jnp.int32))

  def loss(params, batch):
    return loss_fn(params, jax.random.key(0), batch)[0]

  closed, (_, vjp_fn) = jax.make_jaxpr(
      lambda p, b: jax.vjp(lambda p: loss(p, b), p),
      return_shape=True)(params, batch)
  jaxpr = closed.jaxpr
  residuals = jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(vjp_fn)):]
  producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
  inputs = set(jaxpr.invars[:len(jax.tree.leaves(params))])
  rows = []
  for v in residuals:
    row = dict(shape=list(v.aval.shape), dtype=str(_dtype(v.aval)),
               bytes=_nbytes(v.aval), module='', primitive='')
    if isinstance(v, jex_core.Literal):
      row['source'] = 'literal'
    elif v in inputs:
      row['source'] = 'param'
    elif v in producers:
      eqn = producers[v]
      row.update(source='activation', primitive=eqn.primitive.name,
                 module=module_path(str(eqn.source_info.name_stack)))
    else:
      row['source'] = 'input'  # The batch, or a constant.
    rows.append(row)
  return rows


def _group(rows, key) -> dict[str, int]:
  sums = collections.Counter()
  for r in rows:
    sums[key(r)] += r['bytes']
  return dict(sums.most_common())


def residual_summary(exp: experiment.Experiment,
                     batch_size: int) -> dict[str, Any]:
  """Saved-residual bytes in total, per dtype, per module class and module."""
  rows = saved_residuals(exp, batch_size)
  classes = {c.path: c.class_name for c in exp.module_calls}
  kept = [r for r in rows if r['source'] != 'param']
  by_class = lambda r: classes.get(r['module'], OUTSIDE_MODEL)
  by_module = lambda r: forward_lib.merge_block_indices(r['module']) or OUTSIDE_MODEL
  return dict(
      count=len(rows),
      bytes=sum(r['bytes'] for r in rows),
      param_bytes=sum(r['bytes'] for r in rows if r['source'] == 'param'),
      kept_bytes=sum(r['bytes'] for r in kept),
      by_dtype=_group(kept, lambda r: r['dtype']),
      by_module_class=_group(kept, by_class),
      by_module=_group(kept, by_module))


def _tree_bytes(tree) -> int:
  return sum(_nbytes(x) for x in jax.tree.leaves(tree))


def breakdown(settings: settings_lib.Settings, compile_step: bool
              ) -> dict[str, Any]:
  """Params, gradients, optimizer state, kept activations, compiled temp."""
  exp = experiment.build_without_data(settings)
  residuals = residual_summary(exp, settings.batch_size)
  step = timing.compile_experiment(exp) if compile_step else None
  state = exp.abstract_state
  row = dict(
      params_bytes=_tree_bytes(state.params),
      # jax.grad returns them in the param dtype; the step casts to float32.
      gradient_bytes=_tree_bytes(state.params),
      float32_gradient_bytes=4 * sum(math.prod(p.shape)
                                     for p in jax.tree.leaves(state.params)),
      opt_state_bytes=_tree_bytes(state.opt_state),
      kept_activation_bytes=residuals['kept_bytes'])
  if step is not None:
    row.update({k: step.stats[k] for k in (
        'argument_size_in_bytes', 'output_size_in_bytes', 'alias_size_in_bytes',
        'temp_size_in_bytes', 'compiled_total_bytes', 'compile_sec')})
  return dict(residuals=residuals, breakdown=row)


# A progress line's figures: (breakdown field, what the line calls it).
_LINE_FIELDS = (('params_bytes', 'params'), ('gradient_bytes', 'gradients'),
                ('opt_state_bytes', 'optimizer'),
                ('kept_activation_bytes', 'activations kept'),
                ('temp_size_in_bytes', 'compiled temp'),
                ('compiled_total_bytes', 'compiled total'))
_MIB = 2**20


def progress_line(result: dict[str, Any]) -> str:
  """One short line for a (dtype, batch) result: its sizes in MiB."""
  row = result['breakdown']
  sizes = ', '.join(f'{name} {row[field] / _MIB:.1f}'
                    for field, name in _LINE_FIELDS if field in row)
  compile_sec = (f'; compiled in {row["compile_sec"]:.1f}s'
                 if 'compile_sec' in row else '')
  return (f'memory {result["dtype"]} batch {result["batch_size"]}: {sizes} '
          f'MiB{compile_sec}')


def run(settings: settings_lib.Settings,
        dtypes: Sequence[str] = variants.DTYPES,
        batch_sizes: Sequence[int] = variants.BATCH_SIZES,
        compile_step: bool = True, log=print) -> dict[str, Any]:
  """The breakdown for every dtype x batch size, and ratios to float32."""
  results = []
  for batch_size in batch_sizes:
    for dtype in dtypes:
      variant = variants.variant_settings(settings, dtype, batch_size,
                                          'single:1x1')
      result = dict(dtype=dtype, batch_size=batch_size,
                    policy=variant.precision.policy,
                    **breakdown(variant, compile_step))
      log(progress_line(result))
      results.append(result)
  compare.add_ratios(
      results, 'vs_float32', ('kept_activation_bytes', 'temp_size_in_bytes',
                              'compiled_total_bytes'),
      is_base=lambda r: r['dtype'] == 'float32',
      same_group=lambda a, b: a['batch_size'] == b['batch_size'],
      values=lambda r: r['breakdown'])
  return dict(experiment='memory', device=str(jax.devices()[0].device_kind),
              results=results,
              state_layouts=state_layouts.rows(settings, compile_step, log=log))


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """A stacked bar per (batch size, dtype): where the step's bytes go."""
  rows = result['results']
  labels = [f'{r["batch_size"]}\n{r["dtype"]}' for r in rows]
  mib = lambda b: b / 2**20
  parts = {
      'params': [mib(r['breakdown']['params_bytes']) for r in rows],
      'gradients (float32)': [mib(r['breakdown']['float32_gradient_bytes'])
                              for r in rows],
      'optimizer state': [mib(r['breakdown']['opt_state_bytes']) for r in rows],
      'activations kept for backward': [
          mib(r['breakdown']['kept_activation_bytes']) for r in rows]}
  path = os.path.join(out_dir, 'memory_breakdown.png')
  charts.stacked_bar_chart(path, labels, parts,
                          run_plots.axis_label('breakdown', 'MiB'),
                          'train step memory by part (batch size / dtype)')
  paths = [path]
  if all('temp_size_in_bytes' in r['breakdown'] for r in rows):
    batch_sizes = list(dict.fromkeys(r['batch_size'] for r in rows))
    dtypes = list(dict.fromkeys(r['dtype'] for r in rows))
    values = {(r['dtype'], r['batch_size']): r for r in rows}
    for name, field in (('residuals', 'kept_activation_bytes'),
                        ('temp', 'temp_size_in_bytes')):
      path = os.path.join(out_dir, f'memory_{name}.png')
      series = {d: [mib(values[d, b]['breakdown'][field]) for b in batch_sizes]
                for d in dtypes}
      charts.grouped_bar_chart(
          path, batch_sizes, series, run_plots.axis_label(field, 'MiB'),
          f'{name}: saved for backward (any backend)' if name == 'residuals'
          else f'compiled temp on {result["device"]}',
          run_plots.axis_label('batch_size'))
      paths.append(path)
  return paths
