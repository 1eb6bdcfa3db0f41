"""4-bit floats: E2M1 rounding, NVFP4 and MXFP4 blocks and the Hadamard
transform, against references written here from the formats' definitions
(NumPy and ml_dtypes, never the code under test)."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from haiku_mp import errors as haiku_mp_errors
from haiku_mp.model import blocks as blocks_lib
from haiku_mp.model import fp4
from haiku_mp.model import fp4_blocks
from haiku_mp.model import fp8_scales
from tests import helpers

# The functions under test, each compiled whole: run op by op, their many
# small operations are a program each, five times the CPU time.
_round_e2m1 = jax.jit(fp4_blocks.round_e2m1)
_nvfp4 = jax.jit(fp4_blocks.nvfp4, static_argnames=('axis', 'two_d'))
_mxfp4 = jax.jit(fp4_blocks.mxfp4, static_argnames=('axis', 'two_d'))
_mx_quantize_dequantize = jax.jit(fp8_scales.mx_quantize_dequantize,
                                  static_argnums=(1, 2))

# E2M1's values and their codes' parity (ties go to the even code).
_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_EVEN = np.arange(8) % 2 == 0


def _transform_blocks(x: jax.Array, matrix: jax.Array,
                     axis: int) -> jax.Array:
  """The reference the butterflies (`fp4_blocks.hadamard_transform`) are held
  to: each block of `matrix.shape[0]` values of `x` along `axis` (whose size it
  divides) times `matrix`, as a GEMM. For the weight gradient's GEMM,
  `x.T @ g` = (H x).T @ (H g) blockwise along the tokens, exactly, before
  either is quantized."""
  size = matrix.shape[0]
  axis = axis % x.ndim
  if x.shape[axis] % size:
    raise ValueError(f'the Hadamard transform of {size} takes an axis that '
                     f'{size} divides, not {x.shape[axis]}')
  split = blocks_lib.split(x, axis, size)
  # The blocks' axis contracted in place, at full float32 precision.
  letters = 'abcdefghijklmnopqrstuvwx'[:split.ndim]
  mixed = letters[:axis + 1] + 'z' + letters[axis + 2:]
  split = jnp.einsum(f'{letters},z{letters[axis + 1]}->{mixed}', split,
                     matrix, precision=jax.lax.Precision.HIGHEST)
  return blocks_lib.merge(split, axis, x.shape[axis])


def _round_reference(x: np.ndarray) -> np.ndarray:
  """Nearest E2M1 value by search over the grid, ties to the even code,
  saturating at 6."""
  x = np.asarray(x, np.float64)
  out = np.empty_like(x)
  for i, v in np.ndenumerate(x):
    distance = np.abs(_VALUES - min(abs(v), 6.0))
    best = np.flatnonzero(distance == distance.min())
    if len(best) > 1:
      best = best[_EVEN[best]]
    out[i] = np.copysign(_VALUES[best[0]], v)
  return out


def _nvfp4_reference(x: np.ndarray, block: int = 16) -> np.ndarray:
  """NVFP4 of a 2-D `x`, blocks along its last axis: the tensor's scale
  amax / (6 * 448), each block's scale amax / 6 in its units cast to E4M3,
  values rounded to E2M1."""
  x = np.asarray(x, np.float32)
  tensor_scale = np.float32(np.abs(x).max() / (6.0 * 448.0))
  out = np.zeros_like(x)
  for r in range(x.shape[0]):
    for start in range(0, x.shape[1], block):
      values = x[r, start:start + block]
      scale = (np.float32(np.abs(values).max() / 6.0) / tensor_scale).astype(
          ml_dtypes.float8_e4m3fn).astype(np.float32)
      if scale > 0:
        unit = scale * tensor_scale
        out[r, start:start + block] = _round_reference(values / unit) * unit
  return out


def _mxfp4_reference(x: np.ndarray, block: int = 32) -> np.ndarray:
  """MXFP4 of a 2-D `x`, blocks along its last axis, each block's scale the
  smallest power of two that leaves its amax within 6."""
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  for r in range(x.shape[0]):
    for start in range(0, x.shape[1], block):
      values = x[r, start:start + block]
      amax = np.abs(values).max()
      if amax > 0:
        scale = 2.0 ** math_ceil_log2(amax / 6.0)
        out[r, start:start + block] = _round_reference(values / scale) * scale
  return out


def math_ceil_log2(v: float) -> int:
  exponent = int(np.floor(np.log2(v)))
  return exponent if 2.0**exponent >= v else exponent + 1


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # The smallest normal float32.
# E2M1's largest relative error to nearest, at a tie between two of its
# normal values (1.25, 2.5, 5): all that a block's largest values may lose.
_E2M1_NEAREST_ERROR = 0.2


def _nvfp4_reference_f64(x: np.ndarray, block: int = 16) -> np.ndarray:
  """NVFP4 of a 2-D `x` (blocks along its last axis) in float64, whose
  range holds the scales of any float32 tensor: the tensor's scale amax /
  (6 * 448), each block's amax / 6 in its units cast to E4M3, values
  rounded to E2M1."""
  x = np.asarray(x, np.float64)
  amax = np.abs(x).max()
  if amax == 0:
    return np.zeros_like(x)
  tensor_scale = amax / (6.0 * 448.0)
  blocks = x.reshape(x.shape[0], -1, block)
  scale = (np.abs(blocks).max(-1, keepdims=True) / 6.0 / tensor_scale).astype(
      ml_dtypes.float8_e4m3fn).astype(np.float64)
  unit = np.broadcast_to(scale * tensor_scale, blocks.shape)
  values = _round_reference(np.divide(blocks, unit, out=np.zeros_like(blocks),
                                      where=unit > 0))
  return (values * unit).reshape(x.shape)


def _mx_reference_f64(x: np.ndarray, dtype, block: int = 32) -> np.ndarray:
  """MX blocks of `dtype` (an ml_dtypes fp8) of a 2-D `x` along its last
  axis in float64: each block's scale the smallest power of two that leaves
  its amax within the format's largest value, values cast to it."""
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  top = float(ml_dtypes.finfo(dtype).max)
  for r in range(x.shape[0]):
    for start in range(0, x.shape[1], block):
      values = x[r, start:start + block]
      amax = np.abs(values).max()
      if amax > 0:
        scale = 2.0 ** math_ceil_log2(amax / top)
        out[r, start:start + block] = (values / scale).astype(dtype).astype(
            np.float64) * scale
  return out


