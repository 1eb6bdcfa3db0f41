"""The training recipe for the reference ViT: 200 epochs toward 90% on CIFAR-10.

The seeds' configs (vit_fp32/bf16/fp16.py) keep the seeds' settings; this
one turns on what trains a ViT from scratch on a small dataset well: pad-and-
crop + flip, AutoAugment's CIFAR-10 policy, random erasing, mixup / CutMix,
label smoothing, AdamW whose decay skips biases, LayerNorm, the cls token and
the position embedding, warmup + cosine, clipping, stochastic depth, and a
moving average of the params evaluated beside them. The
argument after the colon picks the precision; float32 here means float32
matmuls (matmul_precision 'highest'), so a GPU's TF32 is not called float32.

python -m launch.train --config=configs/vit_recipe.py:bf16 --workdir=runs/recipe_bf16
"""

from configs import vit_cpu

EPOCHS = 200


def get_config(precision: str = 'bf16'):
  config = vit_cpu.variant('vit', precision)
  if precision == 'fp32':
    config.precision.matmul_precision = 'highest'
  config.num_epochs = EPOCHS
  config.batch_size = 512
  steps_per_epoch = 45000 // config.batch_size  # base.py's train split.
  config.learning_rate = 1e-3
  config.weight_decay = 0.05
  config.warmup_steps = 5 * steps_per_epoch
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.1
  config.ema_decay = 0.9998  # A time constant of about 60 of 200 epochs.
  config.log_every_steps = 100
  config.eval_every_steps = 10 * steps_per_epoch
  config.checkpoint_every_steps = 10 * steps_per_epoch
  config.model.dropout_rate = 0.0
  config.model.drop_path_rate = 0.1
  data = config.data
  data.crop = 'pad'
  data.policy = 'autoaugment'
  data.erasing_probability = 0.25
  data.mixup_alpha = 0.8
  data.cutmix_alpha = 1.0
  return config
