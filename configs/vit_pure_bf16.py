"""ViT on CIFAR-10 with its whole training state in bfloat16: bfloat16 compute
and params, no float32 master copy (each update rounded stochastically into
the params), and Adam's moments in bfloat16 (docs/precision.md, "Training-
state layouts"): 6 bytes per parameter against float32's 12.

python -m launch.train --config=configs/vit_pure_bf16.py --workdir=runs/pure_bf16
"""

from configs import vit_bf16


def get_config():
  config = vit_bf16.get_config()
  config.precision.policy = 'params=bfloat16,compute=bfloat16,output=float32'
  config.precision.param_update = 'stochastic'
  config.precision.mu_dtype = 'bfloat16'
  config.precision.nu_dtype = 'bfloat16'
  return config
