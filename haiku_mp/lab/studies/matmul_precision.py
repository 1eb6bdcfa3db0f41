"""Study `precision`: matmul precision and the residual stream's dtype.

Two sets of variants of the config, each compiled, timed and compared with a
float64 reference (every dtype float64, LayerNorm and softmax included, with
the same float32 initial params and the same batch):

- matmul precision: `jax.default_matmul_precision` names (DEFAULT / HIGH /
  HIGHEST and their aliases bfloat16 / tensorfloat32 / float32) per compute
  dtype. Variants whose lowered programs are identical are measured once and
  marked `same_program_as`: that is what an alias is.
- residual stream: the compute dtype, or float32 (Megatron's fp32 residual),
  per half compute dtype: saved-residual bytes, compiled memory, time, error.
"""

import os
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.lab import charts
from haiku_mp.lab import compare
from haiku_mp.lab import isolated
from haiku_mp.lab import run_plots
from haiku_mp.lab import timing
from haiku_mp.lab import variants
from haiku_mp.lab.studies import memory
from haiku_mp.update import gradients as gradients_lib
from haiku_mp.update import loss_scaling
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit.train import experiment

MATMUL_PRECISIONS = ('', 'default', 'high', 'highest', 'bfloat16',
                     'tensorfloat32', 'float32')
DTYPES = ('float32', 'bfloat16')
RESIDUAL_STREAMS = ('compute', 'float32')
_REFERENCE_POLICY = 'params=float64,compute=float64,output=float64'


def _batch(settings: settings_lib.Settings, batch_size: int, dtype
           ) -> dict[str, jax.Array]:
  batch = pipeline.random_batch(settings.model, batch_size, settings.seed,
                                np.float64)
  return dict(image=jnp.asarray(batch['image'], dtype),
              label=jnp.asarray(batch['label']))


def _logits_and_grads(exp: experiment.Experiment, params, batch):
  """Logits, loss and gradients as the train step computes them (its own
  `gradients`): the loss scaled by the config's initial loss scale, the
  gradients unscaled."""

  @jax.jit
  def run(params, batch):
    logits = exp.forward.apply(params, None, batch['image'], False)
    grads, loss, _ = gradients_lib.gradients(
        exp.loss_fn, exp.scaler, exp.scaler.init(), params,
        jax.random.key(0), batch)
    return logits, loss, grads

  return jax.tree.map(np.asarray, run(params, batch))


def _initial_params(exp: experiment.Experiment) -> Any:
  """The initial float32 params, with the zero-initialized ones (head, cls
  token, biases) drawn small and random so that every path carries a signal.
  One jitted program: run op by op, Haiku's init compiles each op."""
  settings = exp.settings

  @jax.jit
  def init():
    params = exp.forward.init(jax.random.key(settings.seed),
                              forward_lib.dummy_images(settings.model), True)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(settings.seed + 1), len(leaves))
    leaves = [jnp.where(p == 0, 0.02 * jax.random.normal(k, p.shape, p.dtype),
                        p) for p, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, leaves)

  return init()


class Reference(NamedTuple):
  """The float64 run every variant is compared with, and the float32 initial
  params they all start from (drawn once: the params do not depend on the
  precision settings)."""
  params: Any
  logits: np.ndarray
  loss: np.ndarray
  grads: Any


def reference(settings: settings_lib.Settings, batch_size: int
              ) -> Reference:
  """Logits, loss and gradients with every dtype float64."""
  settings = settings_lib.replace(variants.without_dropout(settings),
                                  precision=dict(policy='float32',
                                                 overrides=''))
  params = _initial_params(experiment.build_without_data(settings))
  settings = settings_lib.replace(
      settings, loss_scale=dict(kind='none'),
      precision=dict(policy=_REFERENCE_POLICY, float32_layer_norm=False,
                     matmul_precision='highest'))
  with jax.enable_x64(True):
    params64 = jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), params)
    exp = experiment.build_without_data(settings)
    return Reference(params, *_logits_and_grads(
        exp, params64, _batch(exp.settings, batch_size, jnp.float64)))


