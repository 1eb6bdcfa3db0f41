"""Study `profile`: a `jax.profiler` trace of N training steps.

The trace is written under `<out>/profile/plugins/profile/<run>/`: an XPlane
(`*.xplane.pb`, for TensorBoard's profile plugin / XProf) and a Chrome trace
(`*.trace.json.gz`, which https://ui.perfetto.dev opens with nothing
installed). Each step is a `StepTraceAnnotation`, so the viewers split the
trace per step; compilation and warm-up steps happen before tracing starts.

Op times are self times: the traced duration of each of the compiled step's
ops less that of the ops run inside it (a while loop's body). On XLA:CPU an op
is an event on a host thread named after its HLO op; on a GPU it is a kernel
on a device stream, named after the HLO fusion that launched it, or after a
library's (cuBLAS, cuDNN) kernel. XLA:CPU (and a GPU's streams) can run
independent ops at once, so their sum per step
(`op_ms_per_step`) can exceed the step's wall time (`step_ms`);
`busy_ms_per_step`, the time at least one op ran, cannot, and its gap to
`step_ms` is dispatch and idle time.
"""

import collections
import glob
import gzip
import json
import math
import os
import re
import statistics
from typing import Any

import jax

from haiku_mp.lab import charts
from haiku_mp.lab import run_plots
from haiku_mp.lab import timing
from haiku_mp.lab.studies import hlo_text
from haiku_mp.lab.studies import memory
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.model import forward as forward_lib

STEP_NAME = 'train'
TOP_OPS = 20
NO_OP_NAME = '(ops XLA made, no JAX op name)'
# cuBLAS kernels that XLA runs inside a CUDA graph: the trace names only the
# graph (`command_buffer_N`), not the HLO op that launched them.
LIBRARY_KERNEL = '(library kernels in CUDA graphs: the trace names no HLO op)'
OUTSIDE_MODEL = '(outside the model: loss, optimizer, loss scale)'
# `%fusion.3 = f32[...] fusion(...), ..., metadata={op_name="jit(...)/..."`.


