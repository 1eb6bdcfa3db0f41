"""Every config file loads, is locked, and differs from base only where meant."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import glob
import importlib

from absl.testing import absltest
from absl.testing import parameterized

from configs import base
from configs import vit_cpu
from haiku_mp import errors
from haiku_mp.update import loss_scaling
from haiku_mp.vit.model import forward as forward_lib
from tests import helpers

ROOT = helpers.ROOT
CONFIG_NAMES = sorted(os.path.basename(p)[:-3]
                      for p in glob.glob(os.path.join(ROOT, 'configs', '*.py'))
                      if not p.endswith('__init__.py'))


def _flat(tree, prefix=''):
  """{'a.b': value} for a nested config."""
  flat = {}
  for key, value in (tree.to_dict() if prefix == '' else tree).items():
    if isinstance(value, dict):
      flat.update(_flat(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


class ConfigsTest(parameterized.TestCase):

  @parameterized.parameters(*CONFIG_NAMES)
  def test_loads_locked_and_builds(self, name):
    config = importlib.import_module(f'configs.{name}').get_config()
    with self.assertRaises(AttributeError):
      config.batch_sise = 3
    forward_lib.precision_from_config(config)
    loss_scaling.LossScaler.from_config(config.loss_scale)

  @parameterized.parameters(
      ('vit_fp32', {}),
      ('vit_bf16', {'precision.policy':
                    'params=float32,compute=bfloat16,output=float32'}),
      ('vit_fp16', {'precision.policy':
                    'params=float32,compute=float16,output=float32',
                    'loss_scale.kind': 'dynamic',
                    'loss_scale.initial': 2.0**15}),
      ('vit_pure_bf16', {'precision.policy':
                         'params=bfloat16,compute=bfloat16,output=float32',
                         'precision.param_update': 'stochastic',
                         'precision.mu_dtype': 'bfloat16',
                         'precision.nu_dtype': 'bfloat16'}),
      ('vit_pure_bf16_8bit', {'precision.policy':
                              'params=bfloat16,compute=bfloat16,output=float32',
                              'precision.param_update': 'stochastic',
                              'precision.mu_dtype': 'float8_blocks',
                              'precision.nu_dtype': 'float8_blocks'}),
      *((f'vit_{fmt}', {'precision.policy':
                        'params=float32,compute=bfloat16,output=float32',
                        'precision.low_bit.modules': '*/encoder_block_*',
                        'precision.low_bit.format': fmt})
        for fmt in ('nvfp4', 'mxfp4')))
  def test_variants_differ_only_in_precision(self, name, expected):
    reference = _flat(base.get_config())
    config = _flat(importlib.import_module(f'configs.{name}').get_config())
    diff = {k: v for k, v in config.items() if reference[k] != v}
    self.assertEqual(diff, {k: v for k, v in expected.items()
                            if reference[k] != v})

  def test_unknown_variant_names_the_variants(self):
    with self.assertRaisesRegex(
        errors.ConfigError,
        r"^unknown variant 'fp4'; expected one of \('fp32', 'bf16', "
        r"'fp16', 'fp8', 'nvfp4', 'mxfp4', 'pure_bf16', 'pure_bf16_8bit'\)$"):
      vit_cpu.get_config('fp4')

  @parameterized.parameters('vit_cpu', 'vit_cpu_recipe', 'vit_recipe')
  def test_pure_bf16_variant_keeps_no_float32_state_but_the_average(
      self, name):
    config = importlib.import_module(f'configs.{name}').get_config(
        'pure_bf16')
    bf16 = importlib.import_module(f'configs.{name}').get_config('bf16')
    self.assertEqual(config.precision.param_update, 'stochastic')
    self.assertEqual((config.precision.mu_dtype, config.precision.nu_dtype),
                     ('bfloat16', 'bfloat16'))
    self.assertTrue(forward_lib.precision_from_config(config).half_params)
    diff = {k for k, v in _flat(config).items() if _flat(bf16)[k] != v}
    self.assertEqual(diff, {'precision.policy', 'precision.param_update',
                            'precision.mu_dtype', 'precision.nu_dtype'})
    # And 8-bit moments on the same params: the moments alone differ.
    state8 = importlib.import_module(f'configs.{name}').get_config(
        'pure_bf16_8bit')
    diff = {k for k, v in _flat(state8).items() if _flat(config)[k] != v}
    self.assertEqual(diff, {'precision.mu_dtype', 'precision.nu_dtype'})
    self.assertEqual(state8.precision.mu_dtype, 'float8_blocks')


if __name__ == '__main__':
  absltest.main()
