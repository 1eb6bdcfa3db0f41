"""The lab report: the seeds' questions, answered on whatever backend JAX
finds, as JSON, plots and one `report.md`.

Parts (each writes `<part>.json` and its plots into the output directory, so
a machine that allows only short commands runs them one at a time; every run
rewrites `report.md` from all the parts' JSON found there):
- `benchmark`: the step benchmark per compute dtype and batch size (what fits);
- `memory`: per dtype and batch, each variant in a fresh process (in this
  one with --quick): the device's peak bytes, the compiled step's memory,
  the activations kept;
- `precision`: matmul precision (float32 DEFAULT / TF32 vs HIGHEST) and the
  residual stream, against a float64 reference;
- `matmul`: the seeds' `jnp.dot(A, A.T)` per dtype;
- `dot_algorithms`: which `DotAlgorithmPreset`s compile (`F16_F16_F32`, ...);
- `accuracy`: the config trained in float32 (matmul precision highest),
  bfloat16 and float16 with the same seed, on the config's data; curves.
  Runs are ordinary workdirs (`accuracy/<dtype>_seed<k>`), so a cut-off part
  resumes from its checkpoints when run again.
"""

import dataclasses
import json
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from haiku_mp import errors
from haiku_mp.lab.benchmarks import step_benchmark
from haiku_mp.lab import charts
from haiku_mp.lab import compare
from haiku_mp.lab import hardware
from haiku_mp.lab import isolated
from haiku_mp.lab.report import report_markdown
from haiku_mp.lab import run_plots
from haiku_mp.lab.studies import dot_algorithms
from haiku_mp.lab.studies import matmul
from haiku_mp.lab.studies import matmul_precision as precision_lab
from haiku_mp.lab.studies import memory
from haiku_mp.lab import variants
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import console
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import loop

PARTS = ('benchmark', 'memory', 'precision', 'matmul', 'dot_algorithms',
         'accuracy')
# The accuracy target of bf16 and fp16 against float32 (test accuracy).
PARITY_POINTS = 0.3


@dataclasses.dataclass(frozen=True)
class Sizes:
  """How big each part is: the full report, or `--quick` (a CPU test)."""
  batch_sizes: tuple[int, ...] = (128, 1024, 4096)
  steps: int = 5
  ceiling_size: int = 4096
  ceiling_repeats: int = 5
  matmul_shape: tuple[int, int] = (1024, 65536)
  repeats: int = 5
  matmul_precisions: tuple[str, ...] = precision_lab.MATMUL_PRECISIONS
  precision_dtypes: tuple[str, ...] = variants.DTYPES
  numerics_batch_size: int = 32
  dot_size: int = 2048
  isolate_memory: bool = True
  isolate_precision: bool = True


# --quick's ceiling is still a ceiling: a matmul large enough to keep the
# device busy (a 64^3 one measured the cost of a call, not the device).
QUICK = Sizes(batch_sizes=(8,), steps=1, ceiling_size=1024, ceiling_repeats=3,
              matmul_shape=(64, 256), repeats=1, matmul_precisions=('',),
              precision_dtypes=('float16',), numerics_batch_size=4,
              dot_size=32, isolate_memory=False, isolate_precision=False)
# --quick's model: one small block, so every part compiles in seconds.
QUICK_MODEL = dict(num_layers=1, embed_dim=16, mlp_dim=32, num_heads=2,
                   patch_size=8)
QUICK_TRAIN_STEPS = 4
QUICK_SYNTHETIC_EXAMPLES = 64  # Per split, when the data is synthetic.


def quick_config(settings: settings_lib.Settings) -> settings_lib.Settings:
  """`settings` shrunk for --quick: a tiny model and a few training steps."""
  return variants.shrunk(settings, QUICK_MODEL, QUICK_TRAIN_STEPS,
                         QUICK.batch_sizes[0], QUICK_SYNTHETIC_EXAMPLES)


def _first_line(e: BaseException) -> str:
  return ' '.join(str(e).split())[:300]


def _out_of_memory(e: BaseException) -> bool:
  return 'RESOURCE_EXHAUSTED' in str(e) or 'out of memory' in str(e).lower()


# -------------------------------------------------------------------- parts --


