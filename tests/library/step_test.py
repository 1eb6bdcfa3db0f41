"""Tests for the loss-scaled train step: unscaling, skipping, underflow, eval."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from haiku_mp.model import interception
from haiku_mp.model import policies
from haiku_mp.model import policy_strings
from haiku_mp.update import classification
from haiku_mp.update import gradients as gradients_lib
from haiku_mp.update import loss_scaling
from haiku_mp.update import optimizer as optimizer_lib
from haiku_mp.update import step as step_lib
from haiku_mp.update import train_state
from haiku_mp.vit.parallel import stop_request
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

FP16 = 'params=float32,compute=float16,output=float32'
BF16 = 'params=float32,compute=bfloat16,output=float32'
FP32 = 'params=float32,compute=float32,output=float32'
FP16_PARAMS = 'params=float16,compute=float16,output=float32'
BF16_PARAMS = 'params=bfloat16,compute=bfloat16,output=float32'


def _linear_regression(policy: str):
  """The seeds' exercise: `hk.Linear(1)` under `policy`, MSE in its output dtype."""
  plan = policies.make_precision(policy, model_class='Linear')

  def predict(x):
    with interception.apply(plan):
      return hk.Linear(1, name='linear')(x)

  forward = hk.transform(predict)

  def loss_fn(params, rng, batch):
    prediction = forward.apply(params, rng, batch['x'])
    error = prediction - batch['y'].astype(prediction.dtype)
    return jnp.mean(error * error).astype(jnp.float32), {}

  return forward, loss_fn


def _regression_batch():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 4)).astype(np.float32)
  y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1
  return dict(x=jnp.asarray(x), y=jnp.asarray(y))


def _one_step(policy, scaler, optimizer, batch, loss_fn_and_forward=None):
  forward, loss_fn = loss_fn_and_forward or _linear_regression(policy)
  params = forward.init(jax.random.key(0), batch['x'])
  state = train_state.init_train_state(params, optimizer, scaler,
                                          jax.random.key(1))
  step = jax.jit(step_lib.make_train_step(loss_fn, optimizer, scaler))
  new_state, metrics = step(state, batch)
  return state, new_state, metrics


def _vit_setup(policy, loss_scale_kind, **loss_scale):
  config = helpers.tiny_config(policy, loss_scale=loss_scale_kind)
  config.loss_scale.update(loss_scale)
  exp = experiment.build_without_data(settings_lib.parse(config))
  step = step_lib.make_train_step(exp.loss_fn, exp.optimizer, exp.scaler)
  return exp.forward, helpers.random_batch(config), exp.strategy.init_state(), step


def _copy(tree):
  return jax.tree.map(np.array, tree)


@helpers.long_running
class MakeTrainStepTest(absltest.TestCase):

  def test_a_loss_fn_or_gradients_give_the_same_step(self):
    batch = _regression_batch()
    forward, loss_fn = _linear_regression(FP32)
    scaler = loss_scaling.LossScaler('static', initial=2.0**4)
    optimizer = optax.sgd(0.1)
    state = train_state.init_train_state(
        forward.init(jax.random.key(0), batch['x']), optimizer, scaler,
        jax.random.key(1))
    direct, _ = step_lib.make_train_step(loss_fn, optimizer, scaler)(
        state, batch)
    given, _ = step_lib.make_train_step(
        None, optimizer, scaler,
        gradients_fn=gradients_lib.scaled_gradients(loss_fn, scaler))(
            state, batch)
    chex.assert_trees_all_equal(direct, given)
    self.assertFalse(np.array_equal(direct.params['linear']['w'],
                                    state.params['linear']['w']))
    with self.assertRaisesRegex(ValueError, 'give a loss_fn, or gradients_fn'):
      step_lib.make_train_step(None, optimizer, scaler)

  def test_the_stop_request_is_the_trainers(self):
    batch = _regression_batch()
    forward, loss_fn = _linear_regression(FP32)
    optimizer = optax.sgd(0.1)
    state = train_state.init_train_state(
        forward.init(jax.random.key(0), batch['x']), optimizer,
        loss_scaling.LossScaler(), jax.random.key(1))
    library_step = step_lib.make_train_step(loss_fn, optimizer)
    _, metrics = library_step(state, batch)
    self.assertNotIn('stop_requested', metrics)
    self.assertNotIn('stop_request', state._fields)
    step = stop_request.with_stop_request(library_step)
    for flags, expected in (([False, False], False), ([False, True], True)):
      field = {stop_request.STOP_REQUEST: jnp.asarray(flags)}
      new_state, metrics = step(state, dict(batch, **field))
      self.assertEqual(bool(metrics['stop_requested']), expected)
      # The field never reaches the library's step.
      chex.assert_trees_all_equal(new_state, library_step(state, batch)[0])


