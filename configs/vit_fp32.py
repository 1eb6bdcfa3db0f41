"""ViT on CIFAR-10 in float32 (no loss scaling).

python -m launch.train --config=configs/vit_fp32.py --workdir=runs/fp32
"""

from configs import base


def get_config():
  return base.get_config()
