"""What a run logs as it starts: the compilation cache, the data, the
devices, how its matmuls run, the model's modules and the state's layout."""

import os
import time
from typing import Optional

import jax

from haiku_mp.model import half_dot
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.train import console_lines
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import module_table
from haiku_mp.vit.train import run_dir
from haiku_mp.vit.train import state_layout

# The module table a run writes into its workdir.
MODULES_FILE = 'modules.txt'


def load_data(exp: experiment.Experiment) -> pipeline.Splits:
  start = time.perf_counter()
  splits = exp.load_splits()
  console_lines.info(
      'Data (%s): %s in memory in %.1fs.', exp.settings.data.source,
      ', '.join(f'{name} {len(split.labels)}'
                for name, split in zip(splits._fields, splits)),
      time.perf_counter() - start)
  return splits


def log_compilation_cache(cache: Optional[str], setting: str) -> None:
  console_lines.info(
      'Compilation cache: %s', cache or
      (f'off ({setting!r} on {jax.default_backend()}; set '
       '--config.compilation_cache_dir=DIR for one)'))


def log_startup(exp: experiment.Experiment, state, workdir: str,
                is_writer: bool, log_module_table: bool = False) -> None:
  """The devices, how the matmuls run (`half_dot.matmuls_line`), one line
  about the model (the whole module table in `workdir/modules.txt`, and
  logged with `log_module_table`) and, when sharded, one kernel's layout."""
  strategy = exp.strategy
  console_lines.info('Devices: %s (process %d of %d), strategy %s, mesh %s',
                     jax.devices(), jax.process_index(), jax.process_count(),
                     strategy.name, exp.mesh and dict(exp.mesh.shape))
  precision = exp.precision
  console_lines.info('%s', half_dot.matmuls_line(
      precision.dot_form,
      [precision.policy.compute_dtype,
       *(rule.policy.compute_dtype for rule in precision.overrides)],
      precision.dots.backend))
  rows = module_table.module_rows(exp)
  table = module_table.format_table(rows)
  path = os.path.join(workdir, MODULES_FILE)
  if is_writer:
    run_dir.write_atomically(path, table + '\n')
  console_lines.info(
      '%s; every module: %s',
      module_table.summary_line(rows, exp.settings.precision.overrides,
                                exp.precision), path)
  console_lines.info(
      '%s', state_layout.describe(exp.settings.precision, exp.abstract_state))
  if log_module_table:
    console_lines.info('Modules:\n%s', table)
  for line in exp.describe():
    console_lines.info('%s', line)
  if strategy.state_shardings is None:
    return
  name = next((k for k in state.params if k.endswith('mlp_block/fc1')), None)
  if name is not None:
    kernel = state.params[name]['w']
    console_lines.info('%s/w %s sharded as %s:', name, kernel.shape,
                       kernel.sharding.spec)
    jax.debug.visualize_array_sharding(kernel)