class SeedsExerciseTest(parameterized.TestCase):
  """`hk.Linear(1)`, bf16 MSE, SGD, static loss scale S: one step."""

  def test_update_matches_float32_and_does_not_depend_on_scale(self):
    batch = _regression_batch()
    sgd = optax.sgd(0.1)
    _, ref_state, _ = _one_step(FP32, loss_scaling.LossScaler('none'), sgd,
                                batch)
    _, ref_loss_fn = _linear_regression(FP32)
    ref_loss = float(ref_loss_fn(ref_state.params, None, batch)[0])
    updates = {}
    for scale in (64.0, 128.0, 256.0):
      old, new, metrics = _one_step(
          'params=float32,compute=bfloat16,output=bfloat16',
          loss_scaling.LossScaler('static', initial=scale), sgd, batch)
      self.assertEqual(float(metrics['loss_scale']), scale)
      updates[scale] = jax.tree.map(lambda a, b: a - b, new.params,
                                    old.params)
      loss_after = float(ref_loss_fn(new.params, None, batch)[0])
      np.testing.assert_allclose(loss_after, ref_loss, rtol=2e-2)
      self.assertLess(loss_after, float(metrics['loss']))
    chex.assert_trees_all_close(updates[64.0], updates[128.0], rtol=1e-6)
    chex.assert_trees_all_close(updates[64.0], updates[256.0], rtol=1e-6)
    reference_update = jax.tree.map(lambda a, b: a - b, ref_state.params,
                                    _one_step(FP32, loss_scaling.LossScaler(
                                        'none'), sgd, batch)[0].params)
    chex.assert_trees_all_close(updates[128.0], reference_update, rtol=2e-2,
                                atol=1e-3)