def _tiny_test_tensor() -> np.ndarray:
  """(16, 32) float32 of amax 1: blocks of different amaxes and a zero one,
  every other magnitude in [0.2, 1], so that times 1e-37 each value and
  its NVFP4 value (at least 0.15 of the amax) are normal float32 numbers,
  which XLA:CPU does not flush."""
  rng = np.random.default_rng(12)
  y = rng.uniform(0.2, 1.0, (16, 32)) * rng.choice([-1.0, 1.0], (16, 32))
  y[0, 0] = 1.0
  y[0, 16:] = np.clip(y[0, 16:], -0.5, 0.5)
  y[1, :16] = 0.0
  return y.astype(np.float32)


class E2M1Test(absltest.TestCase):

  def test_nearest_even_and_saturation_match_the_grid(self):
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = np.array(ties + [-t for t in ties] + [0.1, 0.3, 2.2, 5.9, 6.0, 7.0,
                                               1e6, -1e6, 0.0], np.float32)
    rng = np.random.default_rng(0)
    x = np.concatenate([x, rng.normal(scale=3.0, size=500).astype(np.float32)])
    got = np.asarray(_round_e2m1(jnp.asarray(x)))
    np.testing.assert_array_equal(got, _round_reference(x))
    # The cast itself, on this backend, is ml_dtypes' (the module relies on it).
    np.testing.assert_array_equal(
        np.asarray(jnp.asarray(x).astype(fp4_blocks.E2M1).astype(jnp.float32)),
        x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))

  def test_non_finite_values_stay(self):
    got = np.asarray(_round_e2m1(jnp.asarray([np.nan, np.inf, -np.inf])))
    self.assertTrue(np.isnan(got[0]))
    np.testing.assert_array_equal(got[1:], [np.inf, -np.inf])

  def test_stochastic_rounding_is_unbiased_between_neighbours(self):
    x = jnp.asarray([0.3, 1.2, 2.6, 3.9, 5.0, -0.7, 6.0, 0.0], jnp.float32)
    draws = 40_000
    keys = jax.random.split(jax.random.key(0), draws)
    got = np.asarray(jax.jit(jax.vmap(
        lambda k: fp4_blocks.stochastic_round_e2m1(x, k)))(keys))
    for j, v in enumerate(np.asarray(x)):
      column = got[:, j]
      below = _VALUES[_VALUES <= abs(v)].max()
      above = _VALUES[_VALUES >= abs(v)].min()
      self.assertContainsSubset(set(np.abs(column)), {below, above}, v)
      spread = (above - below) / 2 / np.sqrt(draws)  # At most the std error.
      self.assertLess(abs(column.mean() - v), 4 * spread + 1e-7, v)