def run(settings: settings_lib.Settings, out_dir: str, num_steps: int,
        warmup_steps: int = 1) -> dict[str, Any]:
  """Compiles, warms up, then traces `num_steps` steps into `out_dir/profile`."""
  step = timing.compile_train_step(settings)
  state, batch = timing.random_inputs(step.experiment)
  for _ in range(warmup_steps):
    state, metrics = step.compiled(state, batch)
  jax.block_until_ready(state)
  log_dir = os.path.join(out_dir, 'profile')
  jax.profiler.start_trace(log_dir)
  try:
    for i in range(num_steps):
      with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
        state, metrics = step.compiled(state, batch)
        jax.block_until_ready((state, metrics))
  finally:
    jax.profiler.stop_trace()
  files = sorted(glob.glob(os.path.join(log_dir, 'plugins', 'profile', '*',
                                        '*')))
  events = _trace_events(files)
  steps = sorted((e for e in events
                  if e.get('name') == STEP_NAME and e.get('ph') == 'X'),
                 key=lambda e: e['ts'])
  op_names = hlo_op_names(step.compiled.as_text())
  ops = op_events(events, op_names)
  by_op = ops_by_self_time(ops, op_names,
                           {c.path for c in step.experiment.module_calls})
  return dict(
      experiment='profile', device=str(jax.devices()[0].device_kind),
      num_steps=num_steps, warmup_steps=warmup_steps,
      batch_size=settings.batch_size, policy=settings.precision.policy,
      log_dir=log_dir, files=[os.path.relpath(f, out_dir) for f in files],
      traced_steps=len(steps),
      step_ms=[e['dur'] / 1e3 for e in steps],
      op_ms_per_step=sum(op['self_ms'] for op in by_op) / num_steps,
      busy_ms_per_step=busy_us(ops) / 1e3 / num_steps,
      top_ops=by_op[:TOP_OPS],
      ms_per_step_by_module=ms_per_step_by_module(by_op, num_steps),
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


def op_events(events, op_names: dict[str, str]) -> list[dict[str, Any]]:
  """The executions of compiled ops, each event named after its HLO op.

  A trace with device planes (a GPU's `/device:GPU:0`) holds the kernels each
  op ran there; without them (XLA:CPU) the ops are the host events named
  after an HLO op.
  """
  devices = {e['pid'] for e in events
             if e.get('ph') == 'M' and e.get('name') == 'process_name' and
             e.get('args', {}).get('name', '').startswith('/device:')}
  if not devices:
    return [e for e in events if e.get('ph') == 'X' and
            e['name'] == e.get('args', {}).get('hlo_op')]
  return [dict(e, name=_kernel_op(e['name'], e['args']['hlo_op'], op_names),
               kernel=e['name'])
          for e in events
          if e.get('ph') == 'X' and e.get('pid') in devices and
          'hlo_op' in e.get('args', {})]


def _kernel_op(kernel: str, hlo_op: str, op_names: dict[str, str]) -> str:
  """The HLO op a GPU kernel ran for.

  XLA names a fusion's kernel after the fusion (`loop_add_fusion_9` for
  `loop_add_fusion.9`), inside a CUDA graph too, where `hlo_op` is only the
  graph; a library kernel outside a graph has its custom call as `hlo_op`;
  one inside a graph keeps the kernel's name (see LIBRARY_KERNEL).
  """
  for name in (kernel, re.sub(r'_(\d+)$', r'.\1', kernel), hlo_op,
               re.sub(r'_(\d+)$', r'.\1', hlo_op)):
    if name in op_names:
      return name
  return kernel


def busy_us(ops) -> float:
  """Microseconds during which at least one op ran (overlaps counted once)."""
  busy, end = 0.0, -math.inf
  for start, stop in sorted((e['ts'], e['ts'] + e['dur']) for e in ops):
    busy += max(0.0, stop - max(start, end))
    end = max(end, stop)
  return busy


def nesting(ops) -> list[tuple[float, str]]:
  """Per op execution: its self time in us and the op it ran inside ('' at top).

  A while loop's (or call's) event spans the events of the ops in its body on
  the same thread; counting both would count the body twice, so a parent keeps
  only the time none of its children ran (a profiler's "self time"). GPU
  kernels never nest: kernels of a CUDA graph overlap on one stream when they
  run concurrently, so each keeps its whole time.
  """
  result = [(e['dur'], '') for e in ops]
  by_thread = collections.defaultdict(list)
  for i, e in enumerate(ops):
    if 'kernel' not in e:
      by_thread[(e.get('pid'), e.get('tid'))].append(i)
  for indices in by_thread.values():
    open_ops = []  # Indices of the enclosing ops, innermost last.
    for i in sorted(indices, key=lambda i: (ops[i]['ts'], -ops[i]['dur'])):
      start = ops[i]['ts']
      while open_ops and (ops[open_ops[-1]]['ts'] + ops[open_ops[-1]]['dur']
                          <= start):
        open_ops.pop()
      if open_ops:
        parent = open_ops[-1]
        self_us, grandparent = result[parent]
        result[parent] = (self_us - ops[i]['dur'], grandparent)
        result[i] = (ops[i]['dur'], ops[parent]['name'])
      open_ops.append(i)
  return result


def hlo_op_names(text: str) -> dict[str, str]:
  """Every HLO instruction's name -> the JAX op name (with module path) it
  came from, '' for the ones XLA made."""
  names = {}
  for line in text.splitlines():
    op = hlo_text.instruction(line)
    if op:
      names.setdefault(op.name, hlo_text.op_name(op.rest))
  return names


def ops_by_self_time(ops, op_names, modules: set[str]
                      ) -> list[dict[str, Any]]:
  """Every traced op by self time summed over the steps, longest first, with
  the module it ran in; an op XLA made inside another (a while loop's body)
  counts for the enclosing op's module."""
  total = collections.Counter()
  calls = collections.Counter()
  inside = {}
  for e, (self_us, parent) in zip(ops, nesting(ops)):
    total[e['name']] += self_us
    calls[e['name']] += 1
    inside.setdefault(e['name'], parent)
  rows = []
  for op, us in total.most_common():
    op_name = op_names.get(op, '')
    named = op_name or op_names.get(inside[op], '')
    module = (_module_of(named, modules) if op in op_names or inside[op]
              else LIBRARY_KERNEL)
    rows.append(dict(hlo_op=op, self_ms=us / 1e3, calls=calls[op],
                     op_name=op_name, inside=inside[op], module=module))
  return rows


def _module_of(op_name: str, modules: set[str]) -> str:
  """The innermost module that ran the op, block indices merged."""
  if not op_name:
    return NO_OP_NAME
  # 'jit(train_step)/jvp(vit)/encoder_block_0/mlp_block/fc1/dot_general'.
  parts = memory.module_path(op_name).split('/')
  prefixes = ('/'.join(parts[1:i]) for i in range(len(parts), 1, -1))
  path = next((p for p in prefixes if p in modules), OUTSIDE_MODEL)
  return forward_lib.merge_block_indices(path)


def ms_per_step_by_module(ops, num_steps) -> dict[str, float]:
  """Op time per step by module, longest first; every op counted once, so the
  values add up to `op_ms_per_step` (up to rounding)."""
  total = collections.Counter()
  for op in ops:
    total[op['module']] += op['self_ms'] / num_steps
  return {k: round(v, 3) for k, v in total.most_common()}


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Op self time per step by module; the title gives the step's wall time."""
  by_module = result['ms_per_step_by_module']
  if not by_module:
    return []
  path = os.path.join(out_dir, 'profile_by_module.png')
  names = [n.replace('vit/encoder_block_*/', 'block/') for n in by_module]
  charts.horizontal_bar_chart(
      path, names, list(by_module.values()),
      run_plots.axis_label('ms_per_step_by_module', 'ms'),
      f'{result["policy"]}, batch {result["batch_size"]} on {result["device"]}\n'
      f'step {statistics.median(result["step_ms"]):.1f} ms, ops busy '
      f'{result["busy_ms_per_step"]:.1f} ms of it')
  return [path]