class SkipTest(parameterized.TestCase):

  def test_non_finite_gradient_skips_and_backs_off_then_grows(self):
    _, batch, state, step = _vit_setup(FP16, 'dynamic', initial=2.0**10,
                                       period=3, factor=2.0)
    step = jax.jit(step)
    state, _ = step(state, batch)  # One good step so opt_state is non-trivial.
    before = _copy((state.params, state.opt_state))
    bad = dict(batch, image=batch['image'].at[0, 0, 0, 0].set(jnp.inf))
    state, metrics = step(state, bad)
    self.assertFalse(bool(metrics['grads_finite']))
    self.assertTrue(metrics['nonfinite_grads'].all())  # inf reaches every grad.
    self.assertEqual(int(metrics['consecutive_skips']), 1)
    self.assertEqual(float(metrics['loss_scale']), 2.0**10)
    chex.assert_trees_all_equal(_copy((state.params, state.opt_state)), before)
    self.assertEqual(float(state.loss_scale.scale), 2.0**9)
    self.assertEqual(int(state.skipped_steps), 1)
    self.assertEqual(int(metrics['skipped_steps']), 1)
    self.assertEqual(int(state.step), 2)
    scales = []
    for _ in range(4):
      state, metrics = step(state, batch)
      self.assertTrue(bool(metrics['grads_finite']))
      scales.append(float(state.loss_scale.scale))
    self.assertEqual(scales, [2.0**9, 2.0**9, 2.0**10, 2.0**10])
    self.assertEqual(int(state.skipped_steps), 1)
    self.assertFalse(np.array_equal(_copy(state.params)['vit/head']['w'],
                                    before[0]['vit/head']['w']))

  def test_float16_without_scaling_loses_small_gradients(self):
    batch = _regression_batch()

    def tiny_loss(policy):
      forward, _ = _linear_regression(policy)

      def loss_fn(params, rng, batch):
        prediction = forward.apply(params, rng, batch['x'])
        # d loss / d prediction is 6e-10: below float16's smallest subnormal.
        return jnp.mean(prediction.astype(jnp.float32)) * 1e-8, {}

      return forward, loss_fn

    sgd = optax.sgd(1.0)
    norms = {}
    for name, policy, scaler in (
        ('fp32', FP32, loss_scaling.LossScaler('none')),
        ('fp16', 'p=f32,c=f16,o=f16', loss_scaling.LossScaler('none')),
        ('fp16_dynamic', 'p=f32,c=f16,o=f16',
         loss_scaling.LossScaler('dynamic', initial=2.0**15))):
      *_, metrics = _one_step(policy, scaler, sgd, batch, tiny_loss(policy))
      self.assertTrue(bool(metrics['grads_finite']))
      norms[name] = float(metrics['grad_norm'])
    self.assertGreater(norms['fp32'], 1e-9)
    self.assertEqual(norms['fp16'], 0.0)
    np.testing.assert_allclose(norms['fp16_dynamic'], norms['fp32'], rtol=1e-2)

  def test_clipping_sees_unscaled_gradients(self):
    batch = _regression_batch()
    clip_sgd = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0))
    results = []
    for scaler in (loss_scaling.LossScaler('none'),
                   loss_scaling.LossScaler('static', initial=1024.0)):
      old, new, metrics = _one_step(FP32, scaler, clip_sgd, batch)
      self.assertGreater(float(metrics['grad_norm']), 0.5)  # Clipping acts.
      update = jax.tree.map(lambda a, b: a - b, new.params, old.params)
      np.testing.assert_allclose(float(optax.tree.norm(update)), 0.5,
                                 rtol=1e-5)
      results.append(update)
    chex.assert_trees_all_close(results[0], results[1], rtol=1e-5)


@helpers.long_running
class TrainingTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('fp32', FP32, 'none'), ('bf16', BF16, 'none'),
      ('fp16', FP16, 'dynamic'), ('fp16_params', FP16_PARAMS, 'dynamic'),
      ('bf16_params', BF16_PARAMS, 'none'))
  def test_loss_goes_down_compiles_once_and_donates(self, policy, kind):
    _, batch, state, step = _vit_setup(policy, kind)
    # Compiled once, ahead of time: a state that came back with another
    # shape or dtype would not match the program, and one with another weak
    # type would make jax.jit compile again.
    types = jax.tree.map(jax.typeof, state)
    step = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    losses = []
    for _ in range(25):
      previous = state
      state, metrics = step(state, batch)
      losses.append(float(metrics['loss']))
    self.assertTrue(previous.params['vit/head']['w'].is_deleted())
    self.assertEqual(jax.tree.map(jax.typeof, state), types)
    # The loss falls by 0.33-0.35 on every policy here (float32 to bfloat16
    # params): asking for half of that leaves another CPU's rounding, far
    # smaller than another dtype's, no say. A step that learns nothing
    # keeps ln(10) (the head starts at zero).
    self.assertLess(np.mean(losses[-3:]), losses[0] - 0.15)
    self.assertEqual(int(state.step), 25)
    self.assertEqual(int(state.skipped_steps), 0)
    self.assertEqual(set(metrics), {'loss', 'accuracy', 'num_examples',
                                    'loss_scale', 'grads_finite', 'grad_norm',
                                    'skipped_steps', 'consecutive_skips',
                                    'nonfinite_grads', 'updates_lost',
                                    'state_finite', 'nonfinite_state',
                                    'applied'})
    self.assertEqual(metrics['nonfinite_grads'].shape,
                     (len(jax.tree.leaves(state.params)),))
    self.assertFalse(metrics['nonfinite_grads'].any())
    # The ViT has no Haiku state: no flag, and every step applied.
    self.assertEqual(metrics['nonfinite_state'].shape, (0,))
    self.assertTrue(bool(metrics['applied']) and bool(metrics['state_finite']))
    param_dtype = policy_strings.parse_policy(policy).param_dtype
    for path, p in jax.tree_util.tree_leaves_with_path(state.params):
      name = jax.tree_util.keystr(path)
      self.assertEqual(p.dtype, jnp.float32 if 'ln_' in name else param_dtype,
                       name)
    if param_dtype != jnp.float32:
      master = state.opt_state.master
      chex.assert_trees_all_equal(
          state.params,
          jax.tree.map(lambda m, p: m.astype(p.dtype), master, state.params))
      self.assertEqual({m.dtype for m in jax.tree.leaves(master)},
                       {jnp.dtype(jnp.float32)})


