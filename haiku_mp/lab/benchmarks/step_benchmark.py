"""The step benchmark: what one jitted train step costs, and how close it runs
to what the device's matmuls can do.

The step runs on a fixed synthetic batch already on the device (no input
pipeline), compile and warm-up excluded; the time is the median of the timed
steps, each waited for. Its FLOPs are XLA's count for the compiled step. The
ceiling is a large matmul in the same compute dtype and the same dot form
(`half_dot`), timed in the same process: `mfu` is the step's FLOP/s over it.

A ceiling must be one. A matmul too small to keep the device busy measures
the cost of a call (dispatch, waking threads), not the device: --quick's 64^3
ceiling ran at 3-8 GFLOP/s on a CPU that does 120 at 1024^3, a tiny step did
its 9x more FLOPs per call at 3, and the report printed an MFU of 1.55. So
the ceiling's matmul does at least one step's FLOPs per call (its side grows
to that, up to `MAX_GROWN_CEILING_SIZE`), its FLOP/s is its fastest call's (a
loaded machine only slows calls down), and an MFU above 1 is not reported as
one.
"""

import math

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.lab import compare
from haiku_mp.lab import hardware
from haiku_mp.lab import timing
from haiku_mp.lab import variants
from haiku_mp.model import half_dot
from haiku_mp.model import matmuls as matmuls_lib
from haiku_mp.vit import settings as settings_lib

# Compared as ratios to the first dtype of a run.
RATIO_FIELDS = ('step_time_s', 'images_per_sec', 'mfu', 'sys_cpu_s_per_step',
                'matmul_ceiling_flops', 'temp_bytes')
# The ceiling matmul's side grows to do one step's FLOPs up to this side: a
# 4096^3 matmul is 137 GFLOP, a second or more of a CPU, where a call's fixed
# cost is lost in the noise.
MAX_GROWN_CEILING_SIZE = 4096


def ceiling_side(flops_per_step: Optional[float], least: int) -> int:
  """The ceiling matmul's side: at least `least`, and large enough to do one
  step's FLOPs in one call (up to `MAX_GROWN_CEILING_SIZE`), so that a call's
  fixed cost weighs no more on the ceiling than on the step."""
  if not flops_per_step:
    return least
  side = math.ceil((flops_per_step / 2) ** (1 / 3))
  return max(least, min(side, MAX_GROWN_CEILING_SIZE))


def matmul_ceiling(dtype, form: str, size: int, repeats: int
                   ) -> tuple[float, list[float]]:
  """FLOP/s of the fastest of `repeats` calls of a `size`^3 matmul with
  `dtype` operands in `form`, and every call's seconds."""
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.standard_normal((size, size)), dtype)
          for _ in range(2))
  dot = jax.jit(
      lambda a, b: matmuls_lib.Matmuls(form).einsum('ij,jk->ik', a, b))
  jax.block_until_ready(dot(a, b))  # Compiles.
  times = timing.seconds(dot, (a, b), repeats)
  return 2.0 * size**3 / min(times), times


def mfu(flops_per_step: Optional[float], step_time: float, ceiling: float
        ) -> tuple[Optional[float], Optional[str]]:
  """(MFU, None), or (None, why) when it cannot be one: no FLOP count, or a
  step faster than the ceiling (then the ceiling was not one)."""
  if not flops_per_step:
    return None, 'the backend reports no FLOP count for the step'
  value = flops_per_step / step_time / ceiling
  if value > 1:
    return None, (f'the step ran at {flops_per_step / step_time / 1e9:.3g} '
                  f'GFLOP/s, above the {ceiling / 1e9:.3g} GFLOP/s of the '
                  'ceiling matmul: that is no ceiling, and no MFU')
  return value, None


def _flops(compiled) -> Optional[float]:
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # Older jax: one dict per program.
    analysis = analysis[0] if analysis else None
  flops = (analysis or {}).get('flops')
  return float(flops) if flops and flops > 0 else None


