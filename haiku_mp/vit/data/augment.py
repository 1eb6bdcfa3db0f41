"""CIFAR-10 augmentation on the device, in JAX, from uint8 images.

In order, each a `data` setting: a crop (`crop`: the seeds' random resized
crop of `crop_area` of the image's area with aspect ratio in
`crop_aspect_ratio`, resized back bilinearly; or `pad`: a random crop of the
image's size from the image padded with `crop_padding` black pixels), a
random horizontal flip, a `policy` (RandAugment or AutoAugment's CIFAR-10
policy, `auto_augment.py`), per-channel normalization, random erasing, and
mixup / CutMix with soft labels (`mixing.py`). Keyed by a JAX key (the
step's), so a batch is a function of (seed, step), and traceable, so it runs
inside the jitted program: only uint8 images cross from the host. Evaluation
images are only normalized.
"""

from typing import Mapping, NamedTuple, Optional

import dm_pix as pix
import jax
import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.update import keys as keys_lib
from haiku_mp.vit.data import auto_augment
from haiku_mp.vit.data import mixing
from haiku_mp.vit.settings import DataSettings
from haiku_mp.vit.settings import dataset as data_settings

CROPS = data_settings.CROPS
POLICIES = data_settings.POLICIES
# Random erasing's box (Zhong et al., 2017): a share of the image's area and
# an aspect ratio, drawn as the crop's windows are.
_ERASE_AREA = (0.02, 1.0 / 3.0)
_ERASE_ASPECT_RATIO = (0.3, 1.0 / 0.3)
_ERASE_ATTEMPTS = 10

Batch = Mapping[str, jax.Array]


class Windows(NamedTuple):
  """Crop windows, one per image: top-left corner and size, in pixels."""
  top: jax.Array
  left: jax.Array
  height: jax.Array
  width: jax.Array


def normalize(images: jax.Array,
              data_config: DataSettings) -> jax.Array:
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


def crop_and_resize(image: jax.Array, window: Windows) -> jax.Array:
  """One float image's window, resized bilinearly to the image's size.

  Written out rather than `jax.image.scale_and_translate`, which samples
  the pixels just outside the window at its edges; the crop is a window of
  its own here, as in the seeds' `tf.image.resize` of a slice."""
  height, width = image.shape[:2]
  y0, y1, fy = _bilinear_taps(window.top, window.height, height)
  x0, x1, fx = _bilinear_taps(window.left, window.width, width)
  rows = (image[y0] * (1 - fy)[:, None, None] + image[y1] * fy[:, None, None])
  return rows[:, x0] * (1 - fx)[None, :, None] + rows[:, x1] * fx[None, :, None]


def _pad_and_crop(key: jax.Array, image: jax.Array, padding: int
                  ) -> jax.Array:
  """A random crop of the image's size from it padded with black."""
  height, width, channels = image.shape
  padded = pix.pad_to_size(image, height + 2 * padding, width + 2 * padding)
  return pix.random_crop(key, padded, (height, width, channels))


def _erase(key: jax.Array, image: jax.Array, probability: float
           ) -> jax.Array:
  """Random erasing: with `probability`, a box of the (normalized) image
  filled with one standard normal value per channel (timm's 'rand' mode;
  noise per pixel drew more random bits than the rest of the
  augmentation)."""
  height, width, _ = image.shape
  k_apply, k_box, k_noise = jax.random.split(key, 3)
  box = jax.tree.map(
      lambda x: x[0],
      crop_windows(k_box[None], height, width, _ERASE_AREA,
                   _ERASE_ASPECT_RATIO, _ERASE_ATTEMPTS))
  rows = jnp.arange(height)[:, None]
  cols = jnp.arange(width)[None, :]
  inside = ((rows >= box.top) & (rows < box.top + box.height) &
            (cols >= box.left) & (cols < box.left + box.width))
  # No box found in the attempts is the whole image (crop_windows): kept.
  erase = (jax.random.bernoulli(k_apply, probability) &
           (box.height * box.width < height * width))
  noise = jax.random.normal(k_noise, image.shape[-1:], image.dtype)
  return jnp.where(erase & inside[..., None], noise, image)