class SoftTargetsTest(parameterized.TestCase):
  """The train loss against smoothed or mixed targets, in float32."""

  def _loss(self, logits, batch, label_smoothing):
    forward = hk.transform(lambda images, is_training: logits)
    loss_fn = classification.make_classification_loss(forward, label_smoothing)
    return loss_fn({}, jax.random.key(0), batch)

  def test_label_smoothing_spreads_the_target(self):
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5)),
                         jnp.bfloat16)
    labels = jnp.array([0, 3, 4, 1])
    loss, metrics = self._loss(logits, dict(image=None, label=labels), 0.1)
    chex.assert_type(loss, jnp.float32)
    log_p = jax.nn.log_softmax(np.float32(logits))
    target = 0.9 * np.eye(5)[labels] + 0.1 / 5
    np.testing.assert_allclose(loss, -(target * log_p).sum(1).mean(),
                               rtol=1e-6)
    plain, _ = self._loss(logits, dict(image=None, label=labels), 0.0)
    np.testing.assert_allclose(
        plain, -log_p[np.arange(4), labels].mean(), rtol=1e-6)
    np.testing.assert_allclose(
        metrics['accuracy'], np.mean(np.argmax(log_p, 1) == labels))

  def test_mixed_targets_are_smoothed_and_accuracy_keeps_own_labels(self):
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3)),
                         jnp.float32)
    targets = jnp.array([[0.7, 0.3, 0.0], [0.0, 0.4, 0.6]])
    labels = jnp.array([0, 1])
    loss, metrics = self._loss(
        logits, dict(image=None, label=labels, targets=targets), 0.3)
    smoothed = 0.7 * np.asarray(targets) + 0.3 / 3
    log_p = jax.nn.log_softmax(np.asarray(logits))
    np.testing.assert_allclose(loss, -(smoothed * log_p).sum(1).mean(),
                               rtol=1e-6)
    np.testing.assert_allclose(
        metrics['accuracy'], np.mean(np.argmax(log_p, 1) == labels))


class EvalStepTest(parameterized.TestCase):

  def test_deterministic_and_masked(self):
    forward, batch, state, _ = _vit_setup(BF16, 'none')
    eval_step = jax.jit(classification.make_eval_step(forward))
    # A random head, so that the logits depend on the encoder and differ
    # between classes (a constant one ties them all, and argmax would then
    # be decided by the last bits of each program's matmul).
    params = hk.data_structures.map(
        lambda m, n, p: p + 0.1 * jax.random.normal(
            jax.random.key(7), p.shape, p.dtype) if m == 'vit/head' else p,
        state.params)
    first = eval_step(params, batch)
    chex.assert_trees_all_equal(first, eval_step(params, batch))
    chex.assert_type(first['logits'], jnp.float32)
    valid = 5
    mask = jnp.arange(8) < valid
    masked = eval_step(params, dict(batch, mask=mask))
    subset = eval_step(params, jax.tree.map(lambda x: x[:valid], batch))
    self.assertEqual(float(masked['num_examples']), valid)
    # Two programs (8 rows, 5 rows) that sum in another order: float32
    # rounding (1e-7 apart here); their argmaxes are no near tie (below).
    np.testing.assert_allclose(masked['loss'], subset['loss'], rtol=1e-5)
    np.testing.assert_allclose(masked['accuracy'], subset['accuracy'])
    top_two = np.sort(np.asarray(first['logits']), -1)[:, -2:]
    self.assertGreater(np.min(top_two[:, 1] - top_two[:, 0]), 1e-3)
    labels = batch['label']
    expected = np.mean(np.argmax(first['logits'], -1) == labels)
    np.testing.assert_allclose(first['accuracy'], expected)


