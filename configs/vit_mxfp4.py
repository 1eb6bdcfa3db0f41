"""configs/vit_fp8.py's encoder-block Linears on 4-bit operands instead:
MXFP4 (E2M1 values in blocks of 32 with power-of-two scales),
emulated, with NVIDIA's recipe (16x16 weight tiles, a random Hadamard
transform on the weight gradient's inputs, stochastically rounded
gradients; docs/fp8.md, "4-bit matmuls").

python -m launch.train --config=configs/vit_mxfp4.py --workdir=runs/mxfp4
"""

from configs import vit_fp8


def get_config():
  config = vit_fp8.get_config()
  config.precision.fp8.format = 'mxfp4'
  return config
