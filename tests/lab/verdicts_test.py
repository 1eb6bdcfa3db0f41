"""The advisor on a tiny ViT with planted faults: it names exactly the
modules planted, with the right verdicts; the loss-scale window moves with
the gradients; the config it suggests builds."""

import contextlib
import copy
import functools
import os
import re
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax

from configs import base
from haiku_mp.advisor import numerics
from haiku_mp.advisor import verdicts
from haiku_mp import errors as haiku_mp_errors
from haiku_mp.lab.advisor import advice_flags
from haiku_mp.lab.advisor import driver as advisor
from haiku_mp.lab.advisor import knockout
from haiku_mp.lab.advisor import module_statistics
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers
from tests.lab import probes_test

FP16 = 'params=float32,compute=float16,output=float32'
FC1 = 'vit/encoder_block_0/mlp_block/fc1'
THRESHOLDS = helpers.advisor_settings(base.get_config().advisor).thresholds


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_gradient(x, factor):
  del factor
  return x


_scale_gradient.defvjp(lambda x, factor: (x, None),
                       lambda factor, _, g: (g * factor,))


@contextlib.contextmanager
def _planted_underflow(path, factor):
  """The gradient reaching `path`'s output multiplied by `factor`, and
  divided by it again at the module's input: only that module's gradients
  change. Haiku runs the first interceptor registered outermost: entered
  before the advisor's probes, this one runs outside them."""
  running = set()

  def intercept(next_f, args, kwargs, context):
    if (context.method_name != '__call__' or
        context.module.module_name != path or path in running):
      return next_f(*args, **kwargs)
    running.add(path)
    args = jax.tree.map(lambda a: _scale_gradient(a, 1 / factor), args)
    try:
      return _scale_gradient(next_f(*args, **kwargs), factor)
    finally:
      running.discard(path)

  with hk.intercept_methods(intercept):
    yield


def _scaled_loss(loss_fn, factor):
  def scaled(params, rng, batch):
    loss, aux = loss_fn(params, rng, batch)
    return loss * factor, aux
  return scaled


class AdvisorSettingsTest(parameterized.TestCase):
  """`config.advisor` parsed in one place, by one rule per kind of field."""

  def test_the_limits_become_the_thresholds_of_each_format(self):
    advisor = base.get_config().advisor
    advisor.update(max_relative_error=0.02, fp8_max_saturate_share=0.5,
                   fp4_max_flushed_share=1.0, init_steps=7)
    settings = helpers.advisor_settings(advisor)
    self.assertEqual(settings.thresholds, verdicts.Thresholds(0.02, 0.0, 1.0))
    self.assertEqual(settings.fp8.max_saturate_share, 0.5)
    self.assertEqual(settings.fp4.max_flushed_share, 1.0)
    self.assertEqual(settings.init_steps, 7)

  @parameterized.parameters(
      ('max_relative_error', 1.5, 'in [0, 1]'),
      ('max_overflow_share', -0.1, 'in [0, 1]'),
      ('fp8_max_relative_error', 2.0, 'in [0, 1]'),
      ('fp4_max_relative_error', -1.0, 'in [0, 1]'),
      ('loss_scale_headroom', 0.5, '>= 1'),
      ('init_steps', -1, '>= 0'))
  def test_a_bad_limit_names_itself(self, name, value, rule):
    advisor = base.get_config().advisor
    advisor[name] = value
    with self.assertRaisesRegex(
        haiku_mp_errors.ConfigError,
        rf'^advisor\.{name}=\S+ must be {re.escape(rule)}'):
      helpers.advisor_settings(advisor)