def benchmark(settings, sizes: Sizes, log) -> dict[str, Any]:
  rows = []
  for batch_size in sizes.batch_sizes:
    for dtype in variants.DTYPES:
      variant = variants.variant_settings(settings, dtype, batch_size)
      try:
        row = step_benchmark.run(variant, sizes.steps,
                                 ceiling_size=sizes.ceiling_size,
                                 ceiling_repeats=sizes.ceiling_repeats)
        row['fits'] = True
      except Exception as e:  # pylint: disable=broad-except
        if not _out_of_memory(e):
          raise
        row = dict(dtype=dtype, batch_size=batch_size, fits=False,
                   error=_first_line(e))
      log(f'benchmark {dtype} batch {batch_size}: '
          + (f'{row["images_per_sec"]:.1f} img/s, '
             f'MFU {report_markdown.mfu(row)}'
             if row['fits'] else 'does not fit'))
      rows.append(row)
  compare.add_ratios(rows, 'vs_float32', step_benchmark.RATIO_FIELDS,
                     is_base=lambda r: r['dtype'] == 'float32' and r['fits'],
                     same_group=lambda a, b: a['batch_size'] == b['batch_size'])
  return dict(results=rows)


def memory_part(settings, sizes: Sizes, log) -> dict[str, Any]:
  """Each variant in a fresh process: its own peak, no allocator history."""
  rows = []
  for batch_size in sizes.batch_sizes:
    for dtype in variants.DTYPES:
      variant = variants.variant_settings(settings, dtype, batch_size, 'single:1x1')
      kept = memory.residual_summary(experiment.build_without_data(variant),
                                     batch_size)['kept_bytes']
      row = dict(dtype=dtype, batch_size=batch_size,
                 kept_activation_bytes=kept)
      try:
        measured = isolated.time_step(variant, sizes.steps, 1,
                                    sizes.isolate_memory)
        row.update(fits=True, **{k: measured[k] for k in (
            'device_peak_bytes', 'temp_size_in_bytes', 'compiled_total_bytes',
            'params_bytes', 'opt_state_bytes', 'median_step_sec')})
      except Exception as e:  # pylint: disable=broad-except
        # A fresh process reports any failure as a ConfigError; here only
        # running out of memory is a result, not a bug.
        if not (isinstance(e, errors.ConfigError) or _out_of_memory(e)):
          raise
        row.update(fits=False, error=_first_line(e))
      log(f'memory {dtype} batch {batch_size}: ' + (
          f'compiled {report_markdown.mib(row["compiled_total_bytes"])} MiB, '
          f'activations kept {report_markdown.mib(kept)} MiB' if row['fits']
          else 'does not fit'))
      rows.append(row)
  compare.add_ratios(
      rows, 'vs_float32', ('device_peak_bytes', 'temp_size_in_bytes',
                           'compiled_total_bytes', 'kept_activation_bytes'),
      is_base=lambda r: r['dtype'] == 'float32',
      same_group=lambda a, b: a['batch_size'] == b['batch_size'])
  return dict(results=rows, isolated=sizes.isolate_memory)


def precision_part(settings, sizes: Sizes, log) -> dict[str, Any]:
  variant = settings_lib.replace(settings, batch_size=sizes.batch_sizes[0],
                                 eval_batch_size=sizes.batch_sizes[0])
  return precision_lab.run(variant, sizes.precision_dtypes,
                           sizes.matmul_precisions,
                           sizes.steps, sizes.numerics_batch_size,
                           sizes.isolate_precision, log=log)


def accuracy(settings, out_dir: str, seeds: Sequence[int], log
             ) -> dict[str, Any]:
  runs = []
  for seed in seeds:
    for dtype in variants.DTYPES:
      workdir = os.path.join(out_dir, 'accuracy', f'{dtype}_seed{seed}')
      variant = variants.for_accuracy(settings, dtype, seed)
      start = time.perf_counter()
      with console.quietly():
        summary = loop.train_and_evaluate(variant, workdir)
      if 'preempted_at_step' in summary:
        raise errors.ConfigError(
            f'accuracy: {dtype} seed {seed} was stopped at step '
            f'{summary["preempted_at_step"]}; run the report again to resume')
      log(f'accuracy {dtype} seed {seed}: test {summary["test_accuracy"]:.4f} '
          f'after {summary["steps"]} steps ({time.perf_counter() - start:.0f} '
          f's; {os.path.relpath(workdir, out_dir)})')
      runs.append(dict(dtype=dtype, seed=seed, workdir=os.path.relpath(
          workdir, out_dir), **{k: summary[k] for k in (
              'test_accuracy', 'test_loss', 'val_accuracy', 'steps',
              'skipped_steps', 'final_loss_scale', 'images_per_sec',
              'train_time_sec')}))
  mean = lambda d: float(np.mean([r['test_accuracy'] for r in runs
                                  if r['dtype'] == d]))
  # Rounded: accuracies are counts over the test set, and 0.3 points must
  # not read as 0.30000000000000027.
  gaps = {d: round(100 * (mean(d) - mean('float32')), 6)
          for d in variants.DTYPES[1:]}
  return dict(seeds=list(seeds), epochs=settings.num_epochs,
              num_train_steps=settings.num_train_steps,
              data_source=settings.data.source, runs=runs,
              mean_test_accuracy={d: mean(d) for d in variants.DTYPES},
              gap_points_vs_float32=gaps, target_points=PARITY_POINTS,
              target_met={d: abs(g) <= PARITY_POINTS for d, g in gaps.items()})