def _relative(a, b) -> float:
  return float(np.linalg.norm((a - b).ravel()) / np.linalg.norm(b.ravel()))


def error_vs(settings: settings_lib.Settings, ref, batch_size: int
             ) -> dict[str, float]:
  """How far the config's logits, loss and gradients are from `ref`."""
  exp = experiment.build_without_data(variants.without_dropout(settings))
  params = jax.tree.map(lambda p, a: jnp.asarray(p, a.dtype), ref.params,
                        exp.abstract_state.params)  # As the policy stores them.
  logits, loss, grads = _logits_and_grads(
      exp, params, _batch(exp.settings, batch_size, jnp.float32))
  _, ref_logits, ref_loss, ref_grads = ref
  flat = lambda tree: np.concatenate(
      [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])
  logits, ref_logits = np.asarray(logits, np.float64), ref_logits
  return dict(
      logits_max_abs_error=float(np.abs(logits - ref_logits).max()),
      logits_relative_error=_relative(logits, ref_logits),
      loss_abs_error=float(abs(float(loss) - float(ref_loss))),
      grads_relative_error=_relative(flat(grads), flat(ref_grads)))


def _lowered(variant):
  """The variant's experiment, its lowered train step and its fingerprint."""
  exp = experiment.build_without_data(variant)
  lowered = timing.lower_train_step(exp)
  return exp, lowered, timing.fingerprint(lowered.as_text())


def _measure(exp, lowered, ref, num_steps, numerics_batch_size, isolate
             ) -> dict[str, Any]:
  """Time and memory (in a fresh process if `isolate`, else from the program
  already lowered here), and the error against `ref`."""
  if isolate:
    measured = isolated.time_step(exp.settings, num_steps, 1)
  else:
    measured = isolated.measure_compiled(
        timing.compile_experiment(exp, lowered), num_steps, 1)
  keep = ('compile_sec', 'temp_size_in_bytes', 'compiled_total_bytes',
          'program_sha256', 'median_step_sec', 'images_per_sec',
          'device_peak_bytes')
  return dict({k: measured[k] for k in keep},
              **error_vs(exp.settings, ref, numerics_batch_size))


