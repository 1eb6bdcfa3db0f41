"""The settings' schema: every field typed and documented, the config files
and a run's config.json parsed into frozen settings, and a value of the
wrong type named in one line."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import dataclasses
import glob
import importlib
import json
import typing

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections

from configs import base
from configs import vit_cpu
from haiku_mp import errors
from haiku_mp.vit import settings
from haiku_mp.vit.settings import fields
from haiku_mp.vit.train import run_dir
from tests import helpers

# A run's config.json written before the schema existed, and before
# `ema_horizon`, `model.patch_init`, the 4-bit and 8-bit settings and
# `data.mixing_*` did (its `data.data_dir` blanked).
_OLD_CONFIG = os.path.join(helpers.ROOT, 'tests', 'data',
                           'config_before_settings.json')


# Every config file, and each variant of those that take one.
_CONFIGS = [
    (os.path.basename(path)[:-3], ())
    for path in sorted(glob.glob(os.path.join(helpers.ROOT, 'configs', '*.py')))
    if not path.endswith('__init__.py')
] + [(name, (variant,)) for name in ('vit_cpu', 'vit_cpu_recipe', 'vit_recipe')
     for variant in vit_cpu.VARIANTS]


def _nested(flat):
  """Dotted settings as the tree `settings.parse` reads."""
  tree = {}
  for key, value in flat.items():
    *groups, name = key.split('.')
    holder = tree
    for group in groups:
      holder = holder.setdefault(group, {})
    holder[name] = value
  return tree


class SchemaTest(absltest.TestCase):

  def test_every_field_has_a_type_its_default_has_and_a_doc(self):
    for path, doc, is_group in fields.documented(settings.Settings):
      self.assertTrue(doc, path)
    for kind in (settings.Settings, settings.DataSettings,
                 settings.PrecisionSettings, settings.LowBitSettings):
      hints = typing.get_type_hints(kind)
      for field in dataclasses.fields(kind):
        default = getattr(kind(), field.name)
        hint = hints[field.name]
        want = typing.get_origin(hint) or hint
        self.assertIsInstance(default, want, f'{kind.__name__}.{field.name}')

  def test_base_is_the_schemas_defaults(self):
    config = base.get_config()
    self.assertIsInstance(config, ml_collections.ConfigDict)
    self.assertEqual(settings.parse(config), settings.Settings())
    with self.assertRaises(AttributeError):  # Locked: no new field.
      config.batch_sise = 2

  def test_settings_are_frozen(self):
    parsed = settings.parse(base.get_config())
    with self.assertRaises(dataclasses.FrozenInstanceError):
      parsed.data.mixup_alpha = 0.5
    changed = dataclasses.replace(
        parsed, data=dataclasses.replace(parsed.data, mixup_alpha=0.5))
    self.assertEqual(changed.data.mixup_alpha, 0.5)
    self.assertEqual(parsed.data.mixup_alpha, 0.0)


class ParseTest(parameterized.TestCase):

  def test_a_flag_value_takes_the_fields_type(self):
    config = base.get_config()
    config.learning_rate = 1  # ml_collections keeps an int given to a float.
    config.data.crop_area = [0.5, 1]
    parsed = settings.parse(config)
    self.assertIsInstance(parsed.learning_rate, float)
    self.assertEqual(parsed.data.crop_area, (0.5, 1.0))
    self.assertIsInstance(parsed.data.crop_area[1], float)

  def test_a_json_round_trip_gives_the_same_settings(self):
    """config.json holds lists where the settings hold tuples."""
    config = base.get_config()
    config.parallel.mesh_shape = (4, 2)
    again = json.loads(json.dumps(config.to_dict()))
    self.assertEqual(again['parallel']['mesh_shape'], [4, 2])
    self.assertEqual(settings.parse(again), settings.parse(config))
    self.assertEqual(settings.parse(again).parallel.mesh_shape, (4, 2))

  def test_a_config_json_from_before_the_schema_parses(self):
    with open(_OLD_CONFIG) as f:
      old = json.load(f)
    self.assertNotIn('patch_init', old['model'])
    parsed = settings.parse(_nested(run_dir.flat_settings(old)))
    # Its own values, and the defaults of the fields it lacks.
    self.assertEqual(parsed.batch_size, old['batch_size'])
    self.assertEqual(parsed.data.mixup_alpha, old['data']['mixup_alpha'])
    self.assertEqual(parsed.data.crop_area, tuple(old['data']['crop_area']))
    self.assertEqual(parsed.model.patch_init,
                     settings.ModelSettings().patch_init)
    self.assertEqual(parsed.data.mixing_off_share, 0.0)

  @parameterized.named_parameters(
      ('string_for_int', {'batch_size': '128'},
       "batch_size='128' must be an integer"),
      ('bool_for_float', {'learning_rate': True},
       'learning_rate=True must be a number'),
      ('fraction_for_int', {'model': {'num_layers': 2.5}},
       'model.num_layers=2.5 must be an integer'),
      ('item_of_a_tuple', {'parallel': {'mesh_shape': [4, 'x']}},
       "parallel.mesh_shape=(4, 'x'): expected two positive integers"),
      ('item_of_the_mean', {'data': {'mean': [0.5, 'x', 0.5]}},
       "data.mean=(0.5, 'x', 0.5): expected 3 numbers, one per channel"),
      ('int_for_tuple', {'data': {'crop_area': 8}},
       'data.crop_area=8: expected (min, max) fractions of the image area'),
      # A field that says what it takes says so.
      ('word_for_a_mesh', {'parallel': {'mesh_shape': ('4x2',)}},
       "parallel.mesh_shape='4x2': expected two positive integers (batch, "
       'model) like (4,2)'),
      ('int_for_bool', {'data': {'flip': 1}},
       'data.flip=1 must be true or false'),
      ('unknown_name', {'precision': {'low_bit': {'scalling': 'mx'}}},
       'precision.low_bit.scalling: no such setting'),
      # 0.1's name of precision.low_bit, retired in 0.2.0.
      ('retired_group', {'precision': {'fp8': {'scaling': 'mx'}}},
       'precision.fp8: no such setting'),
  )
  def test_a_wrong_value_is_named_in_one_line(self, values, message):
    with self.assertRaises(errors.ConfigError) as raised:
      settings.parse(values)
    self.assertStartsWith(str(raised.exception), message)
    self.assertNotIn('\n', str(raised.exception))

  def test_a_field_that_says_nothing_is_told_its_type(self):

    @fields.frozen
    class Pair:
      sizes: tuple[int, ...] = fields.setting((1, 2), 'Two sizes.')

    with self.assertRaises(errors.ConfigError) as raised:
      fields.parse(Pair, {'sizes': [1, 'x']}, 'pair.')
    self.assertEqual(str(raised.exception),
                     "pair.sizes[1]='x' must be an integer")
    with self.assertRaises(errors.ConfigError) as raised:
      fields.parse(Pair, {'sizes': 3}, 'pair.')
    self.assertEqual(str(raised.exception),
                     'pair.sizes=3 must be a tuple of integers')

  def test_a_stored_config_reads_an_old_group_under_its_new_name(self):
    saved = run_dir.flat_settings({'precision': {'fp8': {
        'modules': 'Linear', 'format': 'nvfp4'}}})
    self.assertEqual(saved, {'precision.low_bit.modules': 'Linear',
                             'precision.low_bit.format': 'nvfp4'})

  def test_an_integral_float_is_an_integer(self):
    self.assertEqual(settings.parse({'batch_size': 256.0}).batch_size, 256)

  @parameterized.named_parameters(
      ('parse', lambda: settings.parse({'parallel': {'strategy': 'dp'}})),
      ('replace', lambda: settings.replace(settings.Settings(),
                                           parallel=dict(strategy='dp'))),
  )
  def test_a_choice_is_checked_by_its_field(self, make):
    with self.assertRaises(errors.ConfigError) as raised:
      make()
    self.assertEqual(
        str(raised.exception),
        "parallel.strategy: unknown value 'dp'; expected one of ('single', "
        "'pmap', 'pjit', 'fsdp')")

  def test_the_choices_a_field_declares_are_those_the_code_makes(self):
    """The names a field accepts are the ones the module above it builds
    (declared in the settings, which import no application module)."""
    # Imported here: the module under test is the settings, which stand
    # below these.
    from haiku_mp.vit.parallel import strategies  # pylint: disable=g-import-not-at-top
    self.assertEqual(settings.parallel.STRATEGIES,
                     tuple(strategies.STRATEGIES))


class ConfigFilesTest(parameterized.TestCase):

  @parameterized.parameters(*_CONFIGS)
  def test_every_config_file_and_variant_parses(self, name, variant):
    module = importlib.import_module(f'configs.{name}')
    config = module.get_config(*variant)
    parsed = settings.parse(config)
    self.assertEqual(fields.to_dict(parsed), config.to_dict())
    self.assertEqual(settings.parse(fields.to_config_dict(parsed)), parsed)


if __name__ == '__main__':
  absltest.main()
