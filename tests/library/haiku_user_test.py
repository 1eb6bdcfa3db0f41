"""What a user of Haiku models nobody here wrote meets, each handled or one
line: a Haiku state that goes non-finite (the VQ-VAE's codebook in
float16), Haiku state kept in float32, modules whose matmuls haiku_mp does
not run (named by `describe` and the step's first trace), a precision never
applied, and three errors at the user's own call."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import haiku_mp
from haiku_mp import advisor
from haiku_mp.model import module_runs
from haiku_mp.update import loss_scaling
from haiku_mp.update import state_check
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import overview
from tests import helpers

F32 = 'p=f32,c=f32,o=f32'
F16 = 'p=f32,c=f16,o=f32'
BF16 = 'p=f32,c=bf16,o=f32'
PURE_BF16 = 'p=bf16,c=bf16,o=bf16'
VQ = 'vq_vae/vector_quantizer_ema'


class VqVae(hk.Module):
  """dm-haiku's VQ-VAE in small: Linear encoder, VectorQuantizerEMA (whose
  epsilon of 1e-5 is 0 in float16 on XLA:CPU, a subnormal flushed), Linear
  decoder; 512 codes for 64 examples, so most codes go unused."""

  def __call__(self, x, is_training):
    z = hk.Linear(8)(x)
    vq = hk.nets.VectorQuantizerEMA(embedding_dim=8, num_embeddings=512,
                                    commitment_cost=0.25, decay=0.99)
    quantized = vq(z, is_training=is_training)
    recon = hk.Linear(x.shape[-1])(quantized['quantize'])
    return (jnp.mean(jnp.square(recon.astype(jnp.float32) - x)) +
            quantized['loss'].astype(jnp.float32))


def _under(model_class, policy, overrides='', **precision):
  """`model_class()(*args)` under `make_precision(policy, overrides,
  model_class=model_class, **precision)`, to transform."""
  made = haiku_mp.make_precision(policy, overrides, model_class=model_class,
                                 **precision)

  def f(*args):
    with haiku_mp.apply_precision(made):
      return model_class()(*args)

  return f


def _vq_vae(policy, overrides=''):
  forward = hk.transform_with_state(_under(VqVae, policy, overrides))
  loss = haiku_mp.LossWithState(
      lambda p, s, r, b: (lambda out: (out[0], {}, out[1]))(
          forward.apply(p, s, r, b['x'], True)))
  return forward, loss


_DATA = [dict(x=jnp.asarray(np.random.default_rng(i).normal(size=(64, 16)),
                            jnp.float32)) for i in range(4)]


def _train_vq_vae(policy, overrides='', steps=200):
  """The guarded loop of docs/your_model.md: (state, steps run, the
  LossScaleError that stopped it or None)."""
  forward, loss = _vq_vae(policy, overrides)
  params, model_state = forward.init(jax.random.key(0), _DATA[0]['x'], True)
  scaler = haiku_mp.LossScaler('dynamic', initial=2.0**15, period=2000)
  optimizer = optax.adam(1e-3)
  state = haiku_mp.init_train_state(params, optimizer, scaler,
                                    jax.random.key(1), model_state)
  step = jax.jit(haiku_mp.make_train_step(loss, optimizer, scaler))
  for i in range(steps):
    state, metrics = step(state, _DATA[i % 4])
    try:
      scaler.check_metrics(int(state.step), metrics, state)
    except loss_scaling.LossScaleError as e:
      return state, i + 1, e
  return state, steps, None


def _all_finite(tree) -> bool:
  return all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.floating))


class Counter(hk.Module):
  """Keeps a float state that a batch's `poison` flag turns to NaN."""

  def __call__(self, x, poison):
    total = hk.get_state('total', [], jnp.float32, init=jnp.zeros)
    hk.set_state('total', total + jnp.where(poison, jnp.nan, 1.0))
    return hk.Linear(1)(x)


