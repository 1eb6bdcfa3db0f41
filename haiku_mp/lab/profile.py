"""Experiment `profile`: a `jax.profiler` trace of N training steps.

The trace is written under `<out>/profile/plugins/profile/<run>/`: an XPlane
(`*.xplane.pb`, for TensorBoard's profile plugin / XProf) and a Chrome trace
(`*.trace.json.gz`, which https://ui.perfetto.dev opens with nothing
installed). Each step is a `StepTraceAnnotation`, so the viewers split the
trace per step; compilation and warm-up steps happen before tracing starts.
"""

import collections
import glob
import gzip
import json
import os
import re
from typing import Any

import jax
import ml_collections

from haiku_mp import model
from haiku_mp import plots
from haiku_mp import profiling
from haiku_mp import sharding
from haiku_mp.lab import memory

STEP_NAME = 'train'
TOP_OPS = 20
# `%fusion.3 = f32[...] fusion(...), ..., metadata={op_name="jit(...)/..."`.
_HLO_OP = re.compile(r'^\s*(?:ROOT )?%?([\w.-]+) = .*?op_name="([^"]*)"',
                     re.MULTILINE)


def run(config: ml_collections.ConfigDict, out_dir: str, num_steps: int,
        warmup_steps: int = 1) -> dict[str, Any]:
  """Compiles, warms up, then traces `num_steps` steps into `out_dir/profile`."""
  step = profiling.compile_train_step(config,
                                      sharding.mesh_for(config.parallel))
  state, batch = profiling.random_inputs(config, step.parallel)
  for _ in range(warmup_steps):
    state, metrics = step.compiled(state, batch)
  jax.block_until_ready(state)
  log_dir = os.path.join(out_dir, 'profile')
  jax.profiler.start_trace(log_dir)
  try:
    for i in range(num_steps):
      with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
        state, metrics = step.compiled(state, batch)
        jax.block_until_ready(metrics['loss'])
  finally:
    jax.profiler.stop_trace()
  files = sorted(glob.glob(os.path.join(log_dir, 'plugins', 'profile', '*',
                                        '*')))
  events = _trace_events(files)
  op_names = _op_names(step.compiled.as_text())
  top_ops = _top_ops(events, op_names)
  return dict(
      experiment='profile', device=str(jax.devices()[0].device_kind),
      num_steps=num_steps, warmup_steps=warmup_steps,
      batch_size=config.batch_size, policy=config.precision.policy,
      log_dir=log_dir, files=[os.path.relpath(f, out_dir) for f in files],
      traced_steps=len({e.get('args', {}).get('step_num') for e in events
                        if e.get('name') == STEP_NAME}),
      top_ops=top_ops[:TOP_OPS],
      ms_per_step_by_module=_by_module(top_ops, num_steps, _module_paths(config)),
      open_with=[f'tensorboard --logdir {log_dir}  (needs the '
                 'tensorboard-plugin-profile package)',
                 f'xprof --logdir {log_dir}  (pip install xprof)',
                 'or load the *.trace.json.gz file at https://ui.perfetto.dev'])


def _trace_events(files) -> list[dict[str, Any]]:
  traces = [f for f in files if f.endswith('.trace.json.gz')]
  if not traces:
    return []
  with gzip.open(traces[-1], 'rt') as f:
    return json.load(f).get('traceEvents', [])


def _op_names(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> the JAX op name (with module path) it came from."""
  names = {}
  for match in _HLO_OP.finditer(hlo_text):
    names.setdefault(match.group(1), match.group(2))
  return names


def _top_ops(events, op_names) -> list[dict[str, Any]]:
  """The compiled step's ops by total traced time, longest first."""
  total = collections.Counter()
  calls = collections.Counter()
  for e in events:
    op = e.get('args', {}).get('hlo_op')
    if e.get('ph') == 'X' and op and e['name'] == op:
      total[op] += e['dur']
      calls[op] += 1
  return [dict(hlo_op=op, total_ms=us / 1e3, calls=calls[op],
               op_name=op_names.get(op, ''))
          for op, us in total.most_common()]


def _module_paths(config) -> set[str]:
  calls, _ = model.trace_modules(config.model, model.make_precision(config))
  return {c.path for c in calls}


def _by_module(top_ops, num_steps, modules: set[str]) -> dict[str, float]:
  """Traced op time per step by the innermost module that ran the op (block
  indices merged); the optimizer, loss and loss scaling are outside."""
  total = collections.Counter()
  for op in top_ops:
    # 'jit(train_step)/jvp(vit)/encoder_block_0/mlp_block/fc1/dot_general'.
    parts = memory.module_path(op['op_name']).split('/')
    prefixes = ('/'.join(parts[1:i]) for i in range(len(parts), 1, -1))
    path = next((p for p in prefixes if p in modules),
                '(outside the model: loss, optimizer, loss scale)'
                if op['op_name'] else '(ops XLA made, no JAX op name)')
    total[memory.merge_block_indices(path)] += op['total_ms'] / num_steps
  return {k: round(v, 3) for k, v in total.most_common(TOP_OPS)}


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Traced time per step by module."""
  by_module = result['ms_per_step_by_module']
  if not by_module:
    return []
  path = os.path.join(out_dir, 'profile_by_module.png')
  names = [n.replace('vit/encoder_block_*/', 'block/') for n in by_module]
  plots.horizontal_bar_chart(
      path, names, list(by_module.values()), 'ms per step (traced ops)',
      f'{result["policy"]}, batch {result["batch_size"]} on {result["device"]}')
  return [path]