def run(settings: settings_lib.Settings, steps: int, warmup_steps: int = 1,
        ceiling_size: int = 2048, ceiling_repeats: int = 5) -> dict[str, Any]:
  """Times the train step of `settings`; one dict of the figures above."""
  step = timing.compile_train_step(settings)
  precision = step.experiment.precision
  dtype = jnp.dtype(precision.policy.compute_dtype)
  form = half_dot.form_for(precision.dot_form, dtype, jax.default_backend())
  times = timing.time_steps(step, steps, warmup_steps)
  flops = _flops(step.compiled)
  side = ceiling_side(flops, ceiling_size)
  ceiling, ceiling_times = matmul_ceiling(dtype, form, side, ceiling_repeats)
  step_time = times['median_step_sec']
  utilization, why_not = mfu(flops, step_time, ceiling)
  stats = step.stats
  private = step.experiment.privacy
  return dict(
      **hardware.describe(),
      dtype=variants.variant_name(settings),
      dot_form=form,
      policy=settings.precision.policy,
      # DP-SGD: its batch is padded to train_batch_size rows, batch_size of
      # them sampled (the expected Poisson batch; images/s counts those).
      privacy=private is not None,
      batch_size=settings.batch_size,
      train_batch_size=step.experiment.train_batch_size,
      dp_microbatch_size=private and private.microbatch_size,
      steps=steps,
      step_time_s=step_time,
      step_times_s=times['step_times_sec'],
      images_per_sec=times['images_per_sec'],
      flops_per_step=flops,
      matmul_ceiling_flops=ceiling,
      matmul_ceiling_size=side,
      matmul_ceiling_times_s=ceiling_times,
      mfu=utilization,
      mfu_note=why_not,
      compile_s=stats['compile_sec'],
      sys_cpu_s_per_step=times['sys_cpu_sec_per_step'],
      argument_bytes=stats['argument_size_in_bytes'],
      output_bytes=stats['output_size_in_bytes'],
      temp_bytes=stats['temp_size_in_bytes'],
      code_bytes=stats['generated_code_size_in_bytes'],
      device_peak_bytes=times['device_peak_bytes'])


def run_dtypes(settings: settings_lib.Settings, dtypes: Sequence[str],
               steps: int, log=lambda row: None, dp_vs_ordinary: bool = False,
               **kwargs) -> list[dict]:
  """`run` per compute dtype (float16 with dynamic loss scaling, as the
  sweep's variants), each with its ratios to the first. With
  `dp_vs_ordinary`, each dtype runs ordinary and DP-SGD (`settings.privacy`'s
  settings) steps, the DP-SGD row with its ratios to the ordinary one
  (`vs_ordinary`)."""
  privacy_variants = (False, True) if dp_vs_ordinary else (
      settings.privacy.enabled,)
  rows = []
  for dtype in dtypes:
    for private in privacy_variants:
      variant = settings_lib.replace(
          variants.variant_settings(settings, dtype, settings.batch_size),
          privacy=dict(enabled=private))
      rows.append(run(variant, steps, **kwargs))
      log(rows[-1])
  compare.add_ratios(rows, 'vs_first', RATIO_FIELDS,
                     is_base=lambda r: r is rows[0])
  if dp_vs_ordinary:
    compare.add_ratios(rows, 'vs_ordinary', RATIO_FIELDS,
                       is_base=lambda r: not r['privacy'],
                       same_group=lambda a, b: a['dtype'] == b['dtype'])
  return rows



def _name(row: dict) -> str:
  return row['dtype'] + (' DP-SGD' if row['privacy'] else '')


def ratio_lines(rows: Sequence[dict]) -> list[str]:
  """The console's comparisons of `run_dtypes`' rows, each said once: every
  dtype against the first (ordinary steps with ordinary ones), and each
  DP-SGD step against its own dtype's ordinary one."""
  lines = [f'{_name(row)} vs {_name(rows[0])}: '
           f'{row["vs_first"]["images_per_sec"]:.2f}x the images/s'
           for row in rows[1:] if row['privacy'] == rows[0]['privacy']]
  lines += [f'{_name(row)} vs ordinary {row["dtype"]}: '
            f'{row["vs_ordinary"]["images_per_sec"]:.2f}x the images/s'
            for row in rows if row['privacy'] and row.get('vs_ordinary')]
  return lines
