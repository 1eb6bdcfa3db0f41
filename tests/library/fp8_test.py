"""fp8 matmuls: quantization, scales, gradients, delayed histories, MX blocks,
the lowered program's fp8 dots, training, resume and bad input."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import math

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from haiku_mp import errors
from haiku_mp.lab.studies import fp8_gemms
from haiku_mp.model import fp8
from haiku_mp.model import fp8_scales
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

BF16 = 'params=float32,compute=bfloat16,output=float32'
FORMATS = {'e4m3': (fp8_scales.E4M3, ml_dtypes.float8_e4m3fn, 448.0),
           'e5m2': (fp8_scales.E5M2, ml_dtypes.float8_e5m2, 57344.0)}


def _values(limit, seed=0):
  """Normal values over many binades, ties, the largest finite value and
  beyond it, subnormals and zeros."""
  rng = np.random.default_rng(seed)
  spread = rng.standard_normal(2000) * np.exp2(rng.integers(-20, 18, 2000))
  edges = [0.0, -0.0, limit, -limit, limit * 1.02, limit * 4, 1e-9, 2.0**-9,
           2.0**-17, 1.0625, 1.1875, 3.5, 240.0, 232.0]
  return np.concatenate([spread, edges]).astype(np.float32)


def vit_config(modules='*/encoder_block_*', scaling='current', **settings):
  """The tiny two-block ViT in bfloat16 with fp8 Linears in `modules`."""
  config = helpers.tiny_config(BF16, dropout_rate=0.0, num_layers=2)
  config.precision.low_bit.modules = modules
  config.precision.low_bit.scaling = scaling
  config.precision.low_bit.history_length = 4
  config.batch_size = config.eval_batch_size = 8
  return helpers.with_settings(config, settings)


# Compiled whole: run op by op, its operations are a program each.
_mx_quantize_dequantize = jax.jit(fp8_scales.mx_quantize_dequantize,
                                  static_argnums=(1, 2))


def _qdq(x, dtype, scale):
  """float64 of what `fp8_scales.quantize` keeps of `x`."""
  return np.asarray(fp8_scales.quantize(x, dtype, scale), np.float64) * float(scale)


# ---- An independent float64 reference of docs/fp8.md's rules ---------------

TINY = float(np.finfo(np.float32).tiny)  # float32's smallest normal number.
ML_DTYPES = {fp8_scales.E4M3: ml_dtypes.float8_e4m3fn, fp8_scales.E5M2: ml_dtypes.float8_e5m2}


def _limit(dtype):
  return float(ml_dtypes.finfo(ML_DTYPES[dtype]).max)


def _ref_exponent(amax, dtype, margin=0, low=-126, high=126):
  """The smallest k with amax * 2**margin <= max * 2**k (exact comparisons
  in float64), clipped to [low, high]; 0 for a zero or non-finite amax; a
  subnormal amax counts as float32's smallest normal number."""
  amax = float(amax)
  if not (math.isfinite(amax) and amax > 0):
    return 0
  amax = max(amax, TINY) * 2.0 ** margin
  k = math.ceil(math.log2(amax / _limit(dtype)))
  while amax > _limit(dtype) * 2.0 ** k:
    k += 1
  while amax <= _limit(dtype) * 2.0 ** (k - 1):
    k -= 1
  return min(max(k, low), high)


def _ref_round(v, dtype):
  """float64 `v` rounded to nearest even in `dtype`, saturated, as float64:
  compared exactly with the midpoints of the format's grid."""
  grid = np.arange(256, dtype=np.uint8).view(ML_DTYPES[dtype])
  grid = np.unique(np.abs(grid[np.isfinite(grid.astype(np.float64))]
                          .astype(np.float64)))
  codes = np.array([np.float64(g).astype(ML_DTYPES[dtype]).view(np.uint8)
                    for g in grid])
  a = np.minimum(np.abs(v), grid[-1])
  i = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
  lo, hi, mid = grid[i - 1], grid[i], (grid[i - 1] + grid[i]) / 2
  down = (a < mid) | ((a == mid) & (codes[i - 1] % 2 == 0))
  return np.sign(v) * np.where(a >= hi, hi, np.where(down, lo, hi))


def _ref_q(t, dtype, scale):
  """float64 of the format's values that q keeps of `t` at `scale`
  (unscaled): the exact quotient rounded (the float64 quotient of two
  float32 numbers falls on a midpoint exactly when the exact one does)."""
  return _ref_round(np.asarray(t, np.float64) / scale, dtype)


def _ref_tensor_scale(t, dtype, margin=0):
  return 2.0 ** _ref_exponent(np.abs(np.asarray(t, np.float64)).max(), dtype,
                              margin)


def _ref_mx(t, dtype, axis):
  """`t` as MX blocks of 32 along `axis` hold it (float64): E8M0 scales
  2**ceil(log2(amax / max)) from 2**-127."""
  t = np.moveaxis(np.asarray(t, np.float64), axis, -1)
  pad = -t.shape[-1] % fp8_scales.MX_BLOCK
  blocks = np.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, pad)]).reshape(
      *t.shape[:-1], -1, fp8_scales.MX_BLOCK)
  scales = np.vectorize(lambda a: 2.0 ** _ref_exponent(
      a, dtype, low=-127, high=127))(np.abs(blocks).max(-1))[..., None]
  held = (_ref_round(blocks / scales, dtype) * scales).reshape(
      *t.shape[:-1], -1)[..., :t.shape[-1]]
  return np.moveaxis(held, -1, axis)


