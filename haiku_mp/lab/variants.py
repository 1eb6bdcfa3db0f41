"""The lab's derived settings: a run's settings in another compute dtype,
batch size or layout, on one device, as a float32 reference, shrunk for a
quick report; each a `settings.replace`, checked as a parse is.

Every experiment derives its variants here, so that "bfloat16 at batch 1024"
means the same settings in the sweep, the memory lab, the report and the
advisor.
"""

from typing import Optional

import jax.numpy as jnp

from haiku_mp.model import fp4
from haiku_mp.model import fp8
from haiku_mp.model import policy_strings
from haiku_mp.update import state_layout
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.parallel import sharding

# The compute dtypes and batch sizes an experiment compares by default.
DTYPES = ('float32', 'bfloat16', 'float16')
# Variants beside the dtypes: bfloat16 compute with fp8 matmuls per scaling.
FP8_VARIANTS = tuple(fp8.VARIANT_PREFIX + s for s in fp8.SCALINGS)
# And 4-bit matmuls (emulated) in the same modules: `nvfp4`, `mxfp4`.
FP4_VARIANTS = fp4.FORMATS
BATCH_SIZES = (128, 1024, 4096)
# A variant beside the dtypes: bfloat16 compute with the whole training
# state in bfloat16 (configs/vit_pure_bf16.py's layout: no float32 master,
# stochastic rounding, bfloat16 moments).
PURE_BF16 = 'pure_bf16'
# Its params with 8-bit moments (configs/vit_pure_bf16_8bit.py).
PURE_BF16_8BIT = 'pure_bf16_8bit'


def _state(layout: state_layout.StateLayout) -> dict[str, str]:
  """The `precision` settings of a layout's state (its params are the
  policy's)."""
  return dict(param_update=layout.param_update, mu_dtype=layout.mu_dtype,
              nu_dtype=layout.nu_dtype)


def compute_dtype(settings: settings_lib.Settings) -> str:
  """The name of the settings' main compute dtype."""
  return jnp.dtype(policy_strings.parse_policy(
      settings.precision.policy, 'precision.policy').compute_dtype).name


def variant_name(settings: settings_lib.Settings) -> str:
  """The settings' variant as `in_compute_dtype` names it: its compute
  dtype, or `fp8_<scaling>` when it runs fp8 matmuls."""
  low_bit = settings.precision.low_bit
  if low_bit.modules.strip():
    if low_bit.format in FP4_VARIANTS:
      return low_bit.format
    return fp8.VARIANT_PREFIX + low_bit.scaling
  policy = policy_strings.parse_policy(settings.precision.policy,
                                      'precision.policy')
  if jnp.dtype(policy.param_dtype) == jnp.bfloat16:
    for name, layout in ((PURE_BF16, state_layout.PURE_BF16),
                         (PURE_BF16_8BIT, state_layout.PURE_BF16_8BIT)):
      if all(getattr(settings.precision, k) == v
             for k, v in _state(layout).items()):
        return name
  return compute_dtype(settings)


def in_compute_dtype(settings: settings_lib.Settings, dtype: str
                     ) -> settings_lib.Settings:
  """`settings` computing in `dtype` (params and outputs as they were)
  without fp8 matmuls; float16 gets dynamic loss scaling when the settings
  have none, as configs/vit_fp16.py does. An `FP8_VARIANTS` name
  (`fp8_delayed`) is bfloat16 compute with fp8 matmuls in the settings' fp8
  modules (`fp8.DEFAULT_MODULES` if none) at that scaling, an
  `FP4_VARIANTS` one (`nvfp4`) the same with 4-bit matmuls; `PURE_BF16` is
  bfloat16 compute and params with the state layout of
  configs/vit_pure_bf16.py."""
  scaling, low_bit = None, 'fp8'
  if dtype.startswith(fp8.VARIANT_PREFIX):
    scaling = dtype[len(fp8.VARIANT_PREFIX):]
    dtype = fp8.COMPUTE_DTYPE
  elif dtype in FP4_VARIANTS:  # 4-bit blocks scale themselves.
    scaling, low_bit, dtype = 'current', dtype, fp8.COMPUTE_DTYPE
  pure_bf16 = dtype == PURE_BF16
  if pure_bf16:
    dtype = 'bfloat16'
  precision = dict(policy=policy_strings.with_dtypes(
      settings.precision.policy, setting=f'sweep dtype {dtype!r}',
      params='bfloat16' if pure_bf16 else None, compute=dtype))
  if pure_bf16:
    precision.update(_state(state_layout.PURE_BF16))
  if scaling is None:
    precision['low_bit'] = dict(modules='')
  else:
    precision['low_bit'] = dict(
        scaling=scaling, format=low_bit,
        modules=settings.precision.low_bit.modules.strip() or fp8.DEFAULT_MODULES)
  changes = dict(precision=precision)
  if dtype == 'float16' and settings.loss_scale.kind == 'none':
    changes['loss_scale'] = dict(kind='dynamic')
  return settings_lib.replace(settings, **changes)


