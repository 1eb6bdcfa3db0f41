"""configs/vit_nvfp4.py with MXFP4 blocks instead: E2M1 values in blocks of
32 with power-of-two scales, emulated, the recipe's parts as NVFP4's.

python -m launch.train --config=configs/vit_mxfp4.py --workdir=runs/mxfp4
"""

from configs import vit_nvfp4


def get_config():
  config = vit_nvfp4.get_config()
  config.precision.low_bit.format = 'mxfp4'
  return config