def _assert_products(test, got, want, bound, k):
  """`got` (float32 sums of `k` products) is `want` to float32 rounding
  of the sums (`bound`: the sums of the products' magnitudes) where `want`
  is a normal float32 number, and below the normal range where it is not
  (XLA:CPU flushes subnormals, a GPU may keep them)."""
  got = np.asarray(got, np.float64)
  normal = np.abs(want) >= TINY
  error = np.abs(got - want)[normal] / (k * 2.0**-24 * bound[normal])
  test.assertLessEqual(np.max(error, initial=0.0), 1.0,
                       (got[normal][:4], want[normal][:4]))
  test.assertTrue((np.abs(got[~normal]) <= TINY).all())


class QuantizeTest(parameterized.TestCase):

  @parameterized.parameters('e4m3', 'e5m2')
  def test_casts_as_ml_dtypes_does_and_saturates(self, name):
    dtype, ml_dtype, limit = FORMATS[name]
    self.assertEqual(fp8_scales.max_finite(dtype), limit)
    x = _values(limit)
    ours = np.asarray(fp8_scales.quantize(jnp.asarray(x), dtype, jnp.float32(1.0)))
    want = np.clip(x, -limit, limit).astype(ml_dtype)
    np.testing.assert_array_equal(ours.view(np.uint8), want.view(np.uint8))
    # Beyond the range: the largest finite value, never inf or NaN.
    big = np.array([limit * 3, -limit * 3, np.inf, -np.inf], np.float32)
    out = np.asarray(fp8_scales.quantize(jnp.asarray(big), dtype, jnp.float32(1.0)),
                     np.float32)
    np.testing.assert_array_equal(out, [limit, -limit, limit, -limit])

  @parameterized.parameters('e4m3', 'e5m2')
  def test_scales_are_the_smallest_powers_of_two_that_hold_the_amax(
      self, name):
    """2**ceil(log2(amax * 2**margin / max)) from 2**-126, against exact
    comparisons in float64: amaxes over float32's range, at and beside the
    binades' edges, tiny, subnormal, zero and not finite."""
    dtype, _, limit = FORMATS[name]
    rng = np.random.default_rng(5)
    amaxes = np.exp2(rng.uniform(-149, 127, 300)).astype(np.float32)
    edges = np.float32(limit) * np.exp2(np.arange(-140.0, 100, 7)).astype(
        np.float32)
    amaxes = np.concatenate([
        amaxes, edges, np.nextafter(edges, np.float32(np.inf)),
        np.nextafter(edges, np.float32(0)),
        [1e-36, 1e-20, 3.0, 0.0, 1e-40, 1e-45, np.inf, np.nan,
         np.finfo(np.float32).max]]).astype(np.float32)
    for margin in (0, 1, 3):
      got = np.asarray(jax.jit(lambda a, m=margin: fp8_scales.scale_from_amax(
          a, dtype, m))(jnp.asarray(amaxes)))
      want = np.array([2.0 ** _ref_exponent(a, dtype, margin)
                       for a in amaxes], np.float32)
      np.testing.assert_array_equal(got, want, f'margin {margin}')
      # Nothing saturates, and the amax lands in the top half of the range.
      held = amaxes.astype(np.float64) * 2.0**margin / got
      normal = np.isfinite(amaxes) & (amaxes >= TINY) & (got > TINY)
      self.assertTrue((held[normal] <= limit).all())
      self.assertTrue((held[normal & (got < 2.0**126)] > limit / 2).all())

  @parameterized.parameters('e4m3', 'e5m2')
  def test_ties_round_to_even_however_xla_divides(self, name):
    """q(t) is the exact quotient t / s rounded to nearest even, and so is
    t * (1 / s), which XLA:CPU computes instead: bfloat16 weights, whose
    extra bits make many exact ties."""
    dtype, _, limit = FORMATS[name]
    rng = np.random.default_rng(4)
    # An amax of limit * 7 * 2**-18: amax / limit, 7 * 2**-18, would be a
    # scale whose quotients fall on many midpoints and whose inexact
    # reciprocal moves thousands of them off.
    amax = limit * 7 * 2.0**-18
    w = np.clip(rng.standard_normal((384, 384)) * amax / 4, -amax, amax)
    w[0, 0] = amax
    w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    scale = fp8_scales.scale_from_amax(fp8_scales.amax(jnp.asarray(w)), dtype)
    got = np.asarray(jax.jit(fp8_scales.quantize, static_argnums=1)(
        jnp.asarray(w), dtype, scale), np.float64)
    want = _ref_q(w, dtype, float(scale))
    np.testing.assert_array_equal(got, want)
    reciprocal = np.float32(1) / np.asarray(scale, np.float32)
    np.testing.assert_array_equal(
        _ref_round((w * reciprocal).astype(np.float64), dtype), want)
    # Many of them ties: a hair less would round the other way.
    quotient = w.astype(np.float64) / float(scale)
    ties = np.sum(_ref_round(quotient, dtype) != _ref_round(
        np.nextafter(quotient, 0), dtype))
    self.assertGreater(ties, 1000)

  def test_zero_tiny_and_nonfinite_amaxes_give_finite_scales(self):
    for amax in (0.0, np.nan, np.inf):
      self.assertEqual(float(fp8_scales.scale_from_amax(jnp.float32(amax), fp8_scales.E4M3)),
                       1.0, amax)
    tiny = jnp.float32(1e-44)  # A float32 subnormal.
    scale = fp8_scales.scale_from_amax(tiny, fp8_scales.E4M3)
    self.assertEqual(float(scale), TINY)
    q = float(fp8_scales.quantize(tiny, fp8_scales.E4M3, scale))
    self.assertTrue(np.isfinite(q))


