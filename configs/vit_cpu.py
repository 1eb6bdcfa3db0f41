"""A CPU-sized ViT (embed 128, 4 layers, patch 4) for real runs on a few cores.

The argument after the colon picks the precision variant (fp32, bf16, fp16):

python -m launch.train --config=configs/vit_cpu.py:fp16 --workdir=runs/cpu_fp16
"""

import importlib

from haiku_mp import errors


def get_config(precision: str = 'fp32'):
  variants = ('fp32', 'bf16', 'fp16')
  if precision not in variants:
    # The command line prefixes --config=PATH:VARIANT.
    raise errors.ConfigError(f'unknown variant {precision!r}; expected one of '
                             f'{variants}')
  config = importlib.import_module(f'configs.vit_{precision}').get_config()
  config.model.update(dict(embed_dim=128, mlp_dim=256, num_heads=4,
                           num_layers=4))
  config.num_epochs = 5
  config.warmup_steps = 200
  config.log_every_steps = 50
  config.eval_every_steps = 351  # Once per epoch of 45,000 / 128 steps.
  return config