@helpers.long_running
class StateCheckTest(absltest.TestCase):

  def test_a_step_whose_new_state_is_not_finite_is_skipped(self):
    forward = hk.transform_with_state(_under(Counter, F32))
    loss = haiku_mp.LossWithState(lambda p, s, r, b: (lambda out: (
        jnp.mean(jnp.square(out[0])), {}, out[1]))(
            forward.apply(p, s, r, b['x'], b['poison'])))
    x = jnp.ones([4, 3])
    params, model_state = forward.init(jax.random.key(0), x, False)
    scaler = haiku_mp.LossScaler('dynamic', initial=2.0**10)
    optimizer = optax.sgd(0.1)
    state = haiku_mp.init_train_state(params, optimizer, scaler,
                                      jax.random.key(1), model_state)
    step = jax.jit(haiku_mp.make_train_step(loss, optimizer, scaler))
    good, metrics = step(state, dict(x=x, poison=False))
    self.assertTrue(bool(metrics['applied']))
    self.assertEqual(float(good.model_state['counter']['total']), 1.0)
    bad, metrics = step(good, dict(x=x, poison=True))
    self.assertTrue(bool(metrics['grads_finite']))
    self.assertFalse(bool(metrics['state_finite']))
    self.assertFalse(bool(metrics['applied']))
    self.assertEqual(state_check.leaves(good.model_state),
                     ['counter/total'])
    self.assertEqual(list(np.asarray(metrics['nonfinite_state'])), [True])
    self.assertEqual(int(bad.skipped_steps), 1)
    chex.assert_trees_all_equal(bad.params, good.params)
    chex.assert_trees_all_equal(bad.opt_state, good.opt_state)
    chex.assert_trees_all_equal(bad.model_state, good.model_state)
    self.assertEqual(float(bad.loss_scale.scale), 2.0**9)
    # Without dynamic scaling the guard stops at the skip, naming why.
    none = haiku_mp.LossScaler()
    with self.assertRaisesRegex(
        loss_scaling.LossScaleError,
        r"because the new Haiku state of 'counter' was not finite"):
      none.check_metrics(int(bad.step), metrics, bad)

  def test_the_vq_vae_in_float16_stops_in_one_line_naming_the_module(self):
    state, steps, error = _train_vq_vae(F16)
    # Nothing non-finite reached the params or the state, whatever the
    # run did: it never trains on NaN.
    self.assertTrue(_all_finite(state.params))
    self.assertTrue(_all_finite(state.model_state))
    if error is None:  # A CPU that keeps float16's subnormals trains on.
      self.assertLess(int(state.skipped_steps), steps)
      return
    self.assertLess(steps, 200)
    message = str(error)
    self.assertNotIn('\n', message)
    self.assertIn(f"the new Haiku state of '{VQ}' was not finite", message)
    self.assertIn(f"override '{VQ}:p=f32,c=f32,o=f16'", message)
    self.assertEqual(int(state.skipped_steps), steps)

  def test_with_its_override_the_vq_vae_trains_in_float16(self):
    state, steps, error = _train_vq_vae(F16, f'{VQ}:p=f32,c=f32,o=f16',
                                        steps=12)
    self.assertIsNone(error)
    self.assertEqual(int(state.skipped_steps), 0)
    self.assertTrue(_all_finite(state.model_state))
    del steps

  def test_the_advisors_float16_pass_names_the_module_and_writes_its_override(
      self):
    f32_forward, _ = _vq_vae(F32)
    _, f16_loss = _vq_vae(F16)
    params, model_state = f32_forward.init(jax.random.key(0), _DATA[0]['x'],
                                           True)
    loss32 = lambda p, r, b: (f32_forward.apply(p, model_state, r, b['x'],
                                                True)[0], {})
    modules = advisor.measure_model(loss32, params, _DATA[:2],
                                    jax.random.key(2),
                                    float16_loss_fn=f16_loss,
                                    model_state=model_state)
    advice = advisor.judge(modules, advisor.Thresholds(
        max_relative_error=0.01, max_overflow_share=0.0,
        loss_scale_headroom=1.0))
    verdict = advice.verdicts[VQ]
    self.assertEqual(verdict.float16, 'keep-f32')
    self.assertIn('the Haiku state it writes is not finite after a float16 '
                  'step', verdict.reasons['float16'])
    # Only the quantizer, not its averages inside it.
    kept = [p for p, v in advice.verdicts.items() if v.float16 == 'keep-f32']
    self.assertEqual(kept, [VQ])
    self.assertEqual(advisor.overrides(modules, advice, 'float16'),
                     f'{VQ}:params=float32,compute=float32,output=float32')


class StateDtypeTest(absltest.TestCase):

  def test_haiku_state_is_float32_unless_an_override_says_so(self):
    x = jnp.ones([2, 3], jnp.bfloat16)

    def state_dtypes(overrides):
      params, state = hk.transform_with_state(_under(
          Counter, PURE_BF16, overrides)).init(jax.random.key(0), x, False)
      return params['counter/linear']['w'].dtype, state['counter'][
          'total'].dtype

    self.assertEqual(state_dtypes(''), (jnp.bfloat16, jnp.float32))
    self.assertEqual(state_dtypes('Counter:p=bf16,c=bf16,o=bf16'),
                     (jnp.bfloat16, jnp.bfloat16))