@helpers.long_running
class MatmulTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(1)
    self.x = rng.standard_normal((48, 64)).astype(np.float32) * 3
    self.w = rng.standard_normal((64, 40)).astype(np.float32) * 0.05
    self.g = rng.standard_normal((48, 40)).astype(np.float32) * 1e-3

  def _vjp(self, matmul):
    return self._vjp_of(self.x, matmul)

  def _vjp_of(self, x, matmul):
    @jax.jit  # One program (op by op, each operation is one).
    def products(x, w, g):
      out, vjp = jax.vjp(matmul, x, w)
      return (out, *vjp(g))

    out, dx, dw = products(jnp.asarray(x), jnp.asarray(self.w),
                           jnp.asarray(self.g))
    return (np.asarray(out, np.float64), np.asarray(dx, np.float64),
            np.asarray(dw, np.float64))

  def test_current_scaling_is_e4m3_forward_and_e5m2_gradients(self):
    """Each product is the float64 product of the operands as E4M3 (and the
    output gradient as E5M2) hold them at their own amaxes' scales: the
    formats and scales are exactly these, with float32 sums."""
    out, dx, dw = self._vjp(
        lambda x, w: fp8.matmul(fp8.Fp8('current'), x, w, jnp.float32))
    s = lambda t, d: fp8_scales.scale_from_amax(fp8_scales.amax(jnp.asarray(t)), d)
    x4 = _qdq(self.x, fp8_scales.E4M3, s(self.x, fp8_scales.E4M3))
    w4 = _qdq(self.w, fp8_scales.E4M3, s(self.w, fp8_scales.E4M3))
    g5 = _qdq(self.g, fp8_scales.E5M2, s(self.g, fp8_scales.E5M2))
    np.testing.assert_allclose(out, x4 @ w4, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, g5 @ w4.T, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(dw, x4.T @ g5, rtol=1e-5, atol=1e-7)
    # Quantizing the gradient as E4M3 would give other products.
    g4 = _qdq(self.g, fp8_scales.E4M3, s(self.g, fp8_scales.E4M3))
    self.assertGreater(np.abs(dx - g4 @ w4.T).max(), 1e-7)

  def test_replicas_of_a_pmap_scale_as_the_whole_batch(self):
    """Current scaling under pmap: each replica's scales come from the
    amaxes of the whole batch (reduced over the axis), so its rows of the
    product and of dx are the whole batch's, and its dw sums to the
    whole's; without the axis each replica scales by its own amaxes."""
    replicas = jax.local_device_count()
    rows = 48 // replicas
    # Each replica's rows in a magnitude of their own, the first 2**-16 of
    # the last: under the whole batch's (power-of-two) scale its values fall
    # among E4M3's subnormals, under its own they do not.
    factors = np.exp2(np.linspace(-16.0, 0.0, replicas))
    x = (self.x * np.repeat(factors, rows)[:, None]).astype(np.float32)
    config = fp8.Fp8('current')

    def products(axis_name):
      def one(x, w, g):
        out, vjp = jax.vjp(lambda x, w: fp8.matmul(
            config, x, w, jnp.float32, axis_name=axis_name), x, w)
        return (out, *vjp(g))
      split = lambda t: t.reshape(replicas, -1, t.shape[-1])
      out, dx, dw = jax.pmap(one, axis_name='batch', in_axes=(0, None, 0))(
          split(x), self.w, split(self.g))
      return out.reshape(48, -1), dx.reshape(48, -1), dw.sum(0)

    whole = self._vjp_of(x, lambda x, w: fp8.matmul(config, x, w,
                                                    jnp.float32))
    for got, want in zip(products('batch'), whole):
      # To float32 rounding of the sums (another order on a replica).
      np.testing.assert_allclose(got, want, rtol=1e-5,
                                 atol=1e-6 * np.abs(want).max())
    alone = products(None)
    self.assertGreater(np.abs(alone[0][:rows] - whole[0][:rows]).max(),
                       1e-2 * np.abs(whole[0][:rows]).max())

  def test_replicas_of_a_pmap_roll_the_whole_batchs_amaxes(self):
    """Delayed scaling under pmap: every replica rolls into its histories
    the amaxes one device would (x's over the whole batch; the output
    gradient's in the units of the whole batch's mean loss, of which a
    replica's is `replicas` times its share), so histories, and the scales
    they give, never depend on the strategy; without the axis, a replica
    rolls its own share's amaxes."""
    replicas = jax.local_device_count()
    # Each replica's rows in a magnitude of their own, as above.
    factors = np.repeat(np.exp2(np.linspace(-16.0, 0.0, replicas)),
                        48 // replicas)[:, None]
    x = (self.x * factors).astype(np.float32)
    g = (self.g * factors).astype(np.float32)
    config = fp8.Fp8('delayed', history_length=4)
    histories = tuple(jnp.array([np.abs(t).max(), 0.0, 0.0, 0.0],
                                jnp.float32) for t in (x, self.w, g))

    def rolled(x, g, axis_name=None):
      _, vjp = jax.vjp(lambda x, w, *h: fp8.matmul(
          config, x, w, jnp.float32, h, axis_name=axis_name),
                       x, jnp.asarray(self.w), *histories)
      return vjp(g)[2:]

    split = lambda t: t.reshape(replicas, -1, t.shape[-1])
    on_replicas = lambda axis: jax.pmap(
        lambda x, g: rolled(x, g, axis), axis_name='batch')(
            split(x), split(g) * replicas)
    whole = rolled(jnp.asarray(x), jnp.asarray(g))
    for got, want in zip(on_replicas('batch'), whole):
      np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))
    x_alone, _, g_alone = on_replicas(None)
    self.assertLess(float(x_alone[0, 0]), float(whole[0][0]) / 2**10)
    self.assertLess(float(g_alone[0, 0]), float(whole[2][0]) / 2**10)

  @parameterized.parameters('current', 'delayed', 'mx')
  def test_products_and_gradients_against_float64(self, scaling):
    """Within the formats' error of the exact products: E4M3 keeps 3
    mantissa bits (relative error at most 1/16 per value), E5M2 2 (1/8)."""
    histories = None
    if scaling == 'delayed':
      # Histories that saw these tensors' amaxes last step.
      histories = tuple(jnp.array([np.abs(t).max(), 0.0, 0.0, 0.0],
                                  jnp.float32)
                        for t in (self.x, self.w, self.g))
    config = fp8.Fp8(scaling, history_length=4)
    out, dx, dw = self._vjp(
        lambda x, w: fp8.matmul(config, x, w, jnp.float32, histories))
    x, w, g = (t.astype(np.float64) for t in (self.x, self.w, self.g))
    rel = lambda got, want: np.linalg.norm(got - want) / np.linalg.norm(want)
    self.assertLess(rel(out, x @ w), 0.06)
    self.assertLess(rel(dx, g @ w.T), 0.1)
    self.assertLess(rel(dw, x.T @ g), 0.1)
    self.assertGreater(rel(dx, g @ w.T), 1e-4)  # Really quantized.


