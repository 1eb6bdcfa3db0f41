"""The optax optimizer from config: AdamW with warmup + cosine decay and clipping.

It always runs on float32 master params and float32 (unscaled) gradients.
"""

import jax
import ml_collections
import optax


def learning_rate_schedule(config: ml_collections.ConfigDict,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then cosine decay to 0 at `total_steps`."""
  warmup = max(int(config.warmup_steps), 0)
  if not warmup:
    return optax.cosine_decay_schedule(config.learning_rate,
                                       max(total_steps, 1))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1))


def _decay_mask(params):
  """Weight decay on matrices and kernels only, not on biases or LayerNorm."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(config: ml_collections.ConfigDict,
                   total_steps: int) -> optax.GradientTransformation:
  """Clipping by global norm (if `grad_clip_norm` > 0), then AdamW."""
  adamw = optax.adamw(learning_rate_schedule(config, total_steps),
                      weight_decay=config.weight_decay, mask=_decay_mask)
  if config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw)
  return adamw