class WsConv2D(hk.Conv2D):
  """An NFNet's weight-standardized convolution: `__call__` overridden with
  JAX's own convolution (its standardization left out)."""

  def __call__(self, inputs):
    w = hk.get_parameter(
        'w', (*self.kernel_shape, inputs.shape[-1], self.output_channels),
        inputs.dtype, init=hk.initializers.VarianceScaling(1.0))
    return jax.lax.conv_general_dilated(
        inputs, w, (1, 1), 'SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))


class Net(hk.Module):

  def __call__(self, x):
    x = WsConv2D(16, 3)(x)
    x = hk.Conv2D(16, 3)(x)
    x = hk.Conv2D(32, 4, stride=4, padding='VALID')(x)  # A patch embedding.
    return hk.Linear(10)(x.reshape(x.shape[0], -1))


def _net(policy=BF16, low_bit='Linear', apply=True):
  if not apply:
    return hk.transform(lambda x: Net()(x))
  return hk.transform(_under(
      Net, policy, low_bit=haiku_mp.LowBit(low_bit) if low_bit else None))


class DescribeTest(absltest.TestCase):

  def test_describe_names_the_matmuls_haiku_mp_does_not_run(self):
    rows = {r.path: r for r in haiku_mp.describe(_net(),
                                                 jnp.ones([2, 16, 16, 3]))}
    self.assertEqual(list(rows), ['net/ws_conv2_d', 'net/conv2_d',
                                  'net/conv2_d_1', 'net/linear'])
    # FLOPs exactly: 2 x outputs x (kernel taps x input channels).
    self.assertEqual(rows['net/ws_conv2_d'].flops, 2 * (2 * 16 * 16 * 16) * 27)
    self.assertEqual(rows['net/conv2_d'].flops, 2 * (2 * 16 * 16 * 16) * 144)
    self.assertEqual(rows['net/linear'].flops, 2 * 2 * 512 * 10)
    self.assertAlmostEqual(sum(r.share for r in rows.values()), 1.0)
    for path in ('net/ws_conv2_d', 'net/conv2_d'):
      self.assertFalse(rows[path].runs_haiku_mp, path)
      self.assertEqual(rows[path].forms, ('half x half -> half',))
    self.assertEqual(rows['net/linear'].haiku_mp, ('fp8',))
    self.assertEqual(rows['net/linear'].forms, ('fp8',))
    self.assertTrue(rows['net/conv2_d_1'].runs_haiku_mp)
    self.assertEqual(rows['net/linear'].rule, 'inherited')
    table = module_runs.table(list(rows.values()))
    self.assertIn("net/ws_conv2_d  WsConv2D", table)
    self.assertIn(module_runs.NOT_HAIKU_MP, table)

  def test_describe_given_the_init_shapes_traces_no_init(self):
    net = _net()
    images = jnp.ones([2, 16, 16, 3])
    inits = []

    def init(*args):
      inits.append(args)
      return net.init(*args)

    counted = hk.Transformed(init=init, apply=net.apply)
    traced = haiku_mp.describe(counted, images)
    self.assertLen(inits, 1)
    shapes = jax.eval_shape(net.init, jax.random.key(0), images)
    self.assertEqual(haiku_mp.describe(counted, images, init_shapes=shapes),
                     traced)
    self.assertLen(inits, 1)

  def test_the_first_trace_says_fp8_reaches_a_sliver_of_the_flops(self):
    forward = _net()
    x = jnp.ones([2, 16, 16, 3])
    params = forward.init(jax.random.key(0), x)
    loss = lambda p, r, b: (jnp.mean(forward.apply(p, r, b['x']).astype(
        jnp.float32)), {})
    scaler, optimizer = haiku_mp.LossScaler(), optax.sgd(0.1)
    state = haiku_mp.init_train_state(params, optimizer, scaler,
                                      jax.random.key(1))
    step = jax.jit(haiku_mp.make_train_step(loss, optimizer, scaler))
    with self.assertLogs('haiku_mp', 'WARNING') as logs:
      step(state, dict(x=x))
    [line] = logs.output
    self.assertIn('low-bit matmuls reach 1% of the forward pass', line)
    self.assertIn('most of the rest: net/conv2_d 71%, net/conv2_d_1 16%, '
                  'net/ws_conv2_d 13%', line)

  def test_a_precision_never_applied_is_one_warning_and_one_applied_none(self):
    forward = _net(low_bit='', apply=False)
    x = jnp.ones([2, 16, 16, 3])
    params = forward.init(jax.random.key(0), x)
    loss = lambda p, r, b: (jnp.mean(forward.apply(p, r, b['x'])), {})
    scaler, optimizer = haiku_mp.LossScaler(), optax.sgd(0.1)
    state = haiku_mp.init_train_state(params, optimizer, scaler,
                                      jax.random.key(1))
    step = jax.jit(haiku_mp.make_train_step(loss, optimizer, scaler))
    with self.assertLogs('haiku_mp', 'WARNING') as logs:
      state, _ = step(state, dict(x=x))
      step(state, dict(x=x))  # Compiled: no second trace, no second line.
    [line] = logs.output
    self.assertIn('no haiku_mp precision was applied while the loss was '
                  'traced', line)
    # Applied, and fp8 where most FLOPs are: nothing to say.
    applied = _net(low_bit='', apply=True)
    loss = lambda p, r, b: (jnp.mean(applied.apply(p, r, b['x']).astype(
        jnp.float32)), {})
    step = jax.jit(haiku_mp.make_train_step(loss, optimizer, scaler))
    with self.assertNoLogs('haiku_mp', 'WARNING'):
      step(haiku_mp.init_train_state(params, optimizer, scaler,
                                     jax.random.key(1)), dict(x=x))

  def test_the_module_table_has_each_modules_flops_and_what_runs_them(self):
    config = helpers.tiny_config(BF16)
    config.precision.low_bit.modules = '*/mlp_block'
    config.data.source = 'synthetic'
    rows = {r['path']: r for r in overview.module_rows(
        experiment.build_without_data(settings_lib.parse(config)))}
    fc1 = rows['vit/encoder_block_0/mlp_block/fc1']
    self.assertEqual((fc1['matmul'], fc1['matmul_runs']), ('fp8 current',
                                                            'fp8'))
    self.assertEqual(rows['vit/encoder_block_0/attention/query'][
        'matmul_runs'], 'native')
    shares = [r['matmul_flops_share'] for r in rows.values()
              if r['matmul_flops_share'] is not None]
    self.assertAlmostEqual(sum(shares), 1.0, places=6)
    self.assertIn('not haiku_mp\'s' if any(
        r['matmul_runs'] == "not haiku_mp's" for r in rows.values()) else
                  'FLOPs', overview.format_table(list(rows.values())))


class OneLineErrorsTest(absltest.TestCase):

  def _linear(self):
    forward = hk.transform(lambda x: hk.Linear(3)(x))
    params = forward.init(jax.random.key(0), jnp.ones([2, 4]))
    return forward, params

  def test_a_stateful_model_given_no_state(self):
    forward = hk.transform_with_state(
        lambda x, is_training: hk.BatchNorm(True, True, 0.9)(x, is_training))
    x = jnp.ones([2, 4])
    params, _ = forward.init(jax.random.key(0), x, True)
    scaler, optimizer = haiku_mp.LossScaler(), optax.sgd(0.1)
    loss = haiku_mp.LossWithState(lambda p, s, r, b: (lambda out: (
        jnp.sum(out[0]), {}, out[1]))(forward.apply(p, s, r, b['x'], True)))
    state = haiku_mp.init_train_state(params, optimizer, scaler,
                                      jax.random.key(1))
    with self.assertRaisesRegex(
        TypeError, r'^train_step: the model has Haiku state \(2 modules, e\.g\. '
        r'batch_norm/~/mean_ema\) but state\.model_state is empty; pass what '
        r"hk\.transform_with_state's init returned"):
      haiku_mp.make_train_step(loss, optimizer, scaler)(state, dict(x=x))

  def test_a_loss_that_returns_a_scalar(self):
    forward, params = self._linear()
    scaler, optimizer = haiku_mp.LossScaler(), optax.sgd(0.1)
    state = haiku_mp.init_train_state(params, optimizer, scaler,
                                      jax.random.key(1))
    step = haiku_mp.make_train_step(
        lambda p, r, b: jnp.sum(forward.apply(p, r, b['x'])), optimizer,
        scaler)
    with self.assertRaisesRegex(
        TypeError, r'^train_step: loss_fn returned an array of shape \(\), '
        r'not \(loss, metrics\); return \(loss, \{\}\) for a loss without '
        r'metrics$'):
      step(state, dict(x=jnp.ones([2, 4])))

  def test_a_batch_under_other_names(self):
    forward, params = self._linear()
    loss = haiku_mp.make_classification_loss(
        hk.transform(lambda x, is_training: hk.Linear(3)(x)))
    batch = dict(images=jnp.ones([2, 4]), labels=jnp.zeros([2], jnp.int32))
    with self.assertRaises(KeyError) as raised:
      loss(params, None, batch)
    self.assertEqual(
        str(raised.exception),
        "make_classification_loss: the batch has keys ['images', 'labels'], "
        "no 'image'; it reads the images at image_key='image' and the labels "
        "at label_key='label': name yours, make_classification_loss(forward, "
        'image_key=..., label_key=...)')
    named = haiku_mp.make_classification_loss(
        hk.transform(lambda x, is_training: hk.Linear(3)(x)),
        image_key='images', label_key='labels')
    value, metrics = named(params, None, batch)
    self.assertEqual(float(metrics['num_examples']), 2.0)
    self.assertTrue(bool(jnp.isfinite(value)))
    del forward


if __name__ == '__main__':
  absltest.main()