def _signed_uniform(rng, shape, magnitude):
  """Values of both signs with magnitudes in [magnitude / 8, magnitude]: a
  tiny tensor holds no subnormal unless `magnitude` is one (XLA:CPU reads a
  subnormal input as zero)."""
  values = rng.uniform(0.125, 1.0, shape) * rng.choice([-1.0, 1.0], shape)
  return (values * magnitude).astype(np.float32)


# (x, w, g) magnitudes: products and gradients that are normal float32
# numbers while a scale, or the product of two, is not; and a subnormal x.
_EDGES = dict(
    tiny_x=(1e-36, 0.05, 1.0),
    tiny_x_and_w=(1e-20, 1e-15, 1e3),
    tiny_g=(1.0, 0.05, 1e-36),
    subnormal_x=(1e-40, 0.05, 1.0))


class BottomOfTheRangeTest(parameterized.TestCase):
  """Forward and gradients at tiny amaxes against a float64 reference of
  the rules (docs/fp8.md): a representable (normal) result is never
  flushed, whatever the scales' product."""

  def _reference(self, scaling, x, w, g):
    """(out, dx, dw) and each's sum of magnitudes, in float64."""
    if scaling == 'mx':
      x4, w4 = _ref_mx(x, fp8_scales.E4M3, 1), _ref_mx(w, fp8_scales.E4M3, 0)
      g5_dx, w4_dx = _ref_mx(g, fp8_scales.E5M2, 1), _ref_mx(w, fp8_scales.E4M3, 1)
      x4_dw, g5_dw = _ref_mx(x, fp8_scales.E4M3, 0), _ref_mx(g, fp8_scales.E5M2, 0)
    else:
      scales = [_ref_tensor_scale(t, f) for t, f in
                ((x, fp8_scales.E4M3), (w, fp8_scales.E4M3), (g, fp8_scales.E5M2))]
      x4, w4, g5 = (_ref_q(t, f, s) * s for t, f, s in zip(
          (x, w, g), (fp8_scales.E4M3, fp8_scales.E4M3, fp8_scales.E5M2), scales))
      g5_dx, w4_dx, x4_dw, g5_dw = g5, w4, x4, g5
    pairs = ((x4, w4), (g5_dx, w4_dx.T), (x4_dw.T, g5_dw))
    return [(a @ b, np.abs(a) @ np.abs(b)) for a, b in pairs]

  @parameterized.parameters(*fp8.SCALINGS)
  def test_tiny_amaxes_against_float64(self, scaling):
    for case, magnitudes in _EDGES.items():
      with self.subTest(case):
        self._check_edge(scaling, case, magnitudes)

  def _check_edge(self, scaling, case, magnitudes):
    rng = np.random.default_rng(6)
    x, w, g = (_signed_uniform(rng, shape, m) for shape, m in zip(
        ((8, 64), (64, 16), (8, 16)), magnitudes))
    histories = None
    if scaling == 'delayed':
      # Histories that saw these tensors' amaxes: current scaling's scales.
      histories = tuple(jnp.array([np.abs(t).max(), 0.0], jnp.float32)
                        for t in (x, w, g))
    config = fp8.Fp8(scaling, history_length=2)

    @jax.jit
    def run(x, w, g, histories):
      out, vjp = jax.vjp(lambda x, w: fp8.matmul(
          config, x, w, jnp.float32, histories), x, w)
      return (out, *vjp(g)[:2])

    got = run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), histories)
    want = self._reference(scaling, x, w, g)
    for name, value, (exact, bound), k in zip(
        ('out', 'dx', 'dw'), got, want, (64, 16, 8)):
      self.assertTrue(np.isfinite(np.asarray(value)).all(), name)
      _assert_products(self, value, exact, bound, k)
      # Every result of x is below float32's normal range when x is; all
      # but a few cancellations are normal otherwise.
      normal = np.mean(np.abs(exact) >= TINY)
      if case == 'subnormal_x' and name != 'dx':
        self.assertEqual(normal, 0.0, name)
      else:
        self.assertGreater(normal, 0.75, name)


