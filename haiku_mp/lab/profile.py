"""Experiment `profile`: a `jax.profiler` trace of N training steps.

The trace is written under `<out>/profile/plugins/profile/<run>/`: an XPlane
(`*.xplane.pb`, for TensorBoard's profile plugin / XProf) and a Chrome trace
(`*.trace.json.gz`, which https://ui.perfetto.dev opens with nothing
installed). Each step is a `StepTraceAnnotation`, so the viewers split the
trace per step; compilation and warm-up steps happen before tracing starts.
"""

import glob
import gzip
import json
import os
from typing import Any

import jax
import ml_collections

from haiku_mp import profiling
from haiku_mp import sharding

STEP_NAME = 'train'


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
  return dict(
      experiment='profile', device=str(jax.devices()[0].device_kind),
      num_steps=num_steps, warmup_steps=warmup_steps,
      batch_size=config.batch_size, policy=config.precision.policy,
      log_dir=log_dir, files=[os.path.relpath(f, out_dir) for f in files],
      traced_steps=_traced_steps(files),
      open_with=[f'tensorboard --logdir {log_dir}  (needs the '
                 'tensorboard-plugin-profile package)',
                 f'xprof --logdir {log_dir}  (pip install xprof)',
                 'or load the *.trace.json.gz file at https://ui.perfetto.dev'])


def _traced_steps(files) -> int:
  """How many step annotations the Chrome trace holds."""
  traces = [f for f in files if f.endswith('.trace.json.gz')]
  if not traces:
    return 0
  with gzip.open(traces[-1], 'rt') as f:
    events = json.load(f).get('traceEvents', [])
  return len({e.get('args', {}).get('step_num') for e in events
              if e.get('name') == STEP_NAME})


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  del result, out_dir  # The trace is the picture.
  return []
