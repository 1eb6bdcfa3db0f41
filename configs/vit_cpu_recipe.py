"""The recipe at the CPU-sized ViT's budget: 10 epochs on 2 cores.

What helps a 0.55M-param ViT in 10 epochs is not what helps the reference
ViT in 200: it underfits, so the regularizers (dropout, stochastic depth,
mixing, erasing) are off and the augmentation is mild. BENCHMARKS.md has
the settings tried and the runs.

python -m launch.train --config=configs/vit_cpu_recipe.py:bf16 --workdir=runs/cpu_recipe_bf16
"""

from configs import vit_cpu
from configs import vit_recipe

EPOCHS = 10


def get_config(precision: str = 'bf16'):
  config = vit_cpu.cpu_sized(vit_recipe.get_config(precision))
  config.num_epochs = EPOCHS
  config.batch_size = 128
  config.warmup_steps = 351  # One epoch.
  config.checkpoint_every_steps = 1000
  config.model.drop_path_rate = 0.0
  data = config.data
  data.policy = 'randaugment'
  data.randaugment_ops = 1
  data.randaugment_magnitude = 5.0
  data.erasing_probability = 0.0
  data.mixup_alpha = 0.0
  data.cutmix_alpha = 0.0
  return config
