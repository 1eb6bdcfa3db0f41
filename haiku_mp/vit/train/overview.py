"""What a run shows of itself: the per-module table (policy in force,
params, input/output dtypes, how each matmul runs) that `launch.tabulate`
prints and the lab reads, and the lines a run logs as it starts (the
compilation cache, the data, the devices, the matmuls, the state's
layout)."""

import collections
import math
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp

from haiku_mp.model import module_runs
from haiku_mp.model import half_dot
from haiku_mp.model import interception
from haiku_mp.model import meta_params
from haiku_mp.model import policies
from haiku_mp.model import policy_strings
from haiku_mp.update import state_layout
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.train import console
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import run_dir


_COLUMNS = (('path', 'path'), ('class', 'class'), ('policy', 'policy'),
            ('rule', 'policy_source'), ('params', 'param_count'),
            ('bytes', 'param_bytes'), ('param dtypes', 'param_dtypes'),
            ('in', 'input_dtypes'), ('out', 'output_dtypes'),
            ('matmul', 'matmul'), ('FLOPs', 'matmul_flops_share'),
            ('runs', 'matmul_runs'))


def _dtype_names(tree: Any) -> list[str]:
  return [jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree)
          if hasattr(x, 'dtype')]


def _source(rule: policies.Rule | None) -> str:
  if rule is None:
    return 'inherited'
  return f'{rule.source} {rule.target}'


