"""configs/vit_fp8.py:blocks's encoder-block Linears on 4-bit operands instead:
NVFP4 (E2M1 values in blocks of 16 with E4M3 scales under a float32 scale per tensor),
emulated, with NVIDIA's recipe (16x16 weight tiles, a random Hadamard
transform on the weight gradient's inputs, stochastically rounded
gradients; docs/fp8.md, "4-bit matmuls").

python -m launch.train --config=configs/vit_nvfp4.py --workdir=runs/nvfp4
"""

from configs import vit_fp8


def get_config():
  config = vit_fp8.get_config('blocks')
  config.precision.low_bit.format = 'nvfp4'
  return config