class DelayedTest(absltest.TestCase):

  def test_histories_roll_with_each_steps_amaxes(self):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32) * 7
    old = [jnp.array([5.0, 4.0, 3.0, 2.0]) * k for k in (1.0, 0.1, 10.0)]

    def f(x, w, hx, hw, hg):
      return fp8.matmul(fp8.Fp8('delayed', 4), x, w, jnp.float32,
                        (hx, hw, hg))

    _, _, hx, hw, hg = jax.jit(lambda *args: jax.vjp(f, *args)[1](g))(
        x, w, *old)
    for new, tensor, before in zip((hx, hw, hg), (x, w, g), old):
      np.testing.assert_array_equal(
          new, np.concatenate([[np.abs(tensor).max()], before[:3]]))

  def test_the_scale_is_the_historys_not_the_tensors(self):
    x = jnp.full((4, 8), 2.0)
    w = jnp.eye(8)
    # A history whose maximum is 4x this step's amax: 8 lands on 256
    # (scale 2**-5, the smallest power of two that holds it), x on a quarter
    # of that, and comes back exactly.
    histories = (jnp.array([8.0, 0.0]), jnp.array([1.0, 0.0]),
                 jnp.array([1.0, 0.0]))
    out = fp8.matmul(fp8.Fp8('delayed', 2), x, w, jnp.float32, histories)
    np.testing.assert_allclose(out, x, rtol=1e-6)
    scale = fp8_scales.scale_from_amax(jnp.float32(8.0), fp8_scales.E4M3)
    self.assertEqual(float(fp8_scales.quantize(jnp.float32(2.0), fp8_scales.E4M3, scale)),
                     64.0)

  def test_a_nonfinite_amax_is_not_recorded(self):
    history = jnp.array([1.0, 6.0, 2.0])
    np.testing.assert_array_equal(fp8_scales.roll_history(history, jnp.float32(
        np.inf)), [6.0, 1.0, 6.0])
    np.testing.assert_array_equal(fp8_scales.roll_history(history, jnp.float32(
        np.nan)), [6.0, 1.0, 6.0])


class MxTest(absltest.TestCase):

  def test_block_scales_against_numpy(self):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    x *= np.repeat(np.exp2(rng.integers(-30, 30, (4, 3))), 32, axis=1)
    x[1, 32:64] = 0.0  # A zero block: scale 1.
    x[2, 64:96] = 1.0
    x[2, 70] = 448.0 * 4  # The largest value exactly: scale 4, not 8.
    scales = np.asarray(fp8_scales.mx_block_scales(jnp.asarray(x), fp8_scales.E4M3, axis=1))
    blocks = np.abs(x.astype(np.float64)).reshape(4, 3, 32).max(-1)
    with np.errstate(divide='ignore'):
      want = np.where(blocks > 0, np.exp2(np.ceil(np.log2(blocks / 448.0))),
                      1.0)
    np.testing.assert_array_equal(scales, want)
    # Rounded up: no block saturates, and each block's amax lands in the
    # format's top binade.
    qdq = np.asarray(_mx_quantize_dequantize(jnp.asarray(x), fp8_scales.E4M3,
                                             1))
    kept = np.abs(x).reshape(4, 3, 32).max(-1) / scales
    self.assertTrue(((kept <= 448.0) & ((kept > 224.0) | (blocks == 0))).all())
    np.testing.assert_allclose(qdq, x, rtol=1 / 16)

  def test_tiny_blocks_keep_their_scales_down_to_2_to_the_minus_127(self):
    """A block's exponent comes from its amax itself, also where amax / 448
    is no normal float32: such blocks dequantize as the float64 reference
    does, bit for bit, instead of to zero."""
    rng = np.random.default_rng(7)
    magnitudes = (1e-36, 2.0**-126 * 448, 3e-36, 1e-30, 2.0**-120, 1.0)
    x = np.concatenate([_signed_uniform(rng, (2, 32), m) for m in magnitudes],
                       axis=1)
    x[:, 32] = 2.0**-126 * 448  # Exactly the amax of scale 2**-126.
    got = _mx_quantize_dequantize(jnp.asarray(x), fp8_scales.E4M3, 1)
    want = _ref_mx(x, fp8_scales.E4M3, 1)
    self.assertTrue((np.abs(want) >= TINY).all())
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    block_amax = np.abs(x).reshape(2, -1, fp8_scales.MX_BLOCK).max(-1)
    want = np.vectorize(lambda a: _ref_exponent(a, fp8_scales.E4M3, low=-127,
                                                high=127))(block_amax)
    self.assertEqual(want[0, 0], -127)
    np.testing.assert_array_equal(
        fp8_scales.mx_block_exponents(jnp.asarray(x), fp8_scales.E4M3, axis=1), want)
    # As float32 scales: normal numbers, 2**-127 as 2**-126.
    np.testing.assert_array_equal(
        fp8_scales.mx_block_scales(jnp.asarray(x), fp8_scales.E4M3, axis=1),
        np.exp2(np.maximum(want, -126)).astype(np.float32))

  def test_a_dimension_that_is_no_multiple_of_the_block_is_padded(self):
    x = jnp.linspace(-3.0, 5.0, 50).reshape(1, 50)
    qdq = _mx_quantize_dequantize(x, fp8_scales.E4M3, axis=1)
    chex.assert_shape(qdq, (1, 50))
    np.testing.assert_allclose(qdq, x, rtol=1 / 16, atol=1e-6)
    # The same values in a block of their own: the same result.
    np.testing.assert_array_equal(
        qdq[:, 32:], _mx_quantize_dequantize(x[:, 32:], fp8_scales.E4M3,
                                             axis=1))