def module_rows(exp: experiment.Experiment) -> list[dict[str, Any]]:
  """One row per module, in call order, for the experiment's model.

  Under the `pjit` strategy each parameter also shows how it is sharded
  (PartitionSpec over the ('batch', 'model') mesh).
  """
  calls, params = exp.module_calls, exp.abstract_state.params
  precision = exp.precision
  shardings = exp.strategy.state_shardings
  specs = shardings and shardings.params
  # What each module's own matmuls run, and their share of the forward's
  # FLOPs (haiku_mp.describe: one abstract trace of the forward, the params'
  # shapes those of the state), at the batch a device runs (4-bit blocks
  # need its tokens).
  devices = 1 if exp.mesh is None else exp.mesh.shape[sharding.BATCH]
  described = {r.path: r for r in module_runs.describe(
      exp.forward, forward_lib.dummy_images(
          exp.settings.model, max(exp.train_batch_size // devices, 1)),
      True, init_shapes=params)}
  rows = {}
  for call in calls:
    if call.method != '__call__' or call.path in rows:
      continue
    own = params.get(call.path, {})
    # fp8 amax histories are listed with the params, not counted as ones.
    trained = {n: p for n, p in own.items() if n not in meta_params.META_NAMES}
    rows[call.path] = {
        'path': call.path,
        'class': call.class_name,
        'policy': policy_strings.policy_str(call.policy),
        'policy_source': _source(call.rule),
        'params': {name: dict(shape=list(p.shape), dtype=p.dtype.name,
                              sharding=_spec(specs, call.path, name))
                   for name, p in own.items()},
        'param_dtypes': sorted({p.dtype.name for p in own.values()}),
        'param_count': sum(math.prod(p.shape) for p in trained.values()),
        'param_bytes': sum(math.prod(p.shape) * p.dtype.itemsize
                           for p in trained.values()),
        'input_dtypes': _dtype_names(call.args),
        'output_dtypes': _dtype_names(call.output),
        'matmul': (_low_bit(precision, call.class_name, call.path)
                   if precision.runs_low_bit(call.class_name, call.path) else '-'),
        'matmul_flops_share': (described[call.path].share
                               if call.path in described else None),
        'matmul_runs': _runs(described.get(call.path)),
    }
  return sorted(rows.values(), key=lambda r: _preorder_key(r['path'], calls))


def _runs(row: Optional[module_runs.ModuleMatmuls]) -> str:
  """What a module's own matmuls run: haiku_mp's forms, or not its."""
  if row is None:
    return '-'
  if not row.haiku_mp:
    return "not haiku_mp's"
  return ','.join(row.haiku_mp)


def _low_bit(precision: policies.Precision, class_name: str,
             path: str) -> str:
  """A low-bit Linear's matmul as the table names it: 'fp8 current', ...,
  or its 4-bit format."""
  if precision.runs_fp4(class_name, path):
    return precision.low_bit.fp4.format
  return f'fp8 {precision.low_bit.fp8.scaling}'


def _preorder_key(path: str, calls: list[interception.ModuleCall]):
  """Sorts a module before its children: calls are recorded as they finish."""
  first = min(i for i, c in enumerate(calls)
              if c.path == path or c.path.startswith(path + '/'))
  return first, path.count('/')


def _spec(specs, path: str, name: str) -> str:
  if specs is None:
    return 'replicated'
  return sharding.describe(specs[path][name])


def _sharding_cell(row: dict[str, Any]) -> str:
  sharded = [f'{n}:{p["sharding"]}' for n, p in sorted(row['params'].items())
             if p['sharding'] != 'replicated']
  return ' '.join(sharded) or '-'


def _cell(value: Any) -> str:
  if isinstance(value, list):
    return ','.join(sorted(set(value))) if value else '-'
  if isinstance(value, float):  # A share of the FLOPs.
    return f'{value:.1%}'
  if value is None:
    return '-'
  return str(value)


def format_table(rows: list[dict[str, Any]]) -> str:
  """A plain-text table with a total line."""
  header = [title for title, _ in _COLUMNS] + ['sharded']
  body = [[_cell(row[key]) for _, key in _COLUMNS] + [_sharding_cell(row)]
          for row in rows]
  total_count = sum(r['param_count'] for r in rows)
  total_bytes = sum(r['param_bytes'] for r in rows)
  body.append(['total', '', '', '', str(total_count), str(total_bytes),
               '', '', '', '', '', '', ''])
  widths = [max(len(line[i]) for line in [header] + body)
            for i in range(len(header))]
  fmt = lambda line: '  '.join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
  rule = '  '.join('-' * w for w in widths)
  return '\n'.join([fmt(header), rule] + [fmt(l) for l in body[:-1]] +
                   [rule, fmt(body[-1])])



def summary_line(rows: list[dict[str, Any]], overrides: str,
                 precision: policies.Precision | None = None) -> str:
  """The model in one line: modules, parameters, the policies in force (how
  many modules each), the overrides and the fp8 matmuls, for a console the
  table would fill."""
  count = sum(r['param_count'] for r in rows)
  megabytes = sum(r['param_bytes'] for r in rows) / 1e6
  counts = collections.Counter(r['policy'] for r in rows)
  in_force = '; '.join(f'{policy} ({n})' for policy, n in
                       counts.most_common())
  line = (f'Model: {len(rows)} modules, {count:,} parameters '
          f'({megabytes:.2f} MB); policies (modules): {in_force}; '
          f'overrides: {overrides or "none"}')
  low_bit_rows = [r for r in rows if r['matmul'] != '-']
  low_bit = precision.low_bit if precision is not None else None
  if low_bit is not None and low_bit.fp4 is not None:
    kept = sum(1 for r in low_bit_rows if r['matmul'].startswith('fp8'))
    line += (f'; 4-bit matmuls: {len(low_bit_rows) - kept} Linear'
             + (f' ({kept} kept in fp8)' if kept else '') + ', '
             f'{low_bit.fp4.describe()} (emulated: dequantized float32 '
             'GEMMs)')
  elif low_bit is not None:
    emulation = low_bit.fp8.emulation(jax.default_backend())
    line += (f'; fp8 matmuls: {len(low_bit_rows)} Linear, E4M3 forward, E5M2 '
             f'gradients, {low_bit.fp8.describe()} scaling'
             + (f' ({emulation})' if emulation else ''))
  return line


# The module table a run writes into its workdir.
MODULES_FILE = 'modules.txt'


def load_data(exp: experiment.Experiment) -> pipeline.Splits:
  start = time.perf_counter()
  splits = exp.load_splits()
  console.info(
      'Data (%s): %s in memory in %.1fs.', exp.settings.data.source,
      ', '.join(f'{name} {len(split.labels)}'
                for name, split in zip(splits._fields, splits)),
      time.perf_counter() - start)
  return splits


def log_compilation_cache(cache: Optional[str], setting: str) -> None:
  console.info(
      'Compilation cache: %s', cache or
      (f'off ({setting!r} on {jax.default_backend()}; set '
       '--config.compilation_cache_dir=DIR for one)'))


def state_line(exp: experiment.Experiment) -> str:
  """The `State:` line of the run's layout (`state_layout.describe`)."""
  precision = exp.settings.precision
  return state_layout.describe(exp.abstract_state, precision.param_update,
                               precision.mu_dtype, precision.nu_dtype)


def log_startup(exp: experiment.Experiment, state, workdir: str,
                is_writer: bool, log_module_table: bool = False) -> None:
  """The devices, how the matmuls run (`half_dot.matmuls_line`), one line
  about the model (the whole module table in `workdir/modules.txt`, and
  logged with `log_module_table`) and, when sharded, one kernel's layout."""
  strategy = exp.strategy
  console.info('Devices: %s (process %d of %d), strategy %s, mesh %s',
                     jax.devices(), jax.process_index(), jax.process_count(),
                     strategy.name, exp.mesh and dict(exp.mesh.shape))
  precision = exp.precision
  console.info('%s', half_dot.matmuls_line(
      precision.dot_form,
      [precision.policy.compute_dtype,
       *(rule.policy.compute_dtype for rule in precision.overrides)],
      precision.matmuls.backend, 'precision.dot_form'))
  rows = module_rows(exp)
  table = format_table(rows)
  path = os.path.join(workdir, MODULES_FILE)
  if is_writer:
    run_dir.write_atomically(path, table + '\n')
  console.info(
      '%s; every module: %s',
      summary_line(rows, exp.settings.precision.overrides,
                                exp.precision), path)
  console.info(
      '%s', state_line(exp))
  if log_module_table:
    console.info('Modules:\n%s', table)
  for line in exp.describe():
    console.info('%s', line)
  if strategy.state_shardings is None:
    return
  name = next((k for k in state.params if k.endswith('mlp_block/fc1')), None)
  if name is not None:
    kernel = state.params[name]['w']
    console.info('%s/w %s sharded as %s:', name, kernel.shape,
                       kernel.sharding.spec)
    jax.debug.visualize_array_sharding(kernel)
