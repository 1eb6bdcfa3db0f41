"""CIFAR-10 augmentation on the device, in JAX, from uint8 images.

The seeds' augmentation: a random crop of `crop_area` of the image's area
with aspect ratio in `crop_aspect_ratio`, resized back to the image's size
bilinearly, and a random horizontal flip; then per-channel normalization.
Keyed by a JAX key (the step's), so a batch is a function of (seed, step),
and traceable, so it runs inside the jitted program: only uint8 images cross
from the host. Evaluation images are only normalized.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections


class Windows(NamedTuple):
  """Crop windows, one per image: top-left corner and size, in pixels."""
  top: jax.Array
  left: jax.Array
  height: jax.Array
  width: jax.Array


def normalize(images: jax.Array,
              data_config: ml_collections.ConfigDict) -> jax.Array:
  """uint8 (or float pixel values) [B, H, W, 3] -> float32, per channel
  (x / 255 - mean) / std."""
  mean = jnp.asarray(data_config.mean, jnp.float32)
  std = jnp.asarray(data_config.std, jnp.float32)
  return (images.astype(jnp.float32) / 255.0 - mean) / std


def crop_windows(key: jax.Array, batch: int, height: int, width: int,
                 area_range, aspect_range, max_attempts: int) -> Windows:
  """Random windows whose area fraction lies in `area_range` and aspect
  ratio (width / height) in `aspect_range`, exactly, after rounding to
  pixels: of `max_attempts` candidates per image the first that does, else
  the whole image (as `tf.image.sample_distorted_bounding_box` does)."""
  k_area, k_aspect, k_top, k_left = jax.random.split(key, 4)
  shape = (batch, max_attempts)
  area = jax.random.uniform(k_area, shape, minval=area_range[0],
                            maxval=area_range[1]) * (height * width)
  aspect = jax.random.uniform(k_aspect, shape, minval=aspect_range[0],
                              maxval=aspect_range[1])
  h = jnp.round(jnp.sqrt(area / aspect)).astype(jnp.int32)
  w = jnp.round(jnp.sqrt(area * aspect)).astype(jnp.int32)
  fraction = (h * w) / (height * width)
  ratio = w / jnp.maximum(h, 1)
  valid = ((h >= 1) & (h <= height) & (w >= 1) & (w <= width)
           & (fraction >= area_range[0]) & (fraction <= area_range[1])
           & (ratio >= aspect_range[0]) & (ratio <= aspect_range[1]))
  first = jnp.argmax(valid, axis=1)
  found = jnp.any(valid, axis=1)
  pick = lambda x: jnp.take_along_axis(x, first[:, None], axis=1)[:, 0]
  h = jnp.where(found, pick(h), height)
  w = jnp.where(found, pick(w), width)
  top = jnp.floor(jax.random.uniform(k_top, (batch,)) * (height - h + 1))
  left = jnp.floor(jax.random.uniform(k_left, (batch,)) * (width - w + 1))
  return Windows(top.astype(jnp.int32), left.astype(jnp.int32), h, w)


def _bilinear_taps(start, size, out_size: int):
  """For each output pixel along one axis: the two input pixels of the window
  [start, start + size) it interpolates between, and the weight of the
  second (half-pixel centers, clamped to the window, as `tf.image.resize`)."""
  position = start + (jnp.arange(out_size) + 0.5) * (size / out_size) - 0.5
  position = jnp.clip(position, start, start + size - 1)
  low = jnp.floor(position).astype(jnp.int32)
  high = jnp.minimum(low + 1, start + size - 1)
  return low, high, position - low


def _crop_and_resize(image: jax.Array, window: Windows) -> jax.Array:
  """One float image's window, resized bilinearly to the image's size.

  Written out rather than `jax.image.scale_and_translate`, which samples
  the pixels just outside the window at its edges; the crop is a window of
  its own here, as in the seeds' `tf.image.resize` of a slice."""
  height, width = image.shape[:2]
  y0, y1, fy = _bilinear_taps(window.top, window.height, height)
  x0, x1, fx = _bilinear_taps(window.left, window.width, width)
  rows = (image[y0] * (1 - fy)[:, None, None] + image[y1] * fy[:, None, None])
  return rows[:, x0] * (1 - fx)[None, :, None] + rows[:, x1] * fx[None, :, None]


def augment(key: jax.Array, images: jax.Array,
            data_config: ml_collections.ConfigDict) -> jax.Array:
  """uint8 [B, H, W, 3] -> the augmented, normalized float32 batch."""
  batch, height, width, _ = images.shape
  k_crop, k_flip = jax.random.split(key)
  windows = crop_windows(k_crop, batch, height, width,
                         data_config.crop_area, data_config.crop_aspect_ratio,
                         data_config.crop_max_attempts)
  pixels = images.astype(jnp.float32)
  pixels = jax.vmap(_crop_and_resize)(pixels, windows)
  flip = jax.random.bernoulli(k_flip, 0.5, (batch,))
  pixels = jnp.where(flip[:, None, None, None], pixels[:, :, ::-1], pixels)
  return normalize(pixels, data_config)