def mixing_off_step(data_config: DataSettings,
                    total_steps: int) -> Optional[int]:
  """The step from which a mixing run trains on whole examples (timm's
  `mixup_off_epoch`, as a share of the run): None when it never stops."""
  if not data_settings.mixes(data_config) or not data_config.mixing_off_share:
    return None
  return round(total_steps * (1 - data_config.mixing_off_share))


def augment(keys: jax.Array, images: jax.Array,
            data_config: DataSettings) -> jax.Array:
  """uint8 [B, H, W, 3] -> the augmented, normalized float32 batch; image i
  is a function of `keys[i]` alone, so a batch split over devices is
  augmented as it would be whole. (Mixing, which pairs images, is
  `train_inputs`'.)"""
  _, height, width, _ = images.shape
  k_crop, k_flip = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
  # The recipe's draws come from keys of their own (split only when a recipe
  # step is on): the seeds' crop and flip draw what they always drew.
  if data_config.policy != 'none' or data_config.erasing_probability > 0:
    k_policy, k_erase = jnp.moveaxis(
        jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 1)))(keys),
        1, 0)
  pixels = images.astype(jnp.float32)
  if data_config.crop == 'resized':
    windows = crop_windows(k_crop, height, width, data_config.crop_area,
                           data_config.crop_aspect_ratio,
                           data_config.crop_max_attempts)
    pixels = jax.vmap(crop_and_resize)(pixels, windows)
  elif data_config.crop == 'pad':
    pixels = jax.vmap(_pad_and_crop, in_axes=(0, 0, None))(
        k_crop, pixels, data_config.crop_padding)
  if data_config.flip:
    flip = jax.vmap(lambda k: jax.random.bernoulli(k, 0.5))(k_flip)
    pixels = jnp.where(flip[:, None, None, None], pixels[:, :, ::-1], pixels)
  if data_config.policy == 'randaugment':
    pixels = jax.vmap(auto_augment.randaugment, in_axes=(0, 0, None, None))(
        k_policy, pixels, data_config.randaugment_ops,
        data_config.randaugment_magnitude)
  elif data_config.policy == 'autoaugment':
    pixels = jax.vmap(auto_augment.autoaugment)(k_policy, pixels)
  pixels = normalize(pixels, data_config)
  if data_config.erasing_probability > 0:
    pixels = jax.vmap(_erase, in_axes=(0, 0, None))(
        k_erase, pixels, data_config.erasing_probability)
  return pixels


def train_inputs(data_config: DataSettings, key: jax.Array,
                 batch: Batch, axis_name: Optional[str] = None,
                 step: Optional[jax.Array] = None, num_classes: int = 0,
                 total_steps: int = 0) -> Batch:
  """A train batch as the model takes it. uint8 pixels are augmented (if
  `data.augment`) and normalized here, on the device; float images are
  taken as already normalized model inputs (measurements feed those). A
  mixed batch (`data_settings.mixes`) gains 'targets', soft labels over
  `num_classes`; from `mixing_off_step(data_config, total_steps)` on (given
  the train state's `step`) its examples stay whole and its targets
  one-hot."""
  images = batch['image']
  if images.dtype != jnp.uint8:
    return batch
  if not data_config.augment:
    return dict(batch, image=normalize(images, data_config))
  if data_settings.mixes(data_config) and images.shape[0] % 2:
    raise errors.ConfigError(
        f'mixup and CutMix pair the examples of a device\'s batch, and it '
        f'holds {images.shape[0]}: make batch_size an even number per device')
  keys = keys_lib.example_keys(key, images.shape[0], axis_name)
  images = augment(keys, images, data_config)
  if not data_settings.mixes(data_config):
    return dict(batch, image=images)
  mix_keys = jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys)
  off_step = mixing_off_step(data_config, total_steps)
  active = None if step is None or off_step is None else step < off_step
  images, targets = mixing.mix(mix_keys, images, batch['label'], num_classes,
                               data_config.mixup_alpha,
                               data_config.cutmix_alpha,
                               data_config.mixing_probability, active)
  return dict(batch, image=images, targets=targets)


def eval_inputs(data_config: DataSettings, batch: Batch
                ) -> Batch:
  """An evaluation batch as the model takes it: uint8 pixels normalized."""
  if batch['image'].dtype != jnp.uint8:
    return batch
  return dict(batch, image=normalize(batch['image'], data_config))
