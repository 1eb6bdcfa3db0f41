"""Tests for loss scales from config, including jmp 0.0.4's two defects."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import jmp

from haiku_mp import errors
from haiku_mp.update import loss_scaling

OVERFLOW = jnp.asarray(False)
FINITE = jnp.asarray(True)


class LossScalerTest(parameterized.TestCase):

  def test_kinds(self):
    none = loss_scaling.LossScaler('none')
    self.assertIsInstance(none.jmp_loss_scale(none.init()), jmp.NoOpLossScale)
    self.assertEqual(float(none.init().scale), 1.0)
    self.assertEqual(float(none.scale(none.init(), jnp.float32(2.0))), 2.0)
    static = loss_scaling.LossScaler('static', initial=128.0)
    state = static.init()
    self.assertEqual(float(state.scale), 128.0)
    self.assertEqual(float(static.scale(state, jnp.float32(2.0))), 256.0)
    self.assertEqual(float(static.unscale(state, jnp.float32(256.0))), 2.0)
    after = static.adjust(state, OVERFLOW)
    self.assertEqual((float(after.scale), int(after.overflows)), (128.0, 1))
    dynamic = loss_scaling.LossScaler('dynamic', initial=2.0**15)
    self.assertEqual(dynamic.init().scale.dtype, jnp.float32)
    self.assertIsInstance(dynamic.jmp_loss_scale(dynamic.init()),
                          jmp.DynamicLossScale)

  def test_jmp_float16_scale_crashes_but_ours_is_float32(self):
    # jmp issue #47: the defect the float32 scale guards against.
    with self.assertRaises(TypeError):
      jmp.DynamicLossScale(jnp.float16(2**15)).adjust(OVERFLOW)
    scaler = loss_scaling.LossScaler('dynamic', initial=2**15)
    state = scaler.adjust(scaler.init(), OVERFLOW)
    self.assertEqual(state.scale.dtype, jnp.float32)
    self.assertEqual(float(state.scale), 2.0**14)

  def test_floor_holds_after_many_jitted_overflows(self):
    scaler = loss_scaling.LossScaler('dynamic', initial=2.0**15, minimum=128.0)
    ours = jax.jit(scaler.adjust)
    bare = jax.jit(lambda s, f: s.adjust(f))
    state = scaler.init()
    bare_state = scaler.jmp_loss_scale(state)
    for _ in range(20):
      state = ours(state, OVERFLOW)
      bare_state = bare(bare_state, OVERFLOW)
    self.assertEqual(float(state.scale), 128.0)
    # jmp's own state forgets the floor under jit (jmp PR #44 never merged).
    self.assertEqual(float(bare_state.loss_scale), 1.0)

  def test_dynamic_backs_off_and_grows_after_period(self):
    scaler = loss_scaling.LossScaler('dynamic', initial=1024.0, period=3,
                                     factor=4.0)
    adjust = jax.jit(scaler.adjust)
    state = adjust(scaler.init(), OVERFLOW)
    self.assertEqual(float(state.scale), 256.0)
    for expected in (256.0, 256.0, 1024.0, 1024.0):
      state = adjust(state, FINITE)
      self.assertEqual(float(state.scale), expected)
    state = adjust(state, OVERFLOW)  # Resets the counter.
    self.assertEqual(int(state.counter), 0)
    state = adjust(adjust(state, FINITE), FINITE)
    self.assertEqual(float(state.scale), 256.0)

  def test_state_lowers_on_abstract_inputs(self):
    scaler = loss_scaling.LossScaler('dynamic')
    abstract = jax.eval_shape(scaler.init)
    lowered = jax.jit(scaler.adjust).lower(
        abstract, jax.ShapeDtypeStruct((), jnp.bool_))
    # The state keeps its dtypes through a step (a float16 scale would crash
    # jmp's adjust, jmp #47; an int64 counter would change the checkpoint).
    self.assertEqual(jax.tree.map(lambda x: x.dtype, lowered.out_info),
                     jax.tree.map(lambda x: x.dtype, abstract))

  @parameterized.parameters(
      (dict(kind='dymanic'), '^kind: '),
      (dict(kind='static', initial=0.0), '^initial: '),
      (dict(kind='dynamic', initial=float('inf')), '^initial: '),
      (dict(kind='dynamic', factor=1.0), '^factor: '),
      (dict(kind='dynamic', period=0), '^period: '),
      (dict(kind='dynamic', minimum=0.0), '^minimum: '),
      (dict(kind='dynamic', initial=4.0, minimum=8.0), '^minimum: '))
  def test_bad_settings_name_the_setting(self, kwargs, setting):
    with self.assertRaisesRegex(loss_scaling.LossScaleError, setting):
      loss_scaling.LossScaler(**kwargs)

  def test_an_error_names_the_argument_and_named_its_setting_path(self):
    with self.assertRaises(errors.ArgumentError) as raised:
      loss_scaling.LossScaler(initial=-1)
    self.assertEqual(str(raised.exception),
                     'initial: must be a positive finite number, got -1')
    self.assertEqual(str(raised.exception.named(prefix='loss_scale.')),
                     'loss_scale.initial: must be a positive finite number, '
                     'got -1')
    with self.assertRaises(loss_scaling.LossScaleError) as raised:
      loss_scaling.LossScaler().check(3, 1.0, 1, 1)
    self.assertStartsWith(str(raised.exception), 'kind=none: non-finite ')


if __name__ == '__main__':
  absltest.main()