def run(settings: settings_lib.Settings,
        dtypes: Sequence[str] = DTYPES,
        matmul_precisions: Sequence[str] = MATMUL_PRECISIONS,
        num_steps: int = 3, numerics_batch_size: int = 32,
        isolate: bool = True, log=print) -> dict[str, Any]:
  """Both sets of variants at `settings.batch_size`, against one reference."""
  for dtype in dtypes:  # Every setting is checked before anything runs.
    for name in matmul_precisions:
      forward_lib.precision_from_config(
          variants.matmul_variant(settings, dtype, settings.batch_size, name))
  ref = reference(settings, numerics_batch_size)
  matmul_rows = []
  for dtype in dtypes:
    for name in matmul_precisions:
      exp, lowered, fingerprint = _lowered(
          variants.matmul_variant(settings, dtype, settings.batch_size, name))
      row = dict(dtype=dtype, matmul_precision=name or '(jax default)')
      # Lowering is cheap; an identical program is not measured twice.
      same = _same_program(fingerprint, dtype, matmul_rows)
      if same is not None:
        row.update({k: v for k, v in same.items() if k not in row},
                   same_program_as=same['matmul_precision'])
      else:
        row.update(_measure(exp, lowered, ref, num_steps, numerics_batch_size,
                            isolate),
                   same_program_as=None)
      log(f'precision {dtype} matmul_precision {row["matmul_precision"]}: '
          + (f'the program of {same["matmul_precision"]}' if same else
             f'{row["median_step_sec"] * 1e3:.1f} ms/step, gradient error '
             f'{row["grads_relative_error"]:.2e} vs float64'))
      matmul_rows.append(row)

  residual_rows = []
  for dtype in dtypes:
    streams = RESIDUAL_STREAMS if dtype != 'float32' else ('compute',)
    for stream in streams:
      variant = variants.matmul_variant(settings, dtype, settings.batch_size,
                         residual_stream=stream)
      exp, lowered, fingerprint = _lowered(variant)
      residuals = memory.residual_summary(exp, settings.batch_size)
      row = dict(dtype=dtype, residual_stream=stream,
                 kept_activation_bytes=residuals['kept_bytes'])
      same = _same_program(fingerprint, dtype, matmul_rows)
      measured = same or _measure(exp, lowered, ref, num_steps,
                                  numerics_batch_size, isolate)
      row.update({k: v for k, v in measured.items()
                  if k not in ('dtype', 'matmul_precision', 'same_program_as')})
      log(f'precision {dtype} residual stream {stream}: activations kept '
          f'{row["kept_activation_bytes"] / 2**20:.1f} MiB, gradient error '
          f'{row["grads_relative_error"]:.2e} vs float64')
      residual_rows.append(row)
  compare.add_ratios(
      residual_rows, 'vs_compute_stream',
      ('kept_activation_bytes', 'temp_size_in_bytes', 'median_step_sec'),
      is_base=lambda r: r['residual_stream'] == 'compute',
      same_group=lambda a, b: a['dtype'] == b['dtype'])
  # float16 gradients need the loss scale: without it small ones underflow.
  loss_scale_rows = []
  if 'float16' in dtypes:
    for kind in ('none', 'dynamic'):
      variant = settings_lib.replace(
          variants.matmul_variant(settings, 'float16', settings.batch_size),
          loss_scale=dict(kind=kind))
      row = dict(dtype='float16', loss_scale=kind,
                 initial_scale=loss_scaling.LossScaler.from_config(
                     variant.loss_scale).init().scale.item(),
                 **error_vs(variant, ref, numerics_batch_size))
      log(f'precision float16 loss scale {kind}: gradient error '
          f'{row["grads_relative_error"]:.2e} vs float64')
      loss_scale_rows.append(row)
  return dict(experiment='precision', device=str(jax.devices()[0].device_kind),
              batch_size=settings.batch_size,
              numerics_batch_size=numerics_batch_size,
              reference=_REFERENCE_POLICY + ', LayerNorm float64',
              matmul=matmul_rows, residual=residual_rows,
              loss_scale=loss_scale_rows)


def _same_program(fingerprint, dtype, rows) -> Optional[dict[str, Any]]:
  """The measured row of `dtype` whose lowered program has `fingerprint`."""
  return next((r for r in rows if r['dtype'] == dtype and
               r['same_program_as'] is None and
               r['program_sha256'] == fingerprint), None)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Gradient error vs float64 per matmul precision, and the residual choice."""
  paths = []
  rows = result['matmul']
  dtypes = list(dict.fromkeys(r['dtype'] for r in rows))
  names = list(dict.fromkeys(r['matmul_precision'] for r in rows))
  by_key = {(r['dtype'], r['matmul_precision']): r for r in rows}
  path = os.path.join(out_dir, 'precision_matmul_error.png')
  charts.grouped_bar_chart(
      path, names,
      {d: [by_key[d, n]['grads_relative_error'] for n in names] for d in dtypes},
      run_plots.axis_label('grads_relative_error'),
      f'jax.default_matmul_precision on {result["device"]}',
      run_plots.axis_label('matmul_precision'))
  paths.append(path)
  rows = result['residual']
  labels = [f'{r["dtype"]}\n{r["residual_stream"]}' for r in rows]
  for name, field, scale, unit in (
      ('memory', 'kept_activation_bytes', 2**20, 'MiB'),
      ('error', 'grads_relative_error', 1, '')):
    path = os.path.join(out_dir, f'precision_residual_{name}.png')
    charts.bar_chart(path, labels, [r[field] / scale for r in rows],
                    run_plots.axis_label(field, unit),
                    f'residual stream, batch {result["batch_size"]}')
    paths.append(path)
  return paths
