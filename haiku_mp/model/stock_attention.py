"""Haiku's own `hk.MultiHeadAttention`, safe in half precision.

Haiku computes the attention logits, the mask and the softmax in the
operands' dtype. Under a float16 policy its mask value, -1e30, is -inf, so a
query whose keys are all masked (a padding token's row) gets a softmax of
NaN, every step; and a logit above 11 overflows float16's `exp`. Under
`apply_precision`, a stock `hk.MultiHeadAttention` whose inputs are half
precision therefore runs this call instead: Haiku's code, step for step, with
the logits summed in float32 (`Matmuls.einsum`), masked and softmaxed in float32
(Flax and PyTorch's AMP do the same), and the weights rounded once to the
values' dtype for the second matmul. Its projections are Haiku's `hk.Linear`
calls (the same params), so they run as `apply_precision` says.
Float32 inputs take Haiku's own call: a float32 program is unchanged.
"""

from typing import Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.model.matmuls import Matmuls

# Haiku's mask value, now in float32 (where it is finite).
MASKED_LOGIT = -1e30


def multi_head_attention(module: hk.MultiHeadAttention, matmuls: Matmuls,
                         plain: Callable[..., jax.Array], query: jax.Array,
                         key: jax.Array, value: jax.Array,
                         mask: Optional[jax.Array] = None) -> jax.Array:
  """`module`'s call: Haiku's own (`plain`) for float32 inputs; for half
  ones the same steps with float32 logits and softmax."""
  if jnp.finfo(query.dtype).bits >= 32:
    return plain(query, key, value, mask)
  *leading_dims, sequence_length, _ = query.shape
  projection = module._linear_projection  # pylint: disable=protected-access
  query_heads = projection(query, module.key_size, 'query')
  key_heads = projection(key, module.key_size, 'key')
  value_heads = projection(value, module.value_size, 'value')
  logits = matmuls.einsum('...thd,...Thd->...htT', query_heads, key_heads,
                       out_dtype=jnp.float32)
  logits = logits / np.sqrt(module.key_size).astype(np.float32)
  if mask is not None:
    if mask.ndim != logits.ndim:  # Haiku's own check and message.
      raise ValueError(f'Mask dimensionality {mask.ndim} must match logits '
                       f'dimensionality {logits.ndim}.')
    logits = jnp.where(mask, logits, MASKED_LOGIT)
  weights = jax.nn.softmax(logits).astype(value_heads.dtype)
  attn = matmuls.einsum('...htT,...Thd->...thd', weights, value_heads)
  attn = jnp.reshape(attn, (*leading_dims, sequence_length, -1))
  final_projection = hk.Linear(module.model_size, w_init=module.w_init,
                               with_bias=module.with_bias,
                               b_init=module.b_init)
  return final_projection(attn)
