"""configs/vit_pure_bf16.py's bfloat16 params with Adam's moments in 8 bits:
float8 codes and a float32 scale per block of 256, rounded stochastically
(haiku_mp/update/block_moments.py): about 4 bytes per parameter against
float32's 12 and `:pure_bf16`'s 6.

python -m launch.train --config=configs/vit_pure_bf16_8bit.py --workdir=runs/pure_bf16_8bit
"""

from configs import vit_pure_bf16


def get_config():
  config = vit_pure_bf16.get_config()
  config.precision.mu_dtype = 'float8_blocks'
  config.precision.nu_dtype = 'float8_blocks'
  return config
