"""The image operations against PIL's, on the same image and parameters."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
from PIL import ImageEnhance
from PIL import ImageOps

from haiku_mp.vit.data import image_ops

SIZE = 32
_FILL = (int(image_ops.FILL),) * 3


def sample_image(seed=0, low=0, high=256):
  """A photo-like image: smooth gradients plus noise, in [low, high)."""
  rng = np.random.default_rng(seed)
  ramp = np.linspace(0, 1, SIZE)
  base = np.stack([np.add.outer(ramp, ramp) / 2, np.outer(ramp, 1 - ramp),
                   np.add.outer(1 - ramp, ramp) / 2], axis=-1)
  noisy = base + rng.normal(0, 0.15, base.shape)
  return np.clip(low + noisy * (high - low), low, high - 1).astype(np.uint8)


def _affine(a, b, c, d, e, f):
  return lambda im: im.transform(im.size, Image.AFFINE, (a, b, c, d, e, f),
                                 Image.NEAREST, fillcolor=_FILL)


# (name, ours(image), PIL's(image), largest difference, share that may differ)
# Color's grayscale is ITU-R 601 in float32; PIL's is fixed-point, so a
# luma value a rounding apart is one level off now and then. A stronger
# contrast's blend lands near a rounding boundary on a few pixels: a backend
# that fuses its multiply-add (one rounding where PIL has two; the tests'
# XLA:CPU flags do) is one level off there.
_CASES = [
    ('brightness_darker', lambda x: image_ops.brightness(x, 0.3),
     lambda im: ImageEnhance.Brightness(im).enhance(0.3), 0, 0),
    ('brightness_lighter', lambda x: image_ops.brightness(x, 1.7),
     lambda im: ImageEnhance.Brightness(im).enhance(1.7), 0, 0),
    ('color_grayer', lambda x: image_ops.color(x, 0.2),
     lambda im: ImageEnhance.Color(im).enhance(0.2), 1, 0.02),
    ('color_more', lambda x: image_ops.color(x, 1.8),
     lambda im: ImageEnhance.Color(im).enhance(1.8), 1, 0.02),
    ('contrast_less', lambda x: image_ops.contrast(x, 0.4),
     lambda im: ImageEnhance.Contrast(im).enhance(0.4), 0, 0),
    ('contrast_more', lambda x: image_ops.contrast(x, 1.6),
     lambda im: ImageEnhance.Contrast(im).enhance(1.6), 1, 0.02),
    ('sharpness_blurred', lambda x: image_ops.sharpness(x, 0.1),
     lambda im: ImageEnhance.Sharpness(im).enhance(0.1), 0, 0),
    ('sharpness_sharper', lambda x: image_ops.sharpness(x, 1.9),
     lambda im: ImageEnhance.Sharpness(im).enhance(1.9), 0, 0),
    ('posterize_4', lambda x: image_ops.posterize(x, 4),
     lambda im: ImageOps.posterize(im, 4), 0, 0),
    ('posterize_7', lambda x: image_ops.posterize(x, 7),
     lambda im: ImageOps.posterize(im, 7), 0, 0),
    ('solarize_128', lambda x: image_ops.solarize(x, 128),
     lambda im: ImageOps.solarize(im, 128), 0, 0),
    ('solarize_0', lambda x: image_ops.solarize(x, 0),
     lambda im: ImageOps.solarize(im, 0), 0, 0),
    ('invert', image_ops.invert, ImageOps.invert, 0, 0),
    ('autocontrast', image_ops.autocontrast, ImageOps.autocontrast, 0, 0),
    ('equalize', image_ops.equalize, ImageOps.equalize, 0, 0),
    ('rotate_left', lambda x: image_ops.rotate(x, 23.5),
     lambda im: im.rotate(23.5, Image.NEAREST, fillcolor=_FILL), 0, 0),
    ('rotate_right', lambda x: image_ops.rotate(x, -11.0),
     lambda im: im.rotate(-11.0, Image.NEAREST, fillcolor=_FILL), 0, 0),
    ('shear_x', lambda x: image_ops.shear_x(x, 0.27),
     _affine(1, 0.27, 0, 0, 1, 0), 0, 0),
    ('shear_y', lambda x: image_ops.shear_y(x, -0.19),
     _affine(1, 0, 0, -0.19, 1, 0), 0, 0),
    ('translate_x', lambda x: image_ops.translate_x(x, -7),
     _affine(1, 0, -7, 0, 1, 0), 0, 0),
    ('translate_y', lambda x: image_ops.translate_y(x, 5),
     _affine(1, 0, 0, 0, 1, 5), 0, 0),
]


class PilReferenceTest(parameterized.TestCase):

  @parameterized.named_parameters(*_CASES)
  def test_matches_pil(self, ours, pil, max_error, share):
    for seed, (low, high) in enumerate(((0, 256), (40, 190))):
      image = sample_image(seed, low, high)
      got = jax.jit(ours)(jnp.asarray(image, jnp.float32))
      chex.assert_type(got, jnp.float32)
      want = np.asarray(pil(Image.fromarray(image)), np.float32)
      error = np.abs(np.asarray(got) - want)
      self.assertLessEqual(error.max(), max_error)
      self.assertLessEqual(np.mean(error > 0), share)

  def test_ops_take_a_parameter_per_image_under_vmap(self):
    images = jnp.asarray(np.stack([sample_image(s) for s in range(3)]), jnp.float32)
    factors = jnp.array([0.5, 1.0, 1.5])
    got = jax.vmap(image_ops.contrast)(images, factors)
    for image, factor, out in zip(images, factors, got):
      np.testing.assert_array_equal(out, image_ops.contrast(image, factor))
    np.testing.assert_array_equal(got[1], images[1])  # Factor 1: the image.

  def test_a_flat_channel_is_kept_by_autocontrast_and_equalize(self):
    image = jnp.full((SIZE, SIZE, 3), 77.0)
    np.testing.assert_array_equal(image_ops.autocontrast(image), image)
    np.testing.assert_array_equal(image_ops.equalize(image), image)


if __name__ == '__main__':
  absltest.main()
