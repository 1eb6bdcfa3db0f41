"""Rematerialization: what the backward pass keeps and what it recomputes.

`config.remat` chooses, per encoder block (`jax.checkpoint` through
`hk.remat`, so Haiku's params, state and rng keys are threaded as usual):

- ``none``: keep every residual JAX's autodiff wants (the fastest step; the
  GELU alone keeps several copies of the MLP's widest activation);
- ``dots``: keep only the outputs of the weight matmuls (every `Linear` and
  the patch embedding, tagged `MATMUL_OUTPUT`) and the block's input;
  recompute the rest: LayerNorms, GELU, dropout masks (the same keys, so the
  same masks) and attention's batched matmuls and softmax, which are cheap
  at these sequence lengths and whose float32 logits would otherwise keep
  float32 bytes under every policy;
- ``full``: keep only each block's input; recompute the whole block.

Every kept tensor is then in the compute dtype, so a half-precision policy
keeps about half the float32 bytes (see the lab's memory experiment).
"""

from typing import Callable

import haiku as hk
import jax
from jax.ad_checkpoint import checkpoint_name

from haiku_mp import errors

CHOICES = ('none', 'dots', 'full')
MATMUL_OUTPUT = 'matmul_output'

_POLICIES = {
    'dots': jax.checkpoint_policies.save_only_these_names(MATMUL_OUTPUT),
    'full': jax.checkpoint_policies.nothing_saveable,
}


def check(remat: str) -> str:
  errors.check_choice('remat', remat, CHOICES)
  return remat


def tag_matmul_output(x: jax.Array) -> jax.Array:
  """Marks `x` as a weight matmul's output (kept under ``dots``); an
  identity otherwise."""
  return checkpoint_name(x, MATMUL_OUTPUT)


def wrap(block: Callable, remat: str, static_argnums=()) -> Callable:
  """`block` (a Haiku module or function) with `remat` applied."""
  if check(remat) == 'none':
    return block
  return hk.remat(block, policy=_POLICIES[remat],
                  static_argnums=static_argnums)
