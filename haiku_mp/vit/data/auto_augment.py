"""RandAugment and AutoAugment's CIFAR-10 policy, per image, inside the step.

Both pick operations of `image_ops` at a *level* in [0, 10] (RandAugment's
magnitude scale), mapped to each operation's parameter as below; an operation
with a direction (rotate, shear, translate, the enhancements) takes a random
sign. Every choice is drawn from the image's own key, so under `vmap` each
image of a batch takes its own operations, and a batch split over devices is
augmented as it would be whole.

Under `vmap` a `lax.switch` over operations computes every branch and selects
one per image, so the geometric operations share one resampling (a matrix
chosen per image) and each pixel-value operation runs once per layer.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from haiku_mp.vit.data import image_ops
from haiku_mp.vit.settings import dataset as data_settings

MAX_LEVEL = data_settings.MAX_MAGNITUDE
# Parameters at MAX_LEVEL: rotation degrees, shear, translation as a share of
# the image's side (10 pixels of 32: AutoAugment's CIFAR-10 range),
# enhancement factor away from 1, and bits posterize takes away.
_MAX_DEGREES = 30.0
_MAX_SHEAR = 0.3
_MAX_TRANSLATE = 10.0 / 32.0
_MAX_ENHANCE = 0.9
_MAX_POSTERIZE_BITS = 4.0


def _affine_coefficients(op: jax.Array, amount: jax.Array, height: int,
                         width: int) -> jax.Array:
  """PIL's (a, b, c, d, e, f) for a geometric op at `amount` (signed, in
  [-1, 1] of its range); the identity for any other op."""
  shear = amount * _MAX_SHEAR
  shift_x = jnp.round(amount * _MAX_TRANSLATE * width)
  shift_y = jnp.round(amount * _MAX_TRANSLATE * height)
  identity = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
  table = dict(
      rotate=jnp.stack(image_ops.rotation(amount * _MAX_DEGREES, height,
                                          width)),
      shear_x=jnp.stack([1.0, shear, 0.0, 0.0, 1.0, 0.0]),
      shear_y=jnp.stack([1.0, 0.0, 0.0, shear, 1.0, 0.0]),
      translate_x=jnp.stack([1.0, 0.0, shift_x, 0.0, 1.0, 0.0]),
      translate_y=jnp.stack([1.0, 0.0, 0.0, 0.0, 1.0, shift_y]))
  rows = jnp.stack([table.get(name, identity)
                    for name in data_settings.AUGMENT_OPS])
  return rows[op]


def apply_op(image: jax.Array, op: jax.Array, level: jax.Array,
             sign: jax.Array) -> jax.Array:
  """`data_settings.AUGMENT_OPS[op]` at `level` in [0, MAX_LEVEL], its
  direction `sign` (+-1)."""
  height, width = image.shape[:2]
  fraction = level / MAX_LEVEL
  geometric = image_ops.affine(
      image, *_affine_coefficients(op, sign * fraction, height, width))
  factor = 1.0 + sign * fraction * _MAX_ENHANCE
  pixel_ops = dict(
      autocontrast=lambda: image_ops.autocontrast(image),
      equalize=lambda: image_ops.equalize(image),
      solarize=lambda: image_ops.solarize(image, 256.0 * (1.0 - fraction)),
      color=lambda: image_ops.color(image, factor),
      posterize=lambda: image_ops.posterize(
          image, 8.0 - jnp.round(fraction * _MAX_POSTERIZE_BITS)),
      contrast=lambda: image_ops.contrast(image, factor),
      brightness=lambda: image_ops.brightness(image, factor),
      sharpness=lambda: image_ops.sharpness(image, factor),
      invert=lambda: image_ops.invert(image))
  out = geometric
  for name, fn in pixel_ops.items():
    out = jnp.where(op == data_settings.AUGMENT_OPS.index(name), fn(), out)
  return out


def _sign(key: jax.Array) -> jax.Array:
  return jnp.where(jax.random.bernoulli(key), 1.0, -1.0)


def randaugment(key: jax.Array, image: jax.Array, num_ops: int,
                magnitude: float) -> jax.Array:
  """RandAugment (Cubuk et al., 2019): `num_ops` operations drawn uniformly
  from `data_settings.RANDAUGMENT_OPS` (identity included), each at
  `magnitude`."""
  image = jnp.round(image)
  for layer_key in jax.random.split(key, num_ops):
    k_op, k_sign = jax.random.split(layer_key)
    op = jax.random.randint(k_op, (), 0, len(data_settings.RANDAUGMENT_OPS))
    image = apply_op(image, op, jnp.float32(magnitude), _sign(k_sign))
  return image


class SubPolicy(NamedTuple):
  """Two (operation, probability, level) steps, applied in order."""
  first: tuple[str, float, float]
  second: tuple[str, float, float]


# AutoAugment's policy found on reduced CIFAR-10 (Cubuk et al., 2018,
# appendix), levels on its 0-9 scale; levels of operations without one are 0.
CIFAR10_POLICY = (
    SubPolicy(('invert', 0.1, 0), ('contrast', 0.2, 6)),
    SubPolicy(('rotate', 0.7, 2), ('translate_x', 0.3, 9)),
    SubPolicy(('sharpness', 0.8, 1), ('sharpness', 0.9, 3)),
    SubPolicy(('shear_y', 0.5, 8), ('translate_y', 0.7, 9)),
    SubPolicy(('autocontrast', 0.5, 0), ('equalize', 0.9, 0)),
    SubPolicy(('shear_y', 0.2, 7), ('posterize', 0.3, 7)),
    SubPolicy(('color', 0.4, 3), ('brightness', 0.6, 7)),
    SubPolicy(('sharpness', 0.3, 9), ('brightness', 0.7, 9)),
    SubPolicy(('equalize', 0.6, 0), ('equalize', 0.5, 0)),
    SubPolicy(('contrast', 0.6, 7), ('sharpness', 0.6, 5)),
    SubPolicy(('color', 0.7, 7), ('translate_x', 0.5, 8)),
    SubPolicy(('equalize', 0.3, 0), ('autocontrast', 0.4, 0)),
    SubPolicy(('translate_y', 0.4, 3), ('sharpness', 0.2, 6)),
    SubPolicy(('brightness', 0.9, 6), ('color', 0.2, 8)),
    SubPolicy(('solarize', 0.5, 2), ('invert', 0.0, 0)),
    SubPolicy(('equalize', 0.2, 0), ('autocontrast', 0.6, 0)),
    SubPolicy(('equalize', 0.2, 0), ('equalize', 0.6, 0)),
    SubPolicy(('color', 0.9, 9), ('equalize', 0.6, 0)),
    SubPolicy(('autocontrast', 0.8, 0), ('solarize', 0.2, 8)),
    SubPolicy(('brightness', 0.1, 3), ('color', 0.7, 0)),
    SubPolicy(('solarize', 0.4, 5), ('autocontrast', 0.9, 0)),
    SubPolicy(('translate_y', 0.9, 9), ('translate_y', 0.7, 9)),
    SubPolicy(('autocontrast', 0.9, 0), ('solarize', 0.2, 3)),
    SubPolicy(('equalize', 0.8, 0), ('invert', 0.1, 0)),
    SubPolicy(('translate_y', 0.7, 9), ('autocontrast', 0.9, 0)),
)


def autoaugment(key: jax.Array, image: jax.Array,
                policy: tuple[SubPolicy, ...] = CIFAR10_POLICY) -> jax.Array:
  """One sub-policy of `policy` drawn uniformly; each of its two steps
  applied with its probability."""
  image = jnp.round(image)
  steps = [(data_settings.AUGMENT_OPS.index(name), prob, level)
           for sub in policy for name, prob, level in sub]
  op, prob, level = (jnp.asarray(column).reshape(len(policy), 2)
                     for column in zip(*steps))
  k_pick, *k_steps = jax.random.split(key, 3)
  pick = jax.random.randint(k_pick, (), 0, len(policy))
  for i, step_key in enumerate(k_steps):
    k_apply, k_sign = jax.random.split(step_key)
    applied = apply_op(image, op[pick, i], level[pick, i].astype(jnp.float32),
                       _sign(k_sign))
    image = jnp.where(jax.random.bernoulli(k_apply, prob[pick, i]), applied,
                      image)
  return image