class BlocksTest(parameterized.TestCase):

  def test_nvfp4_matches_the_reference(self):
    x = np.random.default_rng(1).normal(scale=2.0, size=(8, 64))
    x[3, 16:32] = 0.0  # A zero block.
    x[5, 0] = 300.0  # An outlier: its block's small values flush to zero.
    got = np.asarray(_nvfp4(jnp.asarray(x, jnp.float32)))
    np.testing.assert_array_equal(got, _nvfp4_reference(x))
    np.testing.assert_array_equal(got[3, 16:32], 0.0)
    self.assertEqual(np.count_nonzero(got[5, 1:16]), 0)

  def test_nvfp4_block_saturates_when_its_e4m3_scale_rounds_down(self):
    # Tensor scale 1: a block of amax 55.8 asks for 9.3, E4M3 holds 9, so
    # 55.8 / 9 = 6.2 saturates at 6 (54).
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 6.0 * 448.0
    x[0, 16] = 55.8
    got = np.asarray(_nvfp4(jnp.asarray(x)))
    self.assertEqual(got[0, 0], 6.0 * 448.0)
    self.assertEqual(got[0, 16], 54.0)

  def test_two_d_tiles_quantize_a_matrix_and_its_transpose_alike(self):
    w = jnp.asarray(np.random.default_rng(2).normal(size=(32, 48)),
                    jnp.float32)
    np.testing.assert_array_equal(np.asarray(_nvfp4(w, two_d=True)).T,
                                  np.asarray(_nvfp4(w.T, two_d=True)))
    # A tile is one block: its 16 x 16 values share a scale.
    x = np.zeros((16, 16), np.float32)
    x[0, 0], x[15, 15] = 300.0, 1.0
    self.assertEqual(float(_nvfp4(jnp.asarray(x), two_d=True)[15, 15]), 0)

  def test_mxfp4_matches_the_reference_and_never_saturates(self):
    x = np.random.default_rng(3).normal(scale=5.0, size=(4, 96))
    x[1, 32:64] = 0.0
    x[2, 70] = 1e4
    got = np.asarray(_mxfp4(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(got, _mxfp4_reference(x), rtol=1e-6)
    blocks = x.reshape(4, 3, 32)
    held = got.reshape(4, 3, 32)
    amax = np.abs(blocks).max(-1)
    # Each block's largest value kept to within E2M1's step at the top.
    np.testing.assert_array_less(np.abs(np.abs(held).max(-1) - amax),
                                 amax / 3 + 1e-6)

  def test_blocks_along_another_axis(self):
    x = jnp.asarray(np.random.default_rng(4).normal(size=(64, 8)),
                    jnp.float32)
    np.testing.assert_array_equal(np.asarray(_nvfp4(x, axis=0)),
                                  np.asarray(_nvfp4(x.T)).T)
    np.testing.assert_array_equal(np.asarray(_mxfp4(x, axis=0)),
                                  np.asarray(_mxfp4(x.T)).T)


class RangeEdgesTest(parameterized.TestCase):
  """Tensors at either end of float32's range, against float64 references:
  a tiny NVFP4 tensor keeps its relative values (its scale amax / 2688 is
  no normal float32 below an amax of 3.16e-35, and it came out all zeros);
  a finite value near float32's largest stays finite in MXFP4 and MXFP8
  (one that rounds up to 2**128 came out inf)."""

  @parameterized.parameters(3.1e-35, 1e-36, 1e-37)
  def test_a_tiny_nvfp4_tensor_keeps_its_relative_values(self, amax):
    y = _tiny_test_tensor()
    x = y * np.float32(amax)
    self.assertGreaterEqual(np.abs(x[x != 0]).min(), _F32_TINY)
    got = np.asarray(_nvfp4(jnp.asarray(x)), np.float64) / amax
    np.testing.assert_array_equal(got == 0, y == 0)
    np.testing.assert_allclose(got, _nvfp4_reference_f64(y), rtol=1e-6)
    # The other ends as they were: a zero tensor holds zeros, NaN stays.
    np.testing.assert_array_equal(_nvfp4(jnp.zeros_like(x)), 0.0)
    x[3, 5] = np.nan
    self.assertTrue(np.isnan(_nvfp4(jnp.asarray(x))[3, 5]))

  @parameterized.parameters((-115, False, False), (-123, True, False),
                            (-123, False, True))
  def test_a_tiny_nvfp4_tensor_is_its_scaled_up_copy_bit_for_bit(
      self, exponent, stochastic, two_d):
    y = jnp.asarray(_tiny_test_tensor())
    key = jax.random.key(13) if stochastic else None
    quantize = lambda t: _nvfp4(t, key=key, two_d=two_d)
    scale = 2.0**exponent  # 2.4e-35 and 9.4e-38: exact, normal products.
    np.testing.assert_array_equal(quantize(y * scale), quantize(y) * scale)

  def _near_the_top(self) -> np.ndarray:
    """(3, 32): magnitudes from 1.5e38 to float32's largest (3e38 and 3.4e38
    among them; MXFP4 rounds those from 2.98e38 on up to 2**128), random
    signs; a block of ordinary values with inf, -inf and NaN; a zero
    block."""
    rng = np.random.default_rng(14)
    x = np.zeros((3, 32), np.float32)
    x[0] = np.linspace(1.5e38, _F32_MAX, 32) * rng.choice([-1.0, 1.0], 32)
    x[0, :3] = 3e38, 3.4e38, -3.4e38
    x[1] = rng.normal(size=32)
    x[1, :3] = np.inf, -np.inf, np.nan
    return x

  @parameterized.parameters(False, True)
  def test_mxfp4_near_float32s_largest_stays_finite(self, stochastic):
    x = self._near_the_top()
    key = jax.random.key(15) if stochastic else None
    got = np.asarray(_mxfp4(jnp.asarray(x), key=key), np.float64)
    self.assertTrue(np.isfinite(got[0]).all(), got[0])
    if stochastic:  # One of the two E2M1 values around each: 2**126 apart
      # at most (E2M1's step of 1 from 2 to 4, under the scale 2**126).
      np.testing.assert_array_less(np.abs(got[0] - x[0]), 2.0**126)
    else:
      want = _mxfp4_reference(x[:1])[0]  # 2**128 where E2M1 gives 4 * 2**126.
      np.testing.assert_allclose(got[0], want, rtol=2.0**-23)
      np.testing.assert_array_less(np.abs(got[0] - x[0]),
                                   _E2M1_NEAREST_ERROR * np.abs(x[0]))
    np.testing.assert_array_equal(got[1, :2], [np.inf, -np.inf])
    self.assertTrue(np.isnan(got[1, 2]))
    np.testing.assert_array_equal(got[2], 0.0)

  @parameterized.parameters((fp8_scales.E4M3, ml_dtypes.float8_e4m3fn),
                            (fp8_scales.E5M2, ml_dtypes.float8_e5m2))
  def test_mxfp8_near_float32s_largest_stays_finite(self, dtype, reference):
    x = self._near_the_top()
    x[1] = 1.0  # MXFP8 saturates inf (`fp8_scales.quantize`): not this test's.
    x[1, 0] = np.nan
    got = np.asarray(_mx_quantize_dequantize(jnp.asarray(x), dtype, 1),
                     np.float64)
    self.assertTrue(np.isfinite(got[0]).all(), got[0])
    np.testing.assert_allclose(got[0], _mx_reference_f64(x[:1], reference)[0],
                               rtol=2.0**-23)
    self.assertTrue(np.isnan(got[1, 0]))
    np.testing.assert_array_equal(got[2], 0.0)


@functools.partial(jax.jit, static_argnums=0)
def _products(config, x, w, g, key_bits, signs):
  """`fp4.matmul`'s product and gradients (given the output gradient `g`)."""
  out, vjp = jax.vjp(
      lambda x, w: fp4.matmul(config, jnp.float32, x, w, key_bits, signs),
      x, w)
  return (out, *vjp(g))


@functools.partial(jax.jit, static_argnums=0)
def _reference_products(config, x, w, g, key_bits, signs):
  """The three GEMMs of `_products` on the operands as `config` holds them,
  written out: the weight in tiles, the gradients drawn from the step key's
  two halves, the weight gradient's operands through the Hadamard
  transform as a GEMM."""
  dot = lambda a, b: jnp.dot(a, b, precision='highest')
  qw = config.quantized(w, 0, two_d=True)
  dgrad_key, wgrad_key = jax.random.split(jax.random.wrap_key_data(key_bits))
  h = fp4_blocks.signed_hadamard(signs)
  xt, gt = (_transform_blocks(t, h, 0) for t in (x, g))
  return (dot(config.quantized(x, 1), qw),
          dot(config.quantized(g, 1, dgrad_key), qw.T),
          dot(config.quantized(xt, 0).T, config.quantized(gt, 0, wgrad_key)))


@helpers.long_running
class MatmulTest(parameterized.TestCase):

  def _operands(self):
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(32, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(64, 32)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.normal(size=(32, 32)) * 1e-3, jnp.float32)
    signs = jnp.where(jax.random.bernoulli(jax.random.key(9), 0.5, (16,)),
                      1.0, -1.0)
    return x, w, g, signs, jax.random.key_data(jax.random.key(10))

  @parameterized.parameters('nvfp4', 'mxfp4')
  def test_every_gemm_takes_the_operands_as_the_format_holds_them(self, fmt):
    x, w, g, signs, key_bits = self._operands()
    config = fp4.Fp4(fmt)
    out, dx, dw = _products(config, x, w, g, key_bits, signs)
    want_out, want_dx, want_dw = _reference_products(config, x, w, g,
                                                     key_bits, signs)
    np.testing.assert_array_equal(out, want_out)
    # The same operands; the sums' order may differ (XLA's dot of a
    # transposed operand), so within float32 rounding.
    close = lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))
    close(dx, want_dx)
    close(dw, want_dw)

  def test_the_step_key_draws_the_gradients_rounding(self):
    x, w, g, signs, key_bits = self._operands()

    def grads(config, bits):
      return _products(config, x, w, g, bits, signs)[1:]

    other = jax.random.key_data(jax.random.key(11))
    config = fp4.Fp4()
    np.testing.assert_array_equal(grads(config, key_bits)[1],
                                  grads(config, key_bits)[1])
    self.assertFalse(np.array_equal(grads(config, key_bits)[1],
                                    grads(config, other)[1]))
    nearest = fp4.Fp4(stochastic_gradients=False)
    np.testing.assert_array_equal(grads(nearest, key_bits)[1],
                                  grads(nearest, other)[1])

  def test_the_signs_gradient_keeps_them(self):
    x, w, _, signs, key_bits = self._operands()
    got = jax.jit(jax.grad(lambda s: jnp.sum(fp4.matmul(
        fp4.Fp4(), jnp.float32, x, w, key_bits, s))))(signs)
    np.testing.assert_array_equal(got, signs)

  @parameterized.parameters(
      (fp4.Fp4('nvfp4'), 64, 40, 48, 'vit/fc1: input features: 40, not a '
       'multiple of 16'),
      (fp4.Fp4('mxfp4'), 64, 64, 16, r'output features \(the input '
       r"gradient's GEMM\): 16, not a multiple of 32"),
      (fp4.Fp4('nvfp4'), 24, 64, 64, 'tokens of a step .*: 24, not a '
       'multiple of 16'))
  def test_sizes_that_blocks_do_not_divide_name_the_setting(
      self, config, tokens, inputs, outputs, message):
    with self.assertRaisesRegex(haiku_mp_errors.ConfigError,
                                '^format=.*' + message):
      fp4.check_dims(config, 'vit/fc1', tokens, inputs, outputs)
    fp4.check_dims(config, 'vit/fc1', 64, 64, 64)  # Whole blocks: fine.


