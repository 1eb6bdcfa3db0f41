"""RandAugment's and AutoAugment's image operations, in JAX, as PIL does them.

Each takes one image [H, W, 3] of float32 pixel values that are whole numbers
in [0, 255] and returns one of the same kind: the rounding PIL does on uint8
images is done here too, so an op chained after another sees what it would
see in PIL (the reference the tests hold them to). Parameters are scalars and
may be traced, so every op runs under `vmap` with a value per image.

dm-pix does the geometric resampling (`affine_transform`), the grayscale
(`rgb_to_grayscale`) and solarize. What it lacks is written here: PIL's
enhancements are blends with a degenerate image (dm-pix's `adjust_brightness`
adds a delta, its `adjust_contrast` keeps each channel's own mean), and
dm-pix has no posterize, autocontrast, equalize, sharpness or invert.
"""

import dm_pix as pix
import jax
import jax.numpy as jnp

_WHITE = 255.0
_LEVELS = 256
# What rotate, shear and translate put where the image was not: mid-gray.
FILL = 128.0


def _to_pixels(x: jax.Array) -> jax.Array:
  """Clipped to [0, 255] and truncated, as PIL stores a blend in uint8."""
  return jnp.floor(jnp.clip(x, 0.0, _WHITE))


def blend(degenerate: jax.Array, image: jax.Array, factor) -> jax.Array:
  """PIL's `Image.blend(degenerate, image, factor)`: factor 0 is the
  degenerate image, 1 the image, above 1 extrapolates past it."""
  return _to_pixels(degenerate + factor * (image - degenerate))


def _grayscale(image: jax.Array) -> jax.Array:
  """PIL's 'L' conversion (ITU-R 601 luma, rounded), as [H, W, 1]."""
  return jnp.round(pix.rgb_to_grayscale(image, keep_dims=False))


def brightness(image: jax.Array, factor) -> jax.Array:
  """`ImageEnhance.Brightness`: a blend with black."""
  return blend(jnp.zeros_like(image), image, factor)


def color(image: jax.Array, factor) -> jax.Array:
  """`ImageEnhance.Color` (saturation): a blend with the image's grayscale."""
  return blend(_grayscale(image), image, factor)


def contrast(image: jax.Array, factor) -> jax.Array:
  """`ImageEnhance.Contrast`: a blend with the grayscale's mean, rounded."""
  mean = jnp.floor(jnp.mean(_grayscale(image)) + 0.5)
  return blend(jnp.full_like(image, mean), image, factor)


def sharpness(image: jax.Array, factor) -> jax.Array:
  """`ImageEnhance.Sharpness`: a blend with PIL's SMOOTH filter (3x3 kernel,
  5 in the middle, 1 around, over 13; the border pixels kept as they are)."""
  # Nine shifted slices: a fraction of `jax.scipy.signal.convolve2d`'s time
  # on XLA:CPU for a 3x3 kernel.
  height, width = image.shape[:2]
  smooth = 4.0 * image[1:-1, 1:-1]
  for dy in range(3):
    for dx in range(3):
      smooth = smooth + image[dy:height - 2 + dy, dx:width - 2 + dx]
  smooth = smooth / 13.0
  smooth = image.at[1:-1, 1:-1].set(jnp.round(smooth))
  return blend(smooth, image, factor)


def posterize(image: jax.Array, bits) -> jax.Array:
  """`ImageOps.posterize`: only the `bits` high bits of each value kept."""
  step = 2.0 ** (8 - bits)
  return jnp.floor(image / step) * step


def solarize(image: jax.Array, threshold) -> jax.Array:
  """`ImageOps.solarize`: values at or above `threshold` inverted."""
  # dm-pix inverts in [0, 1]; rounding gives back PIL's whole numbers.
  return jnp.round(pix.solarize(image / _WHITE, threshold / _WHITE) * _WHITE)


def invert(image: jax.Array) -> jax.Array:
  """`ImageOps.invert`."""
  return _WHITE - image


def autocontrast(image: jax.Array) -> jax.Array:
  """`ImageOps.autocontrast`: each channel stretched so its darkest value is
  0 and its lightest 255 (truncated, as PIL's lookup table); a flat channel
  is kept."""
  low = image.min(axis=(0, 1), keepdims=True)
  high = image.max(axis=(0, 1), keepdims=True)
  flat = high <= low
  scale = _WHITE / jnp.where(flat, 1.0, high - low)
  return jnp.where(flat, image, _to_pixels((image - low) * scale))


def equalize(image: jax.Array) -> jax.Array:
  """`ImageOps.equalize`: per channel, PIL's lookup table from the
  histogram (steps of (pixels - count of the last value present) // 255); a
  channel with no such step is kept."""

  def channel(values):
    levels = values.astype(jnp.int32).reshape(-1)
    histogram = jnp.zeros(_LEVELS, jnp.int32).at[levels].add(1)
    last = _LEVELS - 1 - jnp.argmax(histogram[::-1] > 0)
    step = (levels.size - histogram[last]) // (_LEVELS - 1)
    below = jnp.cumsum(histogram) - histogram  # Pixels under each value.
    table = jnp.minimum((step // 2 + below) // jnp.maximum(step, 1),
                        _LEVELS - 1)
    return jnp.where(step > 0, table[levels].reshape(values.shape).astype(
        values.dtype), values)

  return jax.vmap(channel, in_axes=2, out_axes=2)(image)


def affine(image: jax.Array, a, b, c, d, e, f) -> jax.Array:
  """PIL's `Image.transform(size, AFFINE, (a, b, c, d, e, f), NEAREST,
  fillcolor=FILL)`: output pixel (x, y) takes the input at (a x + b y + c,
  d x + e y + f), in PIL's coordinates (pixel centers at +0.5)."""
  # In pixel indices (centers at 0) the offsets gain half a pixel's terms.
  matrix = jnp.array([[e, d, 0.0], [b, a, 0.0], [0.0, 0.0, 1.0]])
  offset = jnp.array([f + 0.5 * (d + e - 1.0), c + 0.5 * (a + b - 1.0), 0.0])
  return pix.affine_transform(image, matrix, offset=offset, order=0,
                              mode='constant', cval=FILL)


def rotation(degrees, height: int, width: int) -> tuple:
  """PIL's affine coefficients of `Image.rotate(degrees)`: counter-clockwise
  about the image's center."""
  angle = jnp.deg2rad(degrees)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  cx, cy = width / 2.0, height / 2.0
  return (cos, -sin, cx - cos * cx + sin * cy,
          sin, cos, cy - sin * cx - cos * cy)


def rotate(image: jax.Array, degrees) -> jax.Array:
  """`Image.rotate(degrees, NEAREST, fillcolor=FILL)`."""
  return affine(image, *rotation(degrees, *image.shape[:2]))


def shear_x(image: jax.Array, shear) -> jax.Array:
  return affine(image, 1.0, shear, 0.0, 0.0, 1.0, 0.0)


def shear_y(image: jax.Array, shear) -> jax.Array:
  return affine(image, 1.0, 0.0, 0.0, shear, 1.0, 0.0)


def translate_x(image: jax.Array, pixels) -> jax.Array:
  return affine(image, 1.0, 0.0, pixels, 0.0, 1.0, 0.0)


def translate_y(image: jax.Array, pixels) -> jax.Array:
  return affine(image, 1.0, 0.0, 0.0, 0.0, 1.0, pixels)
