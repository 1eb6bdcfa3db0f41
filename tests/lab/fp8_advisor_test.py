"""The advisor's 8-bit verdicts: fp8 statistics as the casts make them, and a
planted tensor that E4M3 cannot hold named by exactly its module."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from haiku_mp.advisor import fp8_numerics
from haiku_mp.advisor import matmul_formats
from haiku_mp.advisor import numerics
from haiku_mp.lab.advisor import low_bit_advice
from haiku_mp.lab import variants
from haiku_mp.model import fp8
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

PLANTED = 'vit/encoder_block_1/mlp_block/fc1'


class Fp8NumericsTest(parameterized.TestCase):

  @parameterized.parameters((numerics.E4M3, ml_dtypes.float8_e4m3fn),
                            (numerics.E5M2, ml_dtypes.float8_e5m2))
  def test_the_grid_is_the_cast(self, fmt, ml_dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4000) *
         np.exp2(rng.integers(-24, 20, 4000))).astype(np.float32)
    x = np.concatenate([x, [0.0, fmt.max, -fmt.max * 1.1, 2.0**-9, 2.0**-16,
                            2.0**-17, 3 * 2.0**-18]]).astype(np.float32)
    want = np.clip(x, -fmt.max, fmt.max).astype(ml_dtype).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(numerics.round_to(jnp.asarray(x), fmt)), want)

  def test_counts_and_errors_at_each_scaling(self):
    # 64 values: one of 1000 and 63 of 1e-3. Per tensor, E4M3's scale (4)
    # maps 1000 to 250 and the rest to 2.5e-4, below half its smallest
    # subnormal (2^-10): all 63 underflow; in MX blocks of 32, only the 31
    # beside the large value do. A delayed amax of 500 saturates the large
    # value: its scale, 2 (the smallest power of two that holds 500), keeps
    # 448 * 2.
    x = np.full((1, 64), 1e-3, np.float32)
    x[0, 0] = 1000.0
    stats = fp8_numerics.as_dict(np.asarray(fp8_numerics.tensor_stats(
        jnp.asarray(x), numerics.E4M3, jnp.float32(500.0))))
    self.assertEqual(stats['nonzero'], 64)
    self.assertEqual(stats['current']['underflow_share'], 63 / 64)
    self.assertEqual(stats['current']['saturate_share'], 0.0)
    self.assertEqual(stats['mx']['underflow_share'], 31 / 64)
    self.assertEqual(stats['delayed']['saturate_share'], 1 / 64)
    self.assertAlmostEqual(stats['delayed']['relative_error'],
                           (1000.0 - 448.0 * 2) / np.linalg.norm(x), places=3)


class SuggestionFlagsTest(parameterized.TestCase):
  """The low-bit flags to paste, per format; a float16 config, which no
  low-bit format runs in, gets a bfloat16 policy first. (lab_test's
  `advise` runs the whole pipeline on a bfloat16 config.)"""

  @parameterized.parameters(
      ('params=float32,compute=float16,output=float32',
       ['--config.precision.policy=params=float32,compute=bfloat16,'
        'output=float32']),
      ('params=float32,compute=bfloat16,output=float32', []))
  def test_flags_per_format_and_a_bfloat16_policy_for_float16(
      self, policy, first):
    settings = settings_lib.parse(helpers.tiny_config(policy))
    (fp8_format, fp8_choice), (fp4_format, fp4_choice) = (
        low_bit_advice.matmul_formats_of(settings))
    self.assertEqual(
        low_bit_advice.suggestion_flags(
            settings, dict(low_bit_modules='*/fc1', keep_fp8_setting=''),
            fp8_format, fp8_choice),
        [*first, "--config.precision.low_bit.modules='*/fc1'",
         '--config.precision.low_bit.format=fp8',
         '--config.precision.low_bit.scaling=current'])
    flags = low_bit_advice.suggestion_flags(
        settings, dict(low_bit_modules='*/fc1', keep_fp8_setting='*/fc2'),
        fp4_format, fp4_choice)
    self.assertEqual(flags[:len(first) + 2],
                     [*first, "--config.precision.low_bit.modules='*/fc1'",
                      '--config.precision.low_bit.format=nvfp4'])
    self.assertEqual(flags[-1], "--config.precision.low_bit.keep_fp8='*/fc2'")


@helpers.long_running
class Fp8AdviceTest(absltest.TestCase):

  def test_a_weight_e4m3_cannot_hold_is_named_and_only_it(self):
    config = helpers.tiny_config(
        'params=float32,compute=bfloat16,output=float32', dropout_rate=0.0,
        num_layers=2)
    config.batch_size = 8
    exp = experiment.build_without_data(
        variants.float32_reference(settings_lib.parse(config)))
    params = exp.strategy.init_state().params
    # All of this kernel but one output's column 1e-4 of that column's
    # values: under one scale per tensor it underflows; MX's blocks (along
    # the input features, a column each here) keep every column.
    w = np.asarray(params[PLANTED]['w']) * 1e-4
    w[:, 0] = 10.0
    params = dict(params, **{PLANTED: dict(params[PLANTED],
                                           w=jnp.asarray(w))})
    inputs = [helpers.random_batch(config, 8, seed=i) for i in range(2)]
    limits = helpers.advisor_settings(config.advisor).fp8
    fmt, choice = low_bit_advice.matmul_formats_of(
        settings_lib.parse(config))[0]
    self.assertEqual((fmt.name, choice), ('fp8', 'current'))
    result = low_bit_advice.matmul_advice(settings_lib.parse(config),
                                          exp,
                                          params,
                                          inputs,
                                          fmt,
                                          choice,
                                          limits,
                                          None,
                                          log=lambda _: None)
    rows = {r['path']: r for r in result['modules']}
    self.assertLen(rows, 12)  # Six Linears in each of the two blocks.
    for path, row in rows.items():
      planted = path == PLANTED
      for scaling in ('current', 'delayed'):
        self.assertEqual(row['verdicts'][scaling],
                         'keep-bf16' if planted else 'fp8-ok',
                         (path, scaling, row['reasons']))
      self.assertEqual(row['verdicts']['mx'], 'fp8-ok', path)
    self.assertIn("of the weight's values underflow to 0 in E4M3",
                  rows[PLANTED]['reasons']['current'][0])
    self.assertEqual(result['keep_bf16'], [PLANTED])
    self.assertEqual(result['suggestion']['modules'].split(';'),
                     [p for p in rows if p != PLANTED])
    self.assertEqual(result['suggestion']['flags'][-1],
                     '--config.precision.low_bit.scaling=current')
    # The value pasted is a valid setting that runs fp8 in every other one.
    config.precision.low_bit.modules = result['suggestion']['modules']
    precision = experiment.build_without_data(
        settings_lib.parse(config)).precision
    self.assertEqual(sorted(p for p in rows if precision.runs_low_bit('Linear', p)),
                     sorted(p for p in rows if p != PLANTED))

  def test_every_layer_fine_keeps_the_configured_setting(self):
    self.assertEqual(matmul_formats.modules_setting(
        ['a', 'b'], [], fp8.DEFAULT_MODULES), fp8.DEFAULT_MODULES)


if __name__ == '__main__':
  absltest.main()
