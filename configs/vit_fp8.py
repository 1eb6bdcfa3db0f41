"""ViT on CIFAR-10 with fp8 matmuls in its encoder blocks (bfloat16 around them).

The encoder blocks' Linear layers (attention's four projections, the MLP's
two) run E4M3 x E4M3 forward and E5M2 gradients backward with float32 sums,
each tensor scaled by its own amax (current scaling, docs/fp8.md); the patch
embedding, attention's two batched dots and the head stay in bfloat16, as
Transformer Engine and torchao leave them. One setting away:
--config.precision.low_bit.scaling=delayed (or mx).

python -m launch.train --config=configs/vit_fp8.py --workdir=runs/fp8
"""

from configs import vit_bf16
from haiku_mp.model import fp8


def get_config():
  config = vit_bf16.get_config()
  config.precision.low_bit.modules = fp8.DEFAULT_MODULES
  config.precision.low_bit.scaling = 'current'
  return config