# How XLA:GPU writes a matmul it made a cuBLASLt fp8 GEMM of, and one it left
# in 16 bits (the shapes of its HLO text; no GPU is needed to read them).
_GPU_HLO = """
HloModule jit_train_step, entry_computation_layout={...}

ENTRY %main.9 (p0: f8e4m3fn[128,384], p1: f8e4m3fn[384,384]) -> bf16[128,384] {
  %p0 = f8e4m3fn[128,384]{1,0} parameter(0)
  %p1 = f8e4m3fn[384,384]{1,0} parameter(1)
  %s = f32[] constant(1)
  %cublas-gemm.1 = (f32[128,384]{1,0}, s8[33554432]{0}) custom-call(%p0, %p1, %s, %s), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(train_step)/jvp(vit)/encoder_block_0/attention/query/_fp8_sums/query/fp8_fprop/dot_general" source_file="fp8.py"}, backend_config={"gemm_backend_config":{"alpha_real":1}}
  %b0 = bf16[128,384]{1,0} parameter(2)
  %b1 = bf16[384,1536]{1,0} parameter(3)
  %cublas-gemm.2 = (bf16[128,1536]{1,0}, s8[4194304]{0}) custom-call(%b0, %b1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(vit)/encoder_block_0/mlp_block/fc1/_fp8_sums/fc1/fp8_fprop/dot_general"}
  ROOT %t = (f32[128,384]{1,0}) tuple(%cublas-gemm.1)
}
"""


# XLA 0.11.2's form on an H100 (the fused computations' text as its log
# printed them, shortened): the fprops of query, key and value merged into one
# Triton GEMM over their concatenated fp8 weights; a second Triton GEMM whose
# fp8 operands are converted to bf16 inside the fusion; a bf16 one.
_TRITON_HLO = """
HloModule jit_train_step, entry_computation_layout={...}

%gemm_fusion_dot.48_computation (parameter_0.1: f8e4m3fn[8320,384], parameter_1.1: f8e4m3fn[384,384], parameter_2: f8e4m3fn[384,384], parameter_3: f8e4m3fn[384,384]) -> f32[8320,1152] {
  %parameter_1.1 = f8e4m3fn[384,384]{1,0} parameter(1)
  %parameter_2 = f8e4m3fn[384,384]{1,0} parameter(2)
  %parameter_3 = f8e4m3fn[384,384]{1,0} parameter(3)
  %concatenate.35 = f8e4m3fn[1152,384]{1,0} concatenate(%parameter_1.1, %parameter_2, %parameter_3), dimensions={0}, metadata={op_name="jit(train_step)/jvp(vit)/encoder_block_0/attention/value/_fp8_sums/value/convert_element_type"}
  %bitcast.1846 = f8e4m3fn[384,1152]{0,1} bitcast(%concatenate.35)
  %parameter_0.1 = f8e4m3fn[8320,384]{1,0} parameter(0)
  %dot.202 = f32[1152,8320]{0,1} dot(%bitcast.1846, %parameter_0.1), lhs_contracting_dims={0}, rhs_contracting_dims={1}, metadata={op_name="jit(train_step)/jvp(vit)/encoder_block_0/attention/value/_fp8_sums/value/fp8_fprop/dot_general"}
  ROOT %bitcast.2429 = f32[8320,1152]{1,0} bitcast(%dot.202)
}

%gemm_fusion_dot.49_computation (parameter_0.2: f8e4m3fn[8320,384], parameter_1.2: f8e4m3fn[1536,384]) -> f32[8320,1536] {
  %parameter_0.2 = f8e4m3fn[8320,384]{1,0} parameter(0)
  %convert.7 = bf16[8320,384]{1,0} convert(%parameter_0.2)
  %parameter_1.2 = f8e4m3fn[1536,384]{1,0} parameter(1)
  %convert.8 = bf16[1536,384]{1,0} convert(%parameter_1.2)
  ROOT %dot.203 = f32[8320,1536]{1,0} dot(%convert.7, %convert.8), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(train_step)/jvp(vit)/encoder_block_0/mlp_block/fc1/_fp8_sums/fc1/fp8_fprop/dot_general"}
}

%gemm_fusion_dot_general.200_computation (parameter_0.123: bf16[128,384], parameter_1.123: bf16[128,10]) -> bf16[384,10] {
  %parameter_0.123 = bf16[128,384]{1,0} parameter(0)
  %parameter_1.123 = bf16[128,10]{1,0} parameter(1)
  %dot_general.56 = f32[384,10]{1,0} dot(%parameter_0.123, %parameter_1.123), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(vit))/head/no,ni->io/dot_general"}
  ROOT %convert_element_type.306 = bf16[384,10]{1,0} convert(%dot_general.56)
}

ENTRY %main.9 (p0: f8e4m3fn[8320,384], p1: f8e4m3fn[384,384], p2: f8e4m3fn[384,384], p3: f8e4m3fn[384,384], p4: f8e4m3fn[1536,384], b0: bf16[128,384], b1: bf16[128,10]) -> f32[8320,1152] {
  %p0 = f8e4m3fn[8320,384]{1,0} parameter(0)
  %p1 = f8e4m3fn[384,384]{1,0} parameter(1)
  %p2 = f8e4m3fn[384,384]{1,0} parameter(2)
  %p3 = f8e4m3fn[384,384]{1,0} parameter(3)
  %p4 = f8e4m3fn[1536,384]{1,0} parameter(4)
  %b0 = bf16[128,384]{1,0} parameter(5)
  %b1 = bf16[128,10]{1,0} parameter(6)
  %gemm_fusion_dot.48 = f32[8320,1152]{1,0} fusion(%p0, %p1, %p2, %p3), kind=kCustom, calls=%gemm_fusion_dot.48_computation, metadata={op_name="jit(train_step)/jvp(vit)/encoder_block_0/attention/value/_fp8_sums/value/fp8_fprop/dot_general"}, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64"}}}
  %gemm_fusion_dot.49 = f32[8320,1536]{1,0} fusion(%p0, %p4), kind=kCustom, calls=%gemm_fusion_dot.49_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %gemm_fusion_dot_general.200 = bf16[384,10]{1,0} fusion(%b0, %b1), kind=kCustom, calls=%gemm_fusion_dot_general.200_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %t = (f32[8320,1152]{1,0}) tuple(%gemm_fusion_dot.48)
}
"""


