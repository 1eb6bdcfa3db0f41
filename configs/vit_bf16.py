"""ViT on CIFAR-10 computing in bfloat16 (float32 params and logits, no loss scaling).

python -m launch.train --config=configs/vit_bf16.py --workdir=runs/bf16
"""

from configs import base


def get_config():
  config = base.get_config()
  config.precision.policy = 'params=float32,compute=bfloat16,output=float32'
  return config