class StateCheckTest(parameterized.TestCase):
  """A state the step cannot take is one line at the first trace, naming
  what is wrong and what was expected (`jax.eval_shape`: no compile)."""

  def setUp(self):
    super().setUp()
    self.batch = _regression_batch()
    forward, self.loss_fn = _linear_regression(FP32)
    self.params = forward.init(jax.random.key(0), self.batch['x'])

  def _step(self, optimizer, scaler):
    return step_lib.make_train_step(self.loss_fn, optimizer, scaler)

  def _state(self, optimizer, scaler):
    return train_state.init_train_state(self.params, optimizer, scaler,
                                        jax.random.key(1))

  def test_the_params_instead_of_a_state(self):
    step = self._step(optax.sgd(0.1), loss_scaling.LossScaler())
    with self.assertRaisesRegex(TypeError, r'^train_step: state is a dict, '
                                'not a haiku_mp.TrainState; build it with '
                                r'haiku_mp.init_train_state\('):
      jax.eval_shape(step, self.params, self.batch)

  def test_a_checkpoint_restored_without_its_target(self):
    state = self._state(optax.sgd(0.1), loss_scaling.LossScaler())
    step = self._step(optax.sgd(0.1), loss_scaling.LossScaler())
    with self.assertRaisesRegex(TypeError, 'a checkpoint restored without a '
                                'target.*StandardRestore'):
      jax.eval_shape(step, state._asdict(), self.batch)

  def test_a_state_of_another_optimizer(self):
    state = self._state(optax.adam(0.1), loss_scaling.LossScaler())
    step = self._step(optimizer_lib.make_optimizer(
        optax.constant_schedule(0.1), half_params=True),
                      loss_scaling.LossScaler())
    with self.assertRaises(TypeError) as raised:
      jax.eval_shape(step, state, self.batch)
    message = str(raised.exception)
    self.assertIn("state.opt_state is not this optimizer's state", message)
    self.assertIn('MasterState', message)  # What the step's makes.
    self.assertIn('ScaleByAdamState', message)  # What the state holds.
    self.assertNotIn('\n', message)

  @parameterized.parameters(('none', 'dynamic'), ('dynamic', 'static'),
                            ('static', 'none'))
  def test_a_state_of_another_loss_scaler(self, made, stepped):
    state = self._state(optax.sgd(0.1), loss_scaling.LossScaler(made))
    step = self._step(optax.sgd(0.1), loss_scaling.LossScaler(stepped))
    with self.assertRaisesRegex(
        loss_scaling.LossScaleError,
        f"state.loss_scale was made by LossScaler\\('{made}'\\); this "
        f"step's scaler is LossScaler\\('{stepped}'\\)"):
      jax.eval_shape(step, state, self.batch)

  def test_the_same_optimizer_and_scaler_step(self):
    scaler = loss_scaling.LossScaler('dynamic')
    state = self._state(optax.adam(0.1), scaler)
    new_state, _ = jax.eval_shape(self._step(optax.adam(0.1), scaler), state,
                                  self.batch)
    self.assertIsInstance(new_state.loss_scale,
                          loss_scaling.DynamicLossScaleState)

  def test_a_forward_without_apply_rng_trains_and_evaluates(self):
    policy = policies.make_precision(BF16, model_class='Linear')

    def forward(images, is_training):
      del is_training
      with interception.apply(policy):
        return hk.Linear(3)(images)

    forward = hk.without_apply_rng(hk.transform(forward))
    batch = dict(image=self.batch['x'], label=jnp.arange(16) % 3)
    params = forward.init(jax.random.key(0), batch['image'], True)
    loss_fn = classification.make_classification_loss(forward)
    loss, _ = loss_fn(params, jax.random.key(1), batch)
    self.assertTrue(np.isfinite(float(loss)))
    metrics = classification.make_eval_step(forward)(params, batch)
    np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-6)

  def test_a_function_that_is_not_transformed(self):
    with self.assertRaisesRegex(TypeError, 'forward is a function, not a '
                                'transformed Haiku function'):
      classification.make_classification_loss(lambda x, t: x)


if __name__ == '__main__':
  absltest.main()