# The nested form newer XLA prints (its kTritonNestedGemmFusionKind): the
# dot's operands are fusions of their own inside the GEMM fusion. The first
# keeps out's dgrad operands in fp8; the second widens one to bf16.
_NESTED_TRITON_HLO = """
HloModule jit_train_step, entry_computation_layout={...}

%flhs.1 (p.0: f8e5m2[8320,384]) -> f8e5m2[8320,384] {
  ROOT %p.0 = f8e5m2[8320,384]{1,0} parameter(0)
}

%frhs.1 (p.1: f8e4m3fn[384,384]) -> f8e4m3fn[384,384] {
  ROOT %p.1 = f8e4m3fn[384,384]{1,0} parameter(0)
}

%gemm_fusion_dot.7_computation (parameter_0: f8e5m2[8320,384], parameter_1: f8e4m3fn[384,384]) -> f32[8320,384] {
  %parameter_0 = f8e5m2[8320,384]{1,0} parameter(0)
  %lhs.1 = f8e5m2[8320,384]{1,0} fusion(%parameter_0), kind=kCustom, calls=%flhs.1, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"output_tiles":[{"sizes":["64","64"]}]}}}
  %parameter_1 = f8e4m3fn[384,384]{1,0} parameter(1)
  %rhs.1 = f8e4m3fn[384,384]{1,0} fusion(%parameter_1), kind=kCustom, calls=%frhs.1, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"output_tiles":[{"sizes":["64","64"]}]}}}
  ROOT %dot.9 = f32[8320,384]{1,0} dot(%lhs.1, %rhs.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(vit))/encoder_block_0/attention/out/_fp8_sums/out/fp8_dgrad/dot_general"}
}

%fwide.2 (p.2: f8e5m2[8320,384]) -> bf16[8320,384] {
  %p.2 = f8e5m2[8320,384]{1,0} parameter(0)
  ROOT %c.2 = bf16[8320,384]{1,0} convert(%p.2)
}

%frhs.2 (p.3: bf16[384,384]) -> bf16[384,384] {
  ROOT %p.3 = bf16[384,384]{1,0} parameter(0)
}

%gemm_fusion_dot.8_computation (parameter_0.2: f8e5m2[8320,384], parameter_1.2: bf16[384,384]) -> f32[8320,384] {
  %parameter_0.2 = f8e5m2[8320,384]{1,0} parameter(0)
  %lhs.2 = bf16[8320,384]{1,0} fusion(%parameter_0.2), kind=kCustom, calls=%fwide.2, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %parameter_1.2 = bf16[384,384]{1,0} parameter(1)
  %rhs.2 = bf16[384,384]{1,0} fusion(%parameter_1.2), kind=kCustom, calls=%frhs.2, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %dot.10 = f32[8320,384]{1,0} dot(%lhs.2, %rhs.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(train_step)/transpose(jvp(vit))/encoder_block_0/attention/query/_fp8_sums/query/fp8_dgrad/dot_general"}
}

ENTRY %main.3 (a: f8e5m2[8320,384], w: f8e4m3fn[384,384], v: bf16[384,384]) -> f32[8320,384] {
  %a = f8e5m2[8320,384]{1,0} parameter(0)
  %w = f8e4m3fn[384,384]{1,0} parameter(1)
  %v = bf16[384,384]{1,0} parameter(2)
  %gemm_fusion_dot.7 = f32[8320,384]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm_fusion_dot.7_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"num_warps":"4","output_tiles":[{"sizes":["64","64"]}],"num_ctas":1,"num_stages":3}}}
  %gemm_fusion_dot.8 = f32[8320,384]{1,0} fusion(%a, %v), kind=kCustom, calls=%gemm_fusion_dot.8_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %t = (f32[8320,384]{1,0}) tuple(%gemm_fusion_dot.7)
}
"""


