"""Mixup and CutMix inside the step, with the soft labels they make.

Each example is mixed with its neighbour in the batch (0 with 1, 2 with 3,
...): a device's batch is a block of whole pairs whatever the strategy, so
single, pmap and pjit mix the same images, and nothing crosses devices. Every
example draws its own choice (mixup or CutMix), mixing ratio and box from its
own key (timm's per-element mode), so a pair's two examples differ. dm-pix
has neither, hence this module.
"""

from typing import Optional

import jax
import jax.numpy as jnp


def partners(x: jax.Array) -> jax.Array:
  """`x` with each pair of neighbours along the batch axis swapped."""
  pairs = x.reshape(x.shape[0] // 2, 2, *x.shape[1:])
  return pairs[:, ::-1].reshape(x.shape)


def _box(key: jax.Array, keep: jax.Array, height: int, width: int
         ) -> tuple[jax.Array, jax.Array]:
  """CutMix's box (a boolean [H, W] mask) covering about 1 - `keep` of the
  image, centered at a uniform pixel and clipped to the image; and the share
  of the image it leaves (the label's weight)."""
  k_y, k_x = jax.random.split(key)
  side = jnp.sqrt(1.0 - keep)
  box_h = jnp.round(height * side)
  box_w = jnp.round(width * side)
  cy = jax.random.randint(k_y, (), 0, height)
  cx = jax.random.randint(k_x, (), 0, width)
  top = jnp.clip(cy - box_h // 2, 0, height)
  bottom = jnp.clip(cy + box_h // 2, 0, height)
  left = jnp.clip(cx - box_w // 2, 0, width)
  right = jnp.clip(cx + box_w // 2, 0, width)
  rows = jnp.arange(height)[:, None]
  cols = jnp.arange(width)[None, :]
  inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
  return inside, 1.0 - (bottom - top) * (right - left) / (height * width)


def mix(keys: jax.Array, images: jax.Array, labels: jax.Array,
        num_classes: int, mixup_alpha: float, cutmix_alpha: float,
        probability: float = 1.0, active: Optional[jax.Array] = None
        ) -> tuple[jax.Array, jax.Array]:
  """(images mixed with their partners, float32 soft labels [B, classes]).

  With both alphas positive each example takes mixup or CutMix with even
  odds; an alpha of 0 turns its method off. The ratio is Beta(alpha, alpha);
  CutMix's label weight is the share of the image its box really leaves.
  Each example is mixed with `probability` (timm's `mix_prob`, per element),
  else kept whole with its own label; below 1 it is drawn from a key of its
  own, so a probability of 1 draws what it always drew. `active`, a boolean
  scalar (traced or not), turns mixing off for the whole batch when false:
  the examples are kept whole, the targets one-hot.
  """
  batch, height, width = images.shape[:3]

  def draw(key):
    k_choice, k_mixup, k_cutmix, k_box = jax.random.split(key, 4)
    if mixup_alpha > 0 and cutmix_alpha > 0:
      cut = jax.random.bernoulli(k_choice)
    else:
      cut = jnp.asarray(cutmix_alpha > 0)
    keep_mixup = (jax.random.beta(k_mixup, mixup_alpha, mixup_alpha)
                  if mixup_alpha > 0 else jnp.float32(1.0))
    keep_cut = (jax.random.beta(k_cutmix, cutmix_alpha, cutmix_alpha)
                if cutmix_alpha > 0 else jnp.float32(1.0))
    inside, keep_box = _box(k_box, keep_cut, height, width)
    mask = jnp.where(cut, inside, False)
    keep = jnp.where(cut, keep_box, keep_mixup)
    pixel_keep = jnp.where(cut, 1.0, keep_mixup)
    if probability < 1 or active is not None:
      on = (jax.random.bernoulli(jax.random.fold_in(key, 1), probability)
            if probability < 1 else jnp.asarray(True))
      if active is not None:
        on = on & active
      mask = mask & on
      keep = jnp.where(on, keep, 1.0)
      pixel_keep = jnp.where(on, pixel_keep, 1.0)
    return mask, keep, pixel_keep

  mask, keep, pixel_keep = jax.vmap(draw)(keys)
  other = partners(images)
  shape = (batch, 1, 1, 1)
  mixed = (pixel_keep.reshape(shape) * images +
           (1.0 - pixel_keep.reshape(shape)) * other)
  mixed = jnp.where(mask[..., None], other, mixed).astype(images.dtype)
  one_hot = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
  keep = keep[:, None].astype(jnp.float32)
  return mixed, keep * one_hot + (1.0 - keep) * partners(one_hot)
