"""CIFAR-10 augmentation on the device, in JAX, from uint8 images.

The seeds' augmentation: a random crop of `crop_area` of the image's area
with aspect ratio in `crop_aspect_ratio`, resized back to the image's size
bilinearly, and a random horizontal flip; then per-channel normalization.
Keyed by a JAX key (the step's), so a batch is a function of (seed, step),
and traceable, so it runs inside the jitted program: only uint8 images cross
from the host. Evaluation images are only normalized.
"""

from typing import Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections

Batch = Mapping[str, jax.Array]


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


def crop_windows(keys: jax.Array, height: int, width: int, area_range,
                 aspect_range, max_attempts: int) -> Windows:
  """One random window per key whose area fraction lies in `area_range` and
  aspect ratio (width / height) in `aspect_range`, exactly, after rounding
  to pixels: of `max_attempts` candidates the first that does, else the whole
  image (as `tf.image.sample_distorted_bounding_box` does)."""

  def window(key):
    k_area, k_aspect, k_top, k_left = jax.random.split(key, 4)
    area = jax.random.uniform(k_area, (max_attempts,), minval=area_range[0],
                              maxval=area_range[1]) * (height * width)
    aspect = jax.random.uniform(k_aspect, (max_attempts,),
                                minval=aspect_range[0], maxval=aspect_range[1])
    h = jnp.round(jnp.sqrt(area / aspect)).astype(jnp.int32)
    w = jnp.round(jnp.sqrt(area * aspect)).astype(jnp.int32)
    fraction = (h * w) / (height * width)
    ratio = w / jnp.maximum(h, 1)
    valid = ((h >= 1) & (h <= height) & (w >= 1) & (w <= width)
             & (fraction >= area_range[0]) & (fraction <= area_range[1])
             & (ratio >= aspect_range[0]) & (ratio <= aspect_range[1]))
    first = jnp.argmax(valid)
    found = jnp.any(valid)
    h = jnp.where(found, h[first], height)
    w = jnp.where(found, w[first], width)
    top = jnp.floor(jax.random.uniform(k_top) * (height - h + 1))
    left = jnp.floor(jax.random.uniform(k_left) * (width - w + 1))
    return Windows(top.astype(jnp.int32), left.astype(jnp.int32), h, w)

  return jax.vmap(window)(keys)


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


def augment(keys: jax.Array, images: jax.Array,
            data_config: ml_collections.ConfigDict) -> jax.Array:
  """uint8 [B, H, W, 3] -> the augmented, normalized float32 batch; image i
  is a function of `keys[i]` alone, so a batch split over devices is
  augmented as it would be whole."""
  _, height, width, _ = images.shape
  k_crop, k_flip = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
  windows = crop_windows(k_crop, height, width, data_config.crop_area,
                         data_config.crop_aspect_ratio,
                         data_config.crop_max_attempts)
  pixels = images.astype(jnp.float32)
  pixels = jax.vmap(_crop_and_resize)(pixels, windows)
  flip = jax.vmap(lambda k: jax.random.bernoulli(k, 0.5))(k_flip)
  pixels = jnp.where(flip[:, None, None, None], pixels[:, :, ::-1], pixels)
  return normalize(pixels, data_config)


def example_keys(key: jax.Array, local_batch: int,
                 axis_name: Optional[str] = None) -> jax.Array:
  """This device's keys of one per example of the global batch, split from
  `key`: under `pmap` (`axis_name`) replica r takes the r-th block, so every
  strategy draws the same augmentation for the same example."""
  if axis_name is None:
    return jax.random.split(key, local_batch)
  replicas = jax.lax.psum(1, axis_name)
  keys = jax.random.split(key, local_batch * replicas)
  return jax.lax.dynamic_slice_in_dim(
      keys, jax.lax.axis_index(axis_name) * local_batch, local_batch)


def train_inputs(data_config: ml_collections.ConfigDict, key: jax.Array,
                 batch: Batch, axis_name: Optional[str] = None) -> Batch:
  """A train batch as the model takes it. uint8 pixels are augmented (if
  `data.augment`) and normalized here, on the device; float images are
  taken as already normalized model inputs (measurements feed those)."""
  images = batch['image']
  if images.dtype != jnp.uint8:
    return batch
  if data_config.augment:
    images = augment(example_keys(key, images.shape[0], axis_name), images,
                     data_config)
  else:
    images = normalize(images, data_config)
  return dict(batch, image=images)


def eval_inputs(data_config: ml_collections.ConfigDict, batch: Batch
                ) -> Batch:
  """An evaluation batch as the model takes it: uint8 pixels normalized."""
  if batch['image'].dtype != jnp.uint8:
    return batch
  return dict(batch, image=normalize(batch['image'], data_config))
