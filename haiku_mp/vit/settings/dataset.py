"""The data: its source, splits and the on-device augmentation
(haiku_mp/vit/data/)."""

import math
from typing import Optional

from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import setting

# Where the images come from (haiku_mp/vit/data/pipeline.py reads each).
SOURCES = ('tfds', 'arrays', 'synthetic')
# The images' channels (RGB): one mean and one std each.
CHANNELS = 3
# The train crops and augmentation policies (haiku_mp/vit/data/augment.py).
CROPS = ('resized', 'pad', 'none')
POLICIES = ('none', 'randaugment', 'autoaugment')
# RandAugment's strongest magnitude (haiku_mp/vit/data/auto_augment.py).
MAX_MAGNITUDE = 10.0
# The augmentation operations of haiku_mp/vit/data/auto_augment.py, by index.
# RandAugment draws from all but 'invert' (AutoAugment's CIFAR-10 policy
# uses it; RandAugment's list does not).
AUGMENT_OPS = ('identity', 'autocontrast', 'equalize', 'rotate', 'solarize',
               'color', 'posterize', 'contrast', 'brightness', 'sharpness',
               'shear_x', 'shear_y', 'translate_x', 'translate_y', 'invert')
RANDAUGMENT_OPS = AUGMENT_OPS[:-1]


def mixes(data) -> bool:
  """Whether the train batch is mixed (mixup or CutMix): soft labels, and
  examples in pairs. `data`: the data settings, or a config's ConfigDict."""
  return data.augment and (data.mixup_alpha > 0 or data.cutmix_alpha > 0)


def _finite(values: tuple[float, ...], count: int) -> bool:
  return len(values) == count and all(math.isfinite(v) for v in values)


# Mixup's and CutMix's Beta(alpha, alpha).
_ALPHA = fields.rule(lambda a: 0 <= a < math.inf,
                     'a finite number >= 0 (0: off)')


def _range(low: float, high: float, valid: str) -> fields.Check:
  """The check of a (min, max) pair with low < min <= max <= high."""
  return fields.rule(
      lambda v: _finite(v, 2) and low < v[0] <= v[1] <= high, valid)


def _randaugment_ops(count: int) -> Optional[str]:
  """Operations per image: at least one, at most RandAugment's."""
  most = len(RANDAUGMENT_OPS)
  if count < 1:
    return 'must be positive'
  if count > most:
    return (f'must be in [1, {most}] (operations applied to each image, '
            f"drawn among RandAugment's {most})")
  return None


