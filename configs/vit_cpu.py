"""A CPU-sized ViT (embed 128, 4 layers, patch 4) for real runs on a few cores.

The argument after the colon picks the precision variant (fp32, bf16, fp16,
fp8, nvfp4, mxfp4, pure_bf16, pure_bf16_8bit):

python -m launch.train --config=configs/vit_cpu.py:fp16 --workdir=runs/cpu_fp16
"""

import importlib

import ml_collections

from haiku_mp import errors

VARIANTS = ('fp32', 'bf16', 'fp16', 'fp8', 'nvfp4', 'mxfp4', 'pure_bf16',
            'pure_bf16_8bit')
# A variant's own argument: the fp8 runs built on these measure fp8's
# accuracy in every encoder block's Linears, not only where it pays.
_ARGUMENTS = {'fp8': ('blocks',)}


def variant(module: str, precision: str) -> ml_collections.ConfigDict:
  """`configs/{module}_{precision}.py`'s config, the variant checked (the
  command line prefixes --config=PATH:VARIANT)."""
  if precision not in VARIANTS:
    raise errors.ConfigError(f'unknown variant {precision!r}; expected one of '
                             f'{VARIANTS}')
  return importlib.import_module(f'configs.{module}_{precision}').get_config(
      *_ARGUMENTS.get(precision, ()))


def cpu_sized(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` with the CPU-sized model: 0.55M params, ~0.8 s a step of 128
  images on 2 cores."""
  config.model.update(dict(embed_dim=128, mlp_dim=256, num_heads=4,
                           num_layers=4))
  config.log_every_steps = 50
  config.eval_every_steps = 351  # Once per epoch of 45,000 / 128 steps.
  return config


def get_config(precision: str = 'fp32'):
  config = cpu_sized(variant('vit', precision))
  config.num_epochs = 5
  config.warmup_steps = 200
  return config