class Fp8ListingTest(absltest.TestCase):

  def test_a_gpu_programs_fp8_gemms_are_told_from_its_16_bit_ones(self):
    found = fp8_gemms.hlo_matmuls(_GPU_HLO)
    self.assertEqual([(f['target'], f['operands']) for f in found], [
        (fp8_gemms.FP8_GEMM_TARGET, ['f8e4m3fn', 'f8e4m3fn']),
        ('__cublas$lt$matmul', ['bf16', 'bf16'])])
    paths = ['vit', 'vit/encoder_block_0', 'vit/encoder_block_0/attention',
             'vit/encoder_block_0/attention/query',
             'vit/encoder_block_0/mlp_block/fc1']
    self.assertEqual(fp8_gemms.locate(found[0]['op_name'], paths),
                     ('vit/encoder_block_0/attention/query', 'fprop'))
    row = dict(fp8_operands=True)
    self.assertEqual(fp8_gemms.verdict(row, found[:1], 'gpu'),
                     'fp8 GEMM (cuBLASLt)')
    self.assertIn('NOT an fp8 GEMM', fp8_gemms.verdict(row, found[1:], 'gpu'))
    self.assertIn('emulated', fp8_gemms.verdict(row, found[1:], 'cpu'))

  def test_a_triton_gemm_on_fp8_operands_is_an_fp8_gemm(self):
    found = fp8_gemms.hlo_matmuls(_TRITON_HLO)
    self.assertEqual([(f['target'], f['operands']) for f in found], [
        (fp8_gemms.TRITON_GEMM, ['f8e4m3fn', 'f8e4m3fn']),
        (fp8_gemms.TRITON_GEMM, ['bf16', 'bf16']),
        (fp8_gemms.TRITON_GEMM, ['bf16', 'bf16'])])
    self.assertEqual([fp8_gemms.is_fp8_gemm(f) for f in found],
                     [True, False, False])
    row = dict(fp8_operands=True)
    self.assertEqual(fp8_gemms.verdict(row, found[:1], 'gpu'),
                     'fp8 GEMM (Triton)')
    # fc1's fp8 operands widened to bf16 inside the fusion: a bf16 GEMM.
    self.assertIn('NOT an fp8 GEMM', fp8_gemms.verdict(row, found[1:2], 'gpu'))
    # query's fprop ran inside value's merged GEMM: none of its own.
    self.assertIn('merged', fp8_gemms.verdict(row, [], 'gpu'))

  def test_a_nested_triton_gemm_on_fp8_operands_is_an_fp8_gemm(self):
    found = fp8_gemms.hlo_matmuls(_NESTED_TRITON_HLO)
    self.assertEqual([(f['target'], f['operands']) for f in found], [
        (fp8_gemms.TRITON_NESTED_GEMM, ['f8e5m2', 'f8e4m3fn']),
        (fp8_gemms.TRITON_NESTED_GEMM, ['bf16', 'bf16'])])
    row = dict(fp8_operands=True)
    self.assertEqual(fp8_gemms.verdict(row, found[:1], 'gpu'),
                     'fp8 GEMM (Triton)')
    widened = fp8_gemms.verdict(row, found[1:], 'gpu')
    self.assertIn('NOT an fp8 GEMM', widened)
    self.assertIn('on bf16 x bf16', widened)

  def test_a_dot_outside_a_triton_fusion_is_not_called_one(self):
    plain = _TRITON_HLO.replace('"kind":"__triton_gemm"', '"kind":"__other"')
    self.assertEqual({f['target'] for f in fp8_gemms.hlo_matmuls(plain)},
                     {''})


class BadTargetsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('matches_nothing', '*/decoder_*',
       "precision.low_bit.modules: target '*/decoder_*' matches no module class "
       'or module path'),
      ('bare_name', 'fc1',
       "precision.low_bit.modules: target 'fc1' matches no module class or "
       "module path (for a module path ending in it, write '*/fc1')"),
      ('no_linear', 'LayerNorm',
       "precision.low_bit.modules: target 'LayerNorm' selects no Linear "
       '(LayerNorm): only Linear layers run fp8 matmuls'),
      ('patch_embedding', '*/patch_embed/conv',
       "precision.low_bit.modules: target '*/patch_embed/conv' selects no Linear "
       '(Conv2D)'))
  def test_one_line_before_anything_compiles(self, modules, message):
    with self.assertRaises(errors.ConfigError) as raised:
      experiment.build_without_data(settings_lib.parse(vit_config(modules)))
    self.assertIn(message, str(raised.exception))
    self.assertNotIn('\n', str(raised.exception))


if __name__ == '__main__':
  absltest.main()