@fields.frozen
class DataSettings:
  """Where the images come from and how train images are augmented."""

  source: str = setting(
      'tfds',
      "'tfds' (TFDS, read once into memory), 'arrays' (a .npz from "
      "`python -m launch.data export`; no TensorFlow) or 'synthetic' "
      '(random pixels). Every split is held in memory and augmented on '
      'the device.', check=fields.one_of(SOURCES))
  arrays_path: str = setting('', 'The .npz of the arrays source.')
  name: str = setting(
      'cifar10',
      'The TFDS dataset (its images must fit the model).')
  data_dir: str = setting('', 'empty: the TFDS default (or TFDS_DATA_DIR).')
  download: bool = setting(True, 'Download if not prepared in data_dir.')
  train_split: str = setting(
      'train[:45000]',
      'TFDS split strings (the arrays source reads the same syntax).')
  val_split: str = setting('train[45000:]', 'Evaluated every eval_every_steps.')
  test_split: str = setting('test', 'Evaluated once, at the end.')
  augment: bool = setting(
      True,
      'The train augmentation, on the device (haiku_mp/vit/data/augment.py), '
      'in this order; False: images only normalized.')
  crop: str = setting(
      'resized',
      "'resized': a random crop of crop_area of the area with aspect "
      "ratio in crop_aspect_ratio, resized back; 'pad': a random crop of "
      "the image's size from the image padded with crop_padding black "
      "pixels; 'none'.", check=fields.one_of(CROPS))
  crop_area: tuple[float, ...] = setting(
      (0.9, 1.0),
      "'resized': the crop's share of the image's area, drawn in this "
      '(low, high) range.',
      takes='(min, max) fractions of the image area with 0 < min <= max <= 1',
      check=_range(0, 1, '(min, max) fractions of the image area with 0 < '
                   'min <= max <= 1'))
  crop_aspect_ratio: tuple[float, ...] = setting(
      (0.9, 1.1),
      "'resized': the crop's aspect ratio, drawn in this (low, high) "
      'range.',
      takes='(min, max) width/height ratios with 0 < min <= max',
      check=_range(0, math.inf, '(min, max) width/height ratios with 0 < '
                   'min <= max'))
  crop_max_attempts: int = setting(
      10,
      "'resized': draws before the whole image.", check=fields.POSITIVE)
  crop_padding: int = setting(4, "'pad': black pixels on each side.")
  flip: bool = setting(True, 'A random horizontal flip.')
  policy: str = setting(
      'none',
      "'none', 'randaugment' (randaugment_ops operations drawn per image, "
      "each at randaugment_magnitude of 10) or 'autoaugment' "
      "(AutoAugment's CIFAR-10 policy). haiku_mp/vit/data/auto_augment.py.",
      check=fields.one_of(POLICIES))
  randaugment_ops: int = setting(
      2,
      f"'randaugment': operations per image (1-{len(RANDAUGMENT_OPS)}).",
      check=_randaugment_ops)
  randaugment_magnitude: float = setting(
      9.0, "'randaugment': strength, 0-10.",
      check=fields.between(0, MAX_MAGNITUDE))
  erasing_probability: float = setting(
      0.0,
      'Random erasing: a box of noise, on this share of the images.',
      check=fields.between(0, 1))
  mixup_alpha: float = setting(
      0.0,
      'Mixup and CutMix of neighbouring examples with soft labels; the '
      'ratio is Beta(alpha, alpha); 0 turns a method off; both on: even '
      'odds per example.', check=_ALPHA)
  cutmix_alpha: float = setting(0.0, "CutMix's Beta(alpha, alpha); 0: off.",
                                check=_ALPHA)
  mixing_probability: float = setting(
      1.0,
      'With mixup or CutMix on: the share of examples mixed, each drawn '
      "on its own (timm's mix_prob); the others keep their image and "
      'label.',
      check=fields.rule(lambda p: 0 < p <= 1, 'in (0, 1] (to mix nothing, set '
                        'data.mixup_alpha and data.cutmix_alpha to 0)'))
  mixing_off_share: float = setting(
      0.0,
      'With mixup or CutMix on: the share of the run, at its end, trained '
      "on whole examples (timm's mixup_off_epoch, as a share); 0: mix to "
      'the end.',
      check=fields.rule(lambda s: 0 <= s < 1, 'in [0, 1) (the share of the '
                        'run, at its end, trained without mixing)'))
  mean: tuple[float, ...] = setting(
      (0.4914, 0.4822, 0.4465),
      "Per-channel normalization of pixels in [0, 1] (CIFAR-10's).",
      takes=f'{CHANNELS} numbers, one per channel',
      check=fields.rule(lambda m: _finite(m, CHANNELS),
                        f'{CHANNELS} numbers, one per channel'))
  std: tuple[float, ...] = setting(
      (0.2023, 0.1994, 0.201),
      'Divides each channel, mean taken.',
      takes=f'{CHANNELS} positive numbers, one per channel',
      check=fields.rule(lambda s: _finite(s, CHANNELS) and min(s) > 0,
                        f'{CHANNELS} positive numbers, one per channel'))
  prefetch_batches: int = setting(
      2, 'Batches on their way to the devices.',
      check=fields.rule(lambda n: n >= 1, 'at least 1'))
  synthetic_train_examples: int = setting(
      45000,
      "'synthetic': train split size.", check=fields.POSITIVE)
  synthetic_eval_examples: int = setting(
      5000,
      "'synthetic': val and test sizes.", check=fields.POSITIVE)


__all__ = ['DataSettings', 'SOURCES', 'CROPS', 'POLICIES', 'MAX_MAGNITUDE',
           'AUGMENT_OPS', 'RANDAUGMENT_OPS', 'mixes']
