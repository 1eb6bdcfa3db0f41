"""ViT on CIFAR-10 computing in float16 with dynamic loss scaling from 2**15.

python -m launch.train --config=configs/vit_fp16.py --workdir=runs/fp16
"""

from configs import base


def get_config():
  config = base.get_config()
  config.precision.policy = 'params=float32,compute=float16,output=float32'
  config.loss_scale.kind = 'dynamic'
  config.loss_scale.initial = 2.0**15
  return config
