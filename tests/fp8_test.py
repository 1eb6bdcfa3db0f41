"""fp8 matmuls: quantization, scales, gradients, delayed histories, MX blocks,
the lowered program's fp8 dots, training, resume and bad input."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import json
import signal
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from haiku_mp import errors
from haiku_mp.model import fp8
from haiku_mp.studies import fp8_gemms
from haiku_mp.train import experiment
from haiku_mp.update import step as step_lib
from tests import helpers

BF16 = 'params=float32,compute=bfloat16,output=float32'
FORMATS = {'e4m3': (fp8.E4M3, ml_dtypes.float8_e4m3fn, 448.0),
           'e5m2': (fp8.E5M2, ml_dtypes.float8_e5m2, 57344.0)}
BLOCK_LINEARS = ('attention/query', 'attention/key', 'attention/value',
                 'attention/out', 'mlp_block/fc1', 'mlp_block/fc2')


def _values(limit, seed=0):
  """Normal values over many binades, ties, the largest finite value and
  beyond it, subnormals and zeros."""
  rng = np.random.default_rng(seed)
  spread = rng.standard_normal(2000) * np.exp2(rng.integers(-20, 18, 2000))
  edges = [0.0, -0.0, limit, -limit, limit * 1.02, limit * 4, 1e-9, 2.0**-9,
           2.0**-17, 1.0625, 1.1875, 3.5, 240.0, 232.0]
  return np.concatenate([spread, edges]).astype(np.float32)


def _config(modules='*/encoder_block_*', scaling='current', **settings):
  config = helpers.tiny_config(BF16, dropout_rate=0.0, num_layers=2)
  config.precision.fp8.modules = modules
  config.precision.fp8.scaling = scaling
  config.precision.fp8.history_length = 4
  config.batch_size = config.eval_batch_size = 8
  return helpers.with_settings(config, settings)


def _qdq(x, dtype, scale):
  """float64 of what `fp8.quantize` keeps of `x`."""
  return np.asarray(fp8.quantize(x, dtype, scale), np.float64) * float(scale)


class QuantizeTest(parameterized.TestCase):

  @parameterized.parameters('e4m3', 'e5m2')
  def test_casts_as_ml_dtypes_does_and_saturates(self, name):
    dtype, ml_dtype, limit = FORMATS[name]
    self.assertEqual(fp8.max_finite(dtype), limit)
    x = _values(limit)
    ours = np.asarray(fp8.quantize(jnp.asarray(x), dtype, jnp.float32(1.0)))
    want = np.clip(x, -limit, limit).astype(ml_dtype)
    np.testing.assert_array_equal(ours.view(np.uint8), want.view(np.uint8))
    # Beyond the range: the largest finite value, never inf or NaN.
    big = np.array([limit * 3, -limit * 3, np.inf, -np.inf], np.float32)
    out = np.asarray(fp8.quantize(jnp.asarray(big), dtype, jnp.float32(1.0)),
                     np.float32)
    np.testing.assert_array_equal(out, [limit, -limit, limit, -limit])

  @parameterized.parameters('e4m3', 'e5m2')
  def test_a_scale_maps_the_amax_to_the_largest_value_less_the_margin(
      self, name):
    dtype, _, limit = FORMATS[name]
    scale = fp8.scale_from_amax(jnp.float32(3.0), dtype)
    self.assertEqual(float(fp8.quantize(jnp.float32(3.0), dtype, scale)),
                     limit)
    halved = fp8.scale_from_amax(jnp.float32(3.0), dtype, margin=1.0)
    self.assertEqual(float(fp8.quantize(jnp.float32(3.0), dtype, halved)),
                     limit / 2)

  def test_zero_tiny_and_nonfinite_amaxes_give_finite_scales(self):
    for amax in (0.0, np.nan, np.inf):
      self.assertEqual(float(fp8.scale_from_amax(jnp.float32(amax), fp8.E4M3)),
                       1.0, amax)
    tiny = jnp.float32(1e-44)  # A float32 subnormal.
    scale = fp8.scale_from_amax(tiny, fp8.E4M3)
    self.assertTrue(np.isfinite(float(scale)) and float(scale) > 0)
    q = float(fp8.quantize(tiny, fp8.E4M3, scale))
    self.assertTrue(np.isfinite(q))


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
    out, vjp = jax.vjp(matmul, jnp.asarray(x), jnp.asarray(self.w))
    dx, dw = vjp(jnp.asarray(self.g))
    return (np.asarray(out, np.float64), np.asarray(dx, np.float64),
            np.asarray(dw, np.float64))

  def test_current_scaling_is_e4m3_forward_and_e5m2_gradients(self):
    """Each product is the float64 product of the operands as E4M3 (and the
    output gradient as E5M2) hold them at their own amaxes' scales: the
    formats and scales are exactly these, with float32 sums."""
    out, dx, dw = self._vjp(
        lambda x, w: fp8.matmul(fp8.Fp8('current'), x, w, jnp.float32))
    s = lambda t, d: fp8.scale_from_amax(fp8.amax(jnp.asarray(t)), d)
    x4 = _qdq(self.x, fp8.E4M3, s(self.x, fp8.E4M3))
    w4 = _qdq(self.w, fp8.E4M3, s(self.w, fp8.E4M3))
    g5 = _qdq(self.g, fp8.E5M2, s(self.g, fp8.E5M2))
    np.testing.assert_allclose(out, x4 @ w4, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, g5 @ w4.T, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(dw, x4.T @ g5, rtol=1e-5, atol=1e-7)
    # Quantizing the gradient as E4M3 would give other products.
    g4 = _qdq(self.g, fp8.E4M3, s(self.g, fp8.E4M3))
    self.assertGreater(np.abs(dx - g4 @ w4.T).max(), 1e-7)

  def test_replicas_of_a_pmap_scale_as_the_whole_batch(self):
    """Current scaling under pmap: each replica's scales come from the
    amaxes of the whole batch (reduced over the axis), so its rows of the
    product and of dx are the whole batch's, and its dw sums to the
    whole's; without the axis each replica scales by its own amaxes."""
    replicas = jax.local_device_count()
    # Each replica's rows in a magnitude of their own: their amaxes differ.
    x = (self.x * np.repeat(4.0 ** np.arange(replicas), 48 // replicas)[:, None]
         ).astype(np.float32)
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
    self.assertGreater(np.abs(alone[0] - whole[0]).max(),
                       1e-3 * np.abs(whole[0]).max())

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

    _, vjp = jax.vjp(f, x, w, *old)
    _, _, hx, hw, hg = vjp(g)
    for new, tensor, before in zip((hx, hw, hg), (x, w, g), old):
      np.testing.assert_array_equal(
          new, np.concatenate([[np.abs(tensor).max()], before[:3]]))

  def test_the_scale_is_the_historys_not_the_tensors(self):
    x = jnp.full((4, 8), 2.0)
    w = jnp.eye(8)
    # A history whose maximum is 4x this step's amax: x quantizes to a
    # quarter of E4M3's largest value, and comes back exactly.
    histories = (jnp.array([8.0, 0.0]), jnp.array([1.0, 0.0]),
                 jnp.array([1.0, 0.0]))
    out = fp8.matmul(fp8.Fp8('delayed', 2), x, w, jnp.float32, histories)
    np.testing.assert_allclose(out, x, rtol=1e-6)
    scale = fp8.scale_from_amax(jnp.float32(8.0), fp8.E4M3)
    self.assertEqual(float(fp8.quantize(jnp.float32(2.0), fp8.E4M3, scale)),
                     112.0)

  def test_a_nonfinite_amax_is_not_recorded(self):
    history = jnp.array([1.0, 6.0, 2.0])
    np.testing.assert_array_equal(fp8.roll_history(history, jnp.float32(
        np.inf)), [6.0, 1.0, 6.0])
    np.testing.assert_array_equal(fp8.roll_history(history, jnp.float32(
        np.nan)), [6.0, 1.0, 6.0])


class MxTest(absltest.TestCase):

  def test_block_scales_against_numpy(self):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    x *= np.repeat(np.exp2(rng.integers(-30, 30, (4, 3))), 32, axis=1)
    x[1, 32:64] = 0.0  # A zero block: scale 1.
    x[2, 64:96] = 1.0
    x[2, 70] = 448.0 * 4  # The largest value exactly: scale 4, not 8.
    scales = np.asarray(fp8.mx_block_scales(jnp.asarray(x), fp8.E4M3, axis=1))
    blocks = np.abs(x.astype(np.float64)).reshape(4, 3, 32).max(-1)
    with np.errstate(divide='ignore'):
      want = np.where(blocks > 0, np.exp2(np.ceil(np.log2(blocks / 448.0))),
                      1.0)
    np.testing.assert_array_equal(scales, want)
    # Rounded up: no block saturates, and each block's amax lands in the
    # format's top binade.
    qdq = np.asarray(fp8.mx_quantize_dequantize(jnp.asarray(x), fp8.E4M3, 1))
    kept = np.abs(x).reshape(4, 3, 32).max(-1) / scales
    self.assertTrue(((kept <= 448.0) & ((kept > 224.0) | (blocks == 0))).all())
    np.testing.assert_allclose(qdq, x, rtol=1 / 16)

  def test_a_dimension_that_is_no_multiple_of_the_block_is_padded(self):
    x = jnp.linspace(-3.0, 5.0, 50).reshape(1, 50)
    qdq = fp8.mx_quantize_dequantize(x, fp8.E4M3, axis=1)
    chex.assert_shape(qdq, (1, 50))
    np.testing.assert_allclose(qdq, x, rtol=1 / 16, atol=1e-6)
    # The same values in a block of their own: the same result.
    np.testing.assert_array_equal(
        qdq[:, 32:], fp8.mx_quantize_dequantize(x[:, 32:], fp8.E4M3, axis=1))


@helpers.long_running
class ModelTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('encoder_blocks', '*/encoder_block_*',
       [f'vit/encoder_block_{i}/{m}' for i in (0, 1) for m in BLOCK_LINEARS]),
      ('one_layer', '*/encoder_block_1/mlp_block/fc1',
       ['vit/encoder_block_1/mlp_block/fc1']),
      ('every_linear', 'Linear',
       [f'vit/encoder_block_{i}/{m}' for i in (0, 1) for m in BLOCK_LINEARS]
       + ['vit/head']))
  def test_the_lowered_step_takes_fp8_exactly_in_the_configured_modules(
      self, modules, expected):
    result = fp8_gemms.run(_config(modules), compile_step=False,
                           log=lambda _: None)
    fp8_rows = [r for r in result['matmuls'] if r['fp8_operands']]
    self.assertEqual(sorted({r['module'] for r in fp8_rows}), sorted(expected))
    formats = {('fprop', 'f8e4m3fn', 'f8e4m3fn'), ('dgrad', 'f8e5m2',
                                                    'f8e4m3fn'),
               ('wgrad', 'f8e4m3fn', 'f8e5m2')}
    for module in expected:
      self.assertEqual({(r['pass'], r['lhs'], r['rhs']) for r in fp8_rows
                        if r['module'] == module}, formats, module)
    self.assertLen(fp8_rows, 3 * len(expected))
    self.assertEqual(result['fp8_linears'], len(expected))
    # Every other matmul (the patch embedding, attention's batched dots, the
    # head unless selected) keeps the compute dtype or float32.
    others = [r for r in result['matmuls'] if not r['fp8_operands']]
    self.assertNotEmpty(others)
    for r in others:
      self.assertIn(r['lhs'], ('bf16', 'f32'), r)

  def test_delayed_histories_are_params_no_optimizer_sees_and_they_roll(self):
    config = _config(scaling='delayed', learning_rate=1e-3)
    exp = experiment.build_without_data(config)
    strategy = exp.strategy
    state = strategy.init_state()
    histories, trained = step_lib.split_fp8(state.params)
    self.assertLen(histories, 12)  # Six Linears in each of two blocks.
    for module in histories.values():
      self.assertEqual(sorted(module), sorted(fp8.META_NAMES))
      for h in module.values():
        chex.assert_shape(h, (4,))
        chex.assert_type(h, jnp.float32)
    # The optimizer's state is that of the trained params alone.
    self.assertEqual(
        len(jax.tree.leaves(state.opt_state)),
        len(jax.tree.leaves(exp.optimizer.init(trained))))
    self.assertNotIn('fp8', ' '.join(exp.param_names))
    losses = []
    for i in range(3):
      batch = helpers.random_batch(config, config.batch_size, seed=i)
      state, metrics = strategy.train_step(state, strategy.place_batch(batch))
      losses.append(float(metrics['loss']))
    histories, _ = step_lib.split_fp8(state.params)
    for module in histories.values():
      for name, h in module.items():
        h = np.asarray(h)
        # Three steps' amaxes, newest first, then the initial zero. The
        # zero-initialized head passes no gradient back at the first step:
        # the output gradients' first amax is 0.
        seen = 2 if name == 'fp8_g_amax_history' else 3
        self.assertTrue((h[:seen] > 0).all() and not h[seen:].any(),
                        (name, h))
    self.assertTrue(np.isfinite(losses).all())

  def test_fp8_models_learn_a_batch_as_the_bfloat16_one_does(self):
    def losses(modules, scaling):
      config = _config(modules, scaling=scaling, learning_rate=3e-3,
                       **{'model.num_layers': 1})
      strategy = experiment.build_without_data(config).strategy
      state = strategy.init_state()
      batch = strategy.place_batch(helpers.random_batch(config, 8, seed=0))
      out = []
      for _ in range(16):
        state, metrics = strategy.train_step(state, batch)
        out.append(float(metrics['loss']))
      return np.array(out)

    bf16 = losses('', 'current')
    self.assertLess(bf16[-1], 0.8 * bf16[0])
    for scaling in fp8.SCALINGS:
      got = losses('*/encoder_block_*', scaling)
      self.assertLess(got[-1], 0.8 * got[0], scaling)
      np.testing.assert_allclose(got, bf16, rtol=0.03, err_msg=scaling)


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
    self.assertEqual(fp8_gemms.verdict(row, found[:1], 'gpu'), 'fp8 GEMM')
    self.assertIn('NOT an fp8 GEMM', fp8_gemms.verdict(row, found[1:], 'gpu'))
    self.assertIn('emulated', fp8_gemms.verdict(row, found[1:], 'cpu'))


class BadTargetsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('matches_nothing', '*/decoder_*',
       "precision.fp8.modules: target '*/decoder_*' matches no module class "
       'or module path'),
      ('bare_name', 'fc1',
       "precision.fp8.modules: target 'fc1' matches no module class or "
       "module path (for a module path ending in it, write '*/fc1')"),
      ('no_linear', 'LayerNorm',
       "precision.fp8.modules: target 'LayerNorm' selects no Linear "
       '(LayerNorm): only Linear layers run fp8 matmuls'),
      ('patch_embedding', '*/patch_embed/conv',
       "precision.fp8.modules: target '*/patch_embed/conv' selects no Linear "
       '(Conv2D)'))
  def test_one_line_before_anything_compiles(self, modules, message):
    with self.assertRaises(errors.ConfigError) as raised:
      experiment.build_without_data(_config(modules))
    self.assertIn(message, str(raised.exception))
    self.assertNotIn('\n', str(raised.exception))


class ResumeTest(absltest.TestCase):

  def test_a_killed_delayed_scaling_run_resumes_bit_exactly(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    flags = ['--config=configs/vit_fp8.py', '--config.data.source=synthetic',
             '--config.precision.fp8.scaling=delayed',
             '--config.precision.fp8.history_length=4',
             '--config.num_train_steps=8', '--config.log_every_steps=1',
             '--config.eval_every_steps=8', '--config.checkpoint_every_steps=4',
             '--config.batch_size=8', '--config.eval_batch_size=8',
             '--config.data.synthetic_eval_examples=8',
             '--config.data.synthetic_train_examples=32',
             f'--config.compilation_cache_dir={tmp}/cache',
             *helpers.TINY_MODEL_FLAGS]
    straight = helpers.run_module('launch.train', *flags,
                                  f'--workdir={tmp}/straight', devices=1,
                                  timeout=300)
    self.assertEqual(straight.returncode, 0, straight.stderr[-3000:])
    self.assertIn('fp8 matmuls: 6 Linear, E4M3 forward, E5M2 gradients, '
                  'delayed (history 4, margin 0) scaling', straight.stderr)
    killed = helpers.run_module(
        'tests.signal_at_step', *flags, f'--workdir={tmp}/resumed',
        devices=1, env={'SIGNAL_AT_STEP': 'KILL:6'}, timeout=300)
    self.assertEqual(killed.returncode, -signal.SIGKILL)
    resumed = helpers.run_module('launch.train', *flags,
                                 f'--workdir={tmp}/resumed', devices=1,
                                 timeout=300)
    self.assertEqual(resumed.returncode, 0, resumed.stderr[-3000:])
    self.assertIn('at step 4.', resumed.stderr)

    def final(run):
      return ocp.StandardCheckpointer().restore(
          f'{tmp}/{run}/checkpoints/8/default')

    def losses(run):
      with open(f'{tmp}/{run}/metrics.jsonl') as f:
        return [e['loss'] for e in map(json.loads, f) if e['split'] == 'train']

    want, got = final('straight'), final('resumed')
    histories = [v for k, v in jax.tree_util.tree_flatten_with_path(want)[0]
                 if 'amax_history' in jax.tree_util.keystr(k)]
    self.assertLen(histories, 3 * 6)  # Three per fp8 Linear, six Linears.
    self.assertTrue(all((np.asarray(h) > 0).all() for h in histories))
    chex.assert_trees_all_equal(got, want)
    self.assertEqual(losses('resumed')[-4:], losses('straight')[-4:])


if __name__ == '__main__':
  absltest.main()