class HadamardTest(absltest.TestCase):

  def test_random_hadamard_is_orthogonal(self):
    h = np.asarray(fp4_blocks.random_hadamard(jax.random.key(5)))
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-6)
    self.assertEqual(set(np.unique(np.abs(h))), {0.25})

  def test_the_weight_gradient_is_unchanged_without_quantization(self):
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(64, 24)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(64, 10)), jnp.float32)
    h = fp4_blocks.random_hadamard(jax.random.key(7))
    hx, hg = (_transform_blocks(t, h, axis=0) for t in (x, g))
    np.testing.assert_allclose(np.asarray(hx.T @ hg), np.asarray(x.T @ g),
                               atol=1e-4)
    self.assertFalse(np.allclose(np.asarray(hx), np.asarray(x)))

  def test_near_equal_tokens_come_out_spread_not_as_a_spike(self):
    """A feature whose 16 tokens share an offset: with the signs applied
    after H (diag(s) @ H), each rotated block is one spike holding all but
    0.01% of its energy beside 15 values E2M1 flushes; with them before H,
    no value holds more than 30%, and fewer than half as many values
    round to zero (those where H @ s cancels the offset)."""
    noise = np.random.default_rng(8).normal(size=(16, 8)).astype(np.float32)
    x = jnp.asarray(10.0 + 0.1 * noise)
    signs = fp4.initial_signs('layer')((16,), jnp.float32)
    spread = _transform_blocks(x, fp4_blocks.signed_hadamard(signs), 0)
    spike = _transform_blocks(x, signs[:, None] * fp4_blocks.hadamard(), 0)
    peak = lambda y: float(jnp.max(jnp.square(y) / jnp.sum(
        jnp.square(y), axis=0)))
    self.assertGreater(peak(spike), 0.9999)
    self.assertLess(peak(spread), 0.3)
    flushed = lambda y: int(jnp.sum(_nvfp4(y, axis=0) == 0))
    self.assertEqual(flushed(spike), 15 * 8)
    self.assertLess(flushed(spread), flushed(spike) / 2)

  def test_sizes_it_cannot_take(self):
    with self.assertRaisesRegex(ValueError, 'power of two'):
      fp4_blocks.hadamard(12)
    with self.assertRaisesRegex(ValueError, 'takes an axis that 16 divides'):
      fp4_blocks.hadamard_transform(jnp.ones((20, 4)), jnp.ones(16), axis=0)


if __name__ == '__main__':
  absltest.main()
