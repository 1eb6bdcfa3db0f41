"""ViT on CIFAR-10 with fp8 matmuls where they pay (bfloat16 around them).

By default the encoder blocks' Linear layers run fp8 (E4M3 forward, E5M2
gradients, float32 sums, each tensor scaled by its own amax: current
scaling, docs/fp8.md) where the speed model predicts them faster on an H100
at the run's batch, casts and all (`precision.low_bit.modules=auto`,
docs/speed.md); the run's first lines name each Linear's choice and its
predicted gain. The reference ViT's Linears are too small for fp8 to pay at
batch 128, so there this config runs them all in bfloat16, and says so.

The argument after the colon is the placement: 'auto' (the default) or
'blocks', every encoder block's Linears in fp8 whatever it costs (what the
accuracy runs and the per-matmul proof of fp8 GEMMs measure). The patch
embedding, attention's two batched dots and the head stay in bfloat16, as
Transformer Engine and torchao leave them. One setting away:
--config.precision.low_bit.scaling=delayed (or mx), or another GPU with
--config.precision.low_bit.gpu=h200.

python -m launch.train --config=configs/vit_fp8.py --workdir=runs/fp8
python -m launch.train --config=configs/vit_fp8.py:blocks --workdir=runs/fp8_blocks
"""

from configs import vit_bf16
from haiku_mp import errors
from haiku_mp.model import fp8

PLACEMENTS = ('auto', 'blocks')
# The GPU whose predicted times choose the Linears under 'auto'.
GPU = 'h100'


def get_config(placement: str = 'auto'):
  errors.check_choice('configs/vit_fp8.py:PLACEMENT', placement, PLACEMENTS)
  config = vit_bf16.get_config()
  config.precision.low_bit.scaling = 'current'
  if placement == 'auto':
    config.precision.low_bit.modules = 'auto'
    config.precision.low_bit.gpu = GPU
  else:
    config.precision.low_bit.modules = fp8.DEFAULT_MODULES
  return config