@helpers.long_running
class AdvisorTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = helpers.tiny_config(FP16, loss_scale='dynamic')
    cls.exp, cls.params = probes_test.tiny_reference(cls.config)
    # One batch: no train step between batches to compile (several batches,
    # a step between each: lab_test's `advise --batches=2`).
    cls.inputs = [helpers.random_batch(cls.config, 8, seed=0)]
    # The unplanted model's statistics and verdicts, which three tests read.
    cls.plain_modules, cls.plain = cls._judge()

  @classmethod
  def _judge(cls, params=None, loss_fn=None, inputs=None):
    state = cls.exp.strategy.init_state()._replace(
        params=copy.deepcopy(params or cls.params))
    modules, _, _, _ = module_statistics.gather_statistics(
        cls.exp, state, inputs or cls.inputs, lambda line: None,
        loss_fn=loss_fn)
    return modules, verdicts.judge(modules, THRESHOLDS)

  def _kept(self, judged, fmt):
    return {p for p, v in judged.verdicts.items()
            if getattr(v, fmt) == verdicts.KEEP}

  def test_unplanted_tiny_model_runs_in_every_format(self):
    judged = self.plain
    self.assertEqual(self._kept(judged, 'float16'), set())
    self.assertEqual(self._kept(judged, 'bfloat16'), set())
    lo, hi = judged.scale_window
    self.assertLessEqual(lo, hi)

  def test_planted_overflow_names_the_head_alone(self):
    params = copy.deepcopy(self.params)
    params['vit/head'] = jax.tree.map(lambda p: p * 1e5, params['vit/head'])
    modules, judged = self._judge(params, inputs=self.inputs[:1])
    self.assertEqual(self._kept(judged, 'float16'), {'vit/head'})
    self.assertIn('output overflows float16',
                  judged.verdicts['vit/head'].reasons['float16'])
    self.assertEqual(self._kept(judged, 'bfloat16'), set())
    # The top module hands on the head's logits: not judged again.
    self.assertEqual({m.path: m.same_as for m in modules}['vit'], 'vit/head')
    overrides = verdicts.overrides(modules, judged, 'float16',
                                 advisor.inherits(self.exp),
                                 'params=float32,compute=float16,output=float16')
    self.assertEqual(overrides, f'vit/head:{verdicts.F32_POLICY}')
    # The config it suggests builds: its override names a real module.
    config = copy.deepcopy(self.config)
    config.precision.overrides = overrides
    experiment.build_without_data(settings_lib.parse(config))
    # Knockout: the head alone in float16 is what breaks the logits.
    rows = knockout.knockout(self.exp.settings, params, self.inputs[:1],
                             ['vit/head', FC1], ['float16'],
                             lambda line: None)['float16']
    self.assertEqual(rows[0]['path'], 'vit/head')
    self.assertFalse(rows[0]['finite'])
    self.assertTrue(rows[1]['finite'])
    self.assertLess(rows[1]['logits_relative_error'], 1e-2)

  def test_planted_underflow_names_that_module_alone(self):
    # One batch: no train step is traced (and cached) with the fault.
    with _planted_underflow(FC1, 1e-9):
      modules, judged = self._judge(inputs=self.inputs[:1])
    self.assertEqual(self._kept(judged, 'float16'), {FC1})
    self.assertIn('need a loss scale', judged.verdicts[FC1].reasons['float16'])
    self.assertEqual(self._kept(judged, 'bfloat16'), set())
    # Its gradients really are 1e-9 of the unplanted ones, the rest equal.
    plain = {m.path: m for m in self.plain_modules}
    for m in modules:
      ratio = (numerics.as_dict(m.gradient)['amax'] /
               numerics.as_dict(plain[m.path].gradient)['amax'])
      self.assertAlmostEqual(ratio, 1e-9 if m.path == FC1 else 1.0,
                             delta=1e-3 * (1e-9 if m.path == FC1 else 1),
                             msg=m.path)

  def test_a_loss_scaled_by_two_to_the_minus_20_moves_every_window_by_20(self):
    plain = self.plain
    _, scaled = self._judge(loss_fn=_scaled_loss(self.exp.loss_fn, 2.0**-20))
    # Exact on any CPU: a power-of-two factor changes no float32 rounding
    # (nothing reaches the subnormals), so every amax moves by exactly 2^-20.
    for path, verdict in plain.verdicts.items():
      lo, hi = verdict.window
      self.assertEqual(scaled.verdicts[path].window, (lo + 20, hi + 20), path)
    lo, hi = plain.scale_window
    self.assertEqual(scaled.scale_window, (lo + 20, hi + 20))
    # Tiny gradients: float16 needs a loss scale everywhere.
    self.assertEqual({v.float16 for v in scaled.verdicts.values()},
                     {verdicts.F16_SCALED})


class OverridesTest(absltest.TestCase):
  """Which targets the overrides string names, on made-up verdicts."""

  def _advice(self, kept):
    judged = {p: verdicts.Verdict(verdicts.BF16_OK,
                                  verdicts.KEEP if p in kept else verdicts.F16_OK,
                                  (None, None), {}) for p in PATHS}
    return verdicts.Advice(judged, (None, None))

  def test_classes_kept_whole_and_children_given_back(self):
    modules = [verdicts.Module(p, c, None, None, {})
               for p, c in zip(PATHS, CLASSES)]
    inherits = {p: c != 'LayerNorm' for p, c in zip(PATHS, CLASSES)}
    half = 'params=float32,compute=float16,output=float16'
    f32 = verdicts.F32_POLICY
    judged = self._advice({'b/ln_1', 'b/ln_2'})
    self.assertEqual(verdicts.overrides(modules, judged, 'float16', inherits,
                                      half), f'LayerNorm:{f32}')
    judged = self._advice({'b', 'b/ln_1'})
    self.assertEqual(
        verdicts.overrides(modules, judged, 'float16', inherits, half),
        f'b:{f32};b/ln_1:{f32};b/fc:{half}')
    self.assertEqual(verdicts.overrides(modules, self._advice(set()),
                                      'float16', inherits, half), '')


class LossScaleFlagsTest(absltest.TestCase):
  """The float16 loss-scale flags the advisor prints to paste."""

  def test_powers_of_two_paste_exactly(self):
    # `:g` printed 2^25 as 3.35544e+07, which pastes as 33554400.
    settings = verdicts.loss_scale('float16', (-10, 25))
    self.assertEqual(advice_flags.loss_scale_flags(settings), [
        '--config.loss_scale.kind=dynamic',
        '--config.loss_scale.initial=33554432',
        '--config.loss_scale.minimum=0.0009765625'])
    for exponent in range(-60, 61):
      settings = verdicts.loss_scale('float16', (exponent, exponent))
      for flag in advice_flags.loss_scale_flags(settings)[1:]:
        self.assertEqual(float(flag.partition('=')[2]), 2.0**exponent, flag)

  def test_no_loss_scale_for_bfloat16_nor_bounds_for_an_open_window(self):
    self.assertEqual(advice_flags.loss_scale_flags(
        verdicts.loss_scale('bfloat16', (-10, 25))),
                     ['--config.loss_scale.kind=none'])
    self.assertEqual(verdicts.loss_scale('float16', (None, None)),
                     dict(kind='dynamic'))


PATHS = ('b', 'b/ln_1', 'b/fc', 'b/ln_2')
CLASSES = ('Block', 'LayerNorm', 'Linear', 'LayerNorm')


if __name__ == '__main__':
  absltest.main()
