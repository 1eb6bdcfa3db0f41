"""The lab's derived configs: a config in another compute dtype, batch size
or layout, on one device, as a float32 reference, shrunk for a quick report.

Every experiment derives its variants here, so that "bfloat16 at batch 1024"
means the same config in the sweep, the memory lab, the report and the
advisor.
"""

import copy
from typing import Optional

import jax.numpy as jnp
import ml_collections

from haiku_mp.model import fp4
from haiku_mp.model import fp8
from haiku_mp.model import policies
from haiku_mp.update import optimizer as optimizer_lib
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


def _state(layout: optimizer_lib.StateLayout) -> dict[str, str]:
  """The `precision` settings of a layout's state (its params are the
  policy's)."""
  return dict(param_update=layout.param_update, mu_dtype=layout.mu_dtype,
              nu_dtype=layout.nu_dtype)


def compute_dtype(config: ml_collections.ConfigDict) -> str:
  """The name of the config's main compute dtype."""
  return jnp.dtype(policies.parse_policy(
      config.precision.policy).compute_dtype).name


def variant_name(config: ml_collections.ConfigDict) -> str:
  """The config's variant as `in_compute_dtype` names it: its compute dtype,
  or `fp8_<scaling>` when it runs fp8 matmuls."""
  if config.precision.fp8.modules.strip():
    if config.precision.fp8.format in FP4_VARIANTS:
      return config.precision.fp8.format
    return fp8.VARIANT_PREFIX + config.precision.fp8.scaling
  policy = policies.parse_policy(config.precision.policy)
  if jnp.dtype(policy.param_dtype) == jnp.bfloat16:
    for name, layout in ((PURE_BF16, optimizer_lib.PURE_BF16),
                         (PURE_BF16_8BIT, optimizer_lib.PURE_BF16_8BIT)):
      if all(config.precision[k] == v for k, v in _state(layout).items()):
        return name
  return compute_dtype(config)


def in_compute_dtype(config: ml_collections.ConfigDict, dtype: str
                     ) -> ml_collections.ConfigDict:
  """A copy of `config` computing in `dtype` (params and outputs as they
  were) without fp8 matmuls; float16 gets dynamic loss scaling when the
  config has none, as configs/vit_fp16.py does. An `FP8_VARIANTS` name
  (`fp8_delayed`) is bfloat16 compute with fp8 matmuls in the config's fp8
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
  text = policies.with_dtypes(config.precision.policy,
                              setting=f'sweep dtype {dtype!r}',
                              params='bfloat16' if pure_bf16 else None,
                              compute=dtype)
  config = copy.deepcopy(config)
  config.precision.policy = text
  if pure_bf16:
    config.precision.update(_state(optimizer_lib.PURE_BF16))
  if scaling is None:
    config.precision.fp8.modules = ''
  else:
    config.precision.fp8.scaling = scaling
    config.precision.fp8.format = low_bit
    config.precision.fp8.modules = (config.precision.fp8.modules.strip() or
                                    fp8.DEFAULT_MODULES)
  if dtype == 'float16' and config.loss_scale.kind == 'none':
    config.loss_scale.kind = 'dynamic'
  return config


def variant_config(config: ml_collections.ConfigDict, dtype: str,
                   batch_size: int, layout: Optional[str] = None
                   ) -> ml_collections.ConfigDict:
  """`config` in the compute dtype (`in_compute_dtype`), batch size and
  layout (None: the config's own) of one variant, on synthetic data."""
  config = in_compute_dtype(config, dtype)
  if layout is not None:
    strategy, mesh_shape = sharding.parse_layout(layout)
    config.parallel.strategy = strategy
    config.parallel.mesh_shape = mesh_shape
  config.batch_size = config.eval_batch_size = batch_size
  config.data.source = 'synthetic'
  return config


def matmul_variant(config: ml_collections.ConfigDict, dtype: str,
                   batch_size: int, matmul_precision: str = '',
                   residual_stream: str = 'compute'
                   ) -> ml_collections.ConfigDict:
  """`variant_config` on one device with the matmul precision and residual
  stream of one variant of the precision lab."""
  config = variant_config(config, dtype, batch_size, 'single:1x1')
  config.precision.matmul_precision = matmul_precision
  config.precision.residual_stream = residual_stream
  return config


def on_one_device(config: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """A copy of `config` on one device, without DP-SGD."""
  config = copy.deepcopy(config)
  config.privacy.enabled = False
  config.parallel.strategy = 'single'
  config.parallel.mesh_shape = (1, 1)
  return config


def float32_reference(config: ml_collections.ConfigDict
                      ) -> ml_collections.ConfigDict:
  """`config` computing in float32 everywhere, on one device: its params'
  dtype, optimizer and loss scale kept (its checkpoints restore), overrides
  dropped, matmuls at full float32 precision, nothing rematerialized, no
  DP-SGD."""
  config = on_one_device(in_compute_dtype(config, 'float32'))
  config.precision.overrides = ''
  config.precision.float32_layer_norm = True
  config.precision.residual_stream = 'compute'
  config.precision.matmul_precision = 'highest'
  config.remat = 'none'
  return config


def for_accuracy(config: ml_collections.ConfigDict, dtype: str, seed: int
                 ) -> ml_collections.ConfigDict:
  """`config` in `dtype` (float32 with matmul precision highest, float16
  with dynamic loss scaling), on the config's own data."""
  variant = in_compute_dtype(config, dtype)
  variant.seed = seed
  if dtype == 'float32':
    variant.precision.matmul_precision = 'highest'
  return variant


def without_dropout(config: ml_collections.ConfigDict
                    ) -> ml_collections.ConfigDict:
  """A copy of `config` without dropout: the same function in every
  variant, for comparing their numbers."""
  config = copy.deepcopy(config)
  config.model.dropout_rate = 0.0
  return config


def shrunk(config: ml_collections.ConfigDict, model: dict, steps: int,
           batch_size: int, synthetic_examples: int
           ) -> ml_collections.ConfigDict:
  """`config` with the `model` settings, `steps` training steps (each a log,
  eval and checkpoint point), batch `batch_size` and `synthetic_examples`
  per synthetic split: a report's quick run."""
  config = copy.deepcopy(config)
  config.model.update(model)
  config.num_train_steps = steps
  config.log_every_steps = config.eval_every_steps = steps
  config.checkpoint_every_steps = steps
  config.batch_size = config.eval_batch_size = batch_size
  config.data.synthetic_train_examples = synthetic_examples
  config.data.synthetic_eval_examples = synthetic_examples
  return config