def _accuracy_plot(result, out_dir) -> list[str]:
  path = os.path.join(out_dir, 'accuracy_curves.png')
  run_plots.plot_runs(
      {f'{r["dtype"]} seed {r["seed"]}': run_plots.read_metrics(
          os.path.join(out_dir, r['workdir'])) for r in result['runs']},
      path, f'{result["data_source"]} data on {result["device"]}')
  return [path]


def _by_dtype_and_batch(result, out_dir, name: str, field: str, scale: float,
                       unit: str, title: str) -> list[str]:
  """A grouped bar chart of `field` (/ `scale`, in `unit`) per batch size and
  dtype; variants that did not fit are 0."""
  rows = result['results']
  batch_sizes = list(dict.fromkeys(r['batch_size'] for r in rows))
  values = {(r['dtype'], r['batch_size']): r.get(field) or 0 for r in rows}
  path = os.path.join(out_dir, f'{name}.png')
  charts.grouped_bar_chart(
      path, batch_sizes,
      {d: [values.get((d, b), 0) / scale for b in batch_sizes]
       for d in variants.DTYPES}, run_plots.axis_label(field, unit), title,
      run_plots.axis_label('batch_size'))
  return [path]


def _benchmark_plot(result, out_dir) -> list[str]:
  return _by_dtype_and_batch(result, out_dir, 'benchmark_images_per_sec',
                             'images_per_sec', 1, 'images/s',
                             f'train step on {result["device"]}')


def _memory_plot(result, out_dir) -> list[str]:
  field = ('device_peak_bytes'
           if any(r.get('device_peak_bytes') for r in result['results'])
           else 'compiled_total_bytes')
  return _by_dtype_and_batch(
      result, out_dir, 'memory_peak', field, 2**20, 'MiB',
      f'{report_markdown.where_measured(result)} on {result["device"]}')


# ---------------------------------------------------------------- the run --


def _header() -> dict[str, Any]:
  return dict(**hardware.describe(), backend=jax.default_backend(),
              devices=jax.device_count(),
              date=time.strftime('%Y-%m-%d %H:%M:%S %Z'))


def run(settings: settings_lib.Settings, out_dir: str,
        parts: Sequence[str] = PARTS, quick: bool = False,
        seeds: Sequence[int] = (0,), command: str = '',
        log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs `parts` into `out_dir`, then rewrites `report.md`; the index."""
  unknown = [p for p in parts if p not in PARTS]
  if unknown:
    raise errors.ConfigError(f'--parts: unknown part {unknown[0]!r}; expected '
                             f'some of {PARTS}')
  sizes = QUICK if quick else Sizes()
  if quick:
    settings = quick_config(settings)
  os.makedirs(out_dir, exist_ok=True)
  steps = {
      'benchmark': (lambda: benchmark(settings, sizes, log), _benchmark_plot),
      'memory': (lambda: memory_part(settings, sizes, log), _memory_plot),
      'precision': (lambda: precision_part(settings, sizes, log),
                    precision_lab.plot),
      'matmul': (lambda: matmul.run(*sizes.matmul_shape, sizes.repeats,
                                    log=log), matmul.plot),
      'dot_algorithms': (lambda: dot_algorithms.run(sizes.dot_size,
                                                    sizes.repeats, log=log),
                         dot_algorithms.plot),
      'accuracy': (lambda: accuracy(settings, out_dir, seeds, log),
                   _accuracy_plot),
  }
  for part in parts:
    start = time.perf_counter()
    measure, plot = steps[part]
    result = dict(_header(), part=part, quick=quick, command=command,
                  **measure())
    result['seconds'] = time.perf_counter() - start
    result['plots'] = [os.path.basename(p) for p in plot(result, out_dir)]
    with open(os.path.join(out_dir, f'{part}.json'), 'w') as f:
      json.dump(result, f, indent=1)
    log(f'{part}: done in {result["seconds"]:.0f}s')
  path = report_markdown.write(out_dir)
  return dict(out=out_dir, parts=list(parts), report=path)