def with_layout(settings: settings_lib.Settings, layout: str
                ) -> settings_lib.Settings:
  """`settings` on a `strategy:BxM` layout (`sharding.parse_layout`)."""
  strategy, mesh_shape = sharding.parse_layout(layout)
  return settings_lib.replace(
      settings, parallel=dict(strategy=strategy, mesh_shape=mesh_shape))


def variant_settings(settings: settings_lib.Settings, dtype: str,
                   batch_size: int, layout: Optional[str] = None
                   ) -> settings_lib.Settings:
  """`settings` in the compute dtype (`in_compute_dtype`), batch size and
  layout (None: the settings' own) of one variant, on synthetic data."""
  settings = in_compute_dtype(settings, dtype)
  if layout is not None:
    settings = with_layout(settings, layout)
  return settings_lib.replace(settings, batch_size=batch_size,
                              eval_batch_size=batch_size,
                              data=dict(source='synthetic'))


def matmul_variant(settings: settings_lib.Settings, dtype: str,
                   batch_size: int, matmul_precision: str = '',
                   residual_stream: str = 'compute'
                   ) -> settings_lib.Settings:
  """`variant_settings` on one device with the matmul precision and residual
  stream of one variant of the precision lab."""
  return settings_lib.replace(
      variant_settings(settings, dtype, batch_size, 'single:1x1'),
      precision=dict(matmul_precision=matmul_precision,
                     residual_stream=residual_stream))


def on_one_device(settings: settings_lib.Settings) -> settings_lib.Settings:
  """`settings` on one device, without DP-SGD."""
  return settings_lib.replace(
      settings, privacy=dict(enabled=False),
      parallel=dict(strategy='single', mesh_shape=(1, 1)))


def float32_reference(settings: settings_lib.Settings
                      ) -> settings_lib.Settings:
  """`settings` computing in float32 everywhere, on one device: its params'
  dtype, optimizer and loss scale kept (its checkpoints restore), overrides
  dropped, matmuls at full float32 precision, nothing rematerialized, no
  DP-SGD."""
  return settings_lib.replace(
      on_one_device(in_compute_dtype(settings, 'float32')),
      precision=dict(overrides='', float32_layer_norm=True,
                     residual_stream='compute', matmul_precision='highest'),
      remat='none')


def for_accuracy(settings: settings_lib.Settings, dtype: str, seed: int
                 ) -> settings_lib.Settings:
  """`settings` in `dtype` (float32 with matmul precision highest, float16
  with dynamic loss scaling), on the settings' own data."""
  variant = settings_lib.replace(in_compute_dtype(settings, dtype), seed=seed)
  if dtype == 'float32':
    variant = settings_lib.replace(
        variant, precision=dict(matmul_precision='highest'))
  return variant


def without_dropout(settings: settings_lib.Settings
                    ) -> settings_lib.Settings:
  """`settings` without dropout: the same function in every variant, for
  comparing their numbers."""
  return settings_lib.replace(settings, model=dict(dropout_rate=0.0))


def shrunk(settings: settings_lib.Settings, model: dict, steps: int,
           batch_size: int, synthetic_examples: int
           ) -> settings_lib.Settings:
  """`settings` with the `model` settings, `steps` training steps (each a
  log, eval and checkpoint point), batch `batch_size` and
  `synthetic_examples` per synthetic split: a report's quick run."""
  return settings_lib.replace(
      settings, model=model, num_train_steps=steps, log_every_steps=steps,
      eval_every_steps=steps, checkpoint_every_steps=steps,
      batch_size=batch_size, eval_batch_size=batch_size,
      data=dict(synthetic_train_examples=synthetic_examples,
                synthetic_eval_examples=synthetic_examples))
