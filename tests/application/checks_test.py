"""Every setting's range: the parse and `checks.check` accept every config
file and name each setting out of range, its value and what is valid."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import importlib
import math

from absl import logging
from absl.testing import absltest
from absl.testing import parameterized
import jax

from configs import base
from haiku_mp import errors
from haiku_mp.update import loss_scaling
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.settings import fields as settings_fields
from haiku_mp.vit.train import checks
from haiku_mp.vit.train import experiment
from tests.application import configs_test
from tests import helpers


def _config(**settings):
  """The base config with `settings` ('a.b' keys) set."""
  return helpers.with_settings(base.get_config(), settings)


def _check(config):
  """What `experiment.build` checks before it opens the data: the parse
  (each field and the rules between them), then what the settings describe,
  built (the precision, the sharding rules, the loss scaler), and the
  settings against the precision."""
  settings = settings_lib.parse(config)
  precision = forward_lib.precision_from_config(settings)
  checks.check(settings, precision)
  sharding.rules(settings.parallel)
  loss_scaling.LossScaler.from_config(settings.loss_scale)


# (name, settings, message): one setting out of its range each.
_OUT_OF_RANGE = (
    ('seed', {'seed': -1}, 'seed=-1 must be a non-negative 64-bit integer'),
    ('batch_size', {'batch_size': -8}, 'batch_size=-8 must be positive'),
    ('eval_batch_size', {'eval_batch_size': -5},
     'eval_batch_size=-5 must be positive'),
    ('num_train_steps', {'num_train_steps': 0},
     'num_train_steps=0 must be positive, or -1 for num_epochs'),
    ('num_train_steps_below_minus_one', {'num_train_steps': -2},
     'num_train_steps=-2 must be positive, or -1'),
    ('num_epochs', {'num_epochs': 0}, 'num_epochs=0 must be positive'),
    ('learning_rate', {'learning_rate': -1.0},
     'learning_rate=-1 must be a finite number >= 0'),
    ('learning_rate_nan', {'learning_rate': math.nan},
     'learning_rate=nan must be a finite number >= 0'),
    ('learning_rate_inf', {'learning_rate': math.inf},
     'learning_rate=inf must be a finite number >= 0'),
    ('weight_decay', {'weight_decay': -0.1},
     'weight_decay=-0.1 must be a finite number >= 0'),
    ('warmup_steps', {'warmup_steps': -3}, 'warmup_steps=-3 must be >= 0'),
    ('grad_clip_norm', {'grad_clip_norm': -1.0},
     'grad_clip_norm=-1 must be >= 0 (0: no clipping)'),
    ('grad_clip_norm_nan', {'grad_clip_norm': math.nan},
     'grad_clip_norm=nan must be >= 0'),
    ('log_every_steps', {'log_every_steps': 0},
     'log_every_steps=0 must be positive'),
    ('eval_every_steps', {'eval_every_steps': -1},
     'eval_every_steps=-1 must be positive'),
    ('checkpoint_every_steps', {'checkpoint_every_steps': 0},
     'checkpoint_every_steps=0 must be positive'),
    ('keep_checkpoints', {'keep_checkpoints': 0},
     'keep_checkpoints=0 must be positive'),
    ('image_size', {'model.image_size': 0},
     'model.image_size=0 must be positive'),
    ('patch_size', {'model.patch_size': 0},
     'model.patch_size=0 must be positive'),
    ('patch_size_not_dividing', {'model.patch_size': 5},
     'model.image_size=32 is not divisible by model.patch_size=5'),
    ('num_classes', {'model.num_classes': 0},
     'model.num_classes=0 must be positive'),
    ('embed_dim', {'model.embed_dim': -1},
     'model.embed_dim=-1 must be positive'),
    ('mlp_dim', {'model.mlp_dim': 0}, 'model.mlp_dim=0 must be positive'),
    ('num_heads', {'model.num_heads': 0},
     'model.num_heads=0 must be positive'),
    ('num_heads_not_dividing', {'model.num_heads': 5},
     'model.embed_dim=384 is not divisible by model.num_heads=5'),
    ('num_layers', {'model.num_layers': 0},
     'model.num_layers=0 must be positive'),
    ('dropout_rate', {'model.dropout_rate': 1.0},
     'model.dropout_rate=1 must be in [0, 1)'),
    ('layer_norm_epsilon', {'model.layer_norm_epsilon': 0.0},
     'model.layer_norm_epsilon=0 must be positive'),
    ('remat', {'remat': 'some'}, "remat: unknown value 'some'"),
    ('param_update', {'precision.param_update': 'round'},
     "precision.param_update: unknown value 'round'"),
    ('mu_dtype', {'precision.mu_dtype': 'float16'},
     "precision.mu_dtype: unknown value 'float16'"),
    ('nu_dtype', {'precision.nu_dtype': 'half'},
     "precision.nu_dtype: unknown value 'half'"),
    ('moment_block_size', {'precision.moment_block_size': -4},
     'precision.moment_block_size=-4 must be positive'),
    ('rounding_into_float32_params', {'precision.param_update': 'kahan'},
     "precision.param_update='kahan' rounds updates into half-precision "
     'params, but precision.policy and overrides keep every param in '
     'float32'),
    ('no_master_for_float16_params', {
        'precision.param_update': 'stochastic',
        'precision.policy': 'params=float16,compute=float16,output=float32'},
     "precision.param_update='stochastic' keeps params without a float32 "
     'copy only in bfloat16; the policy stores float16 params'),
    ('no_master_for_float16_overrides', {
        'precision.param_update': 'nearest',
        'precision.policy': 'params=bfloat16,compute=bfloat16,output=float32',
        'precision.overrides': '*/head:p=f16,c=f16,o=f32'},
     'the policy stores bfloat16, float16 params'),
    ('policy', {'precision.policy': 'p=f32,c=float8'}, 'precision.policy'),
    ('overrides', {'precision.overrides': 'head'},
     "precision.overrides: malformed entry 'head'"),
    ('dot_form', {'precision.dot_form': 'fast'},
     "precision.dot_form: unknown value 'fast'"),
    ('dot_platform', {'precision.dot_platform': 'cuda'},
     "precision.dot_platform: unknown value 'cuda'"),
    ('loss_scale_kind', {'loss_scale.kind': 'auto'},
     "loss_scale.kind: unknown value 'auto'"),
    ('loss_scale_factor', {'loss_scale.kind': 'dynamic',
                           'loss_scale.factor': 1.0},
     'loss_scale.factor: must be > 1, got 1.0'),
    ('loss_scale_period', {'loss_scale.kind': 'dynamic',
                           'loss_scale.period': 0},
     'loss_scale.period: must be a positive integer, got 0'),
    ('strategy', {'parallel.strategy': 'dp'},
     "parallel.strategy: unknown value 'dp'; expected one of ('single', "
     "'pmap', 'pjit', 'fsdp')"),
    ('gather_dtype', {'parallel.gather_dtype': 'bf16'},
     "parallel.gather_dtype: unknown value 'bf16'"),
    ('reduce_dtype', {'parallel.reduce_dtype': 'fp8'},
     "parallel.reduce_dtype: unknown value 'fp8'"),
    ('fp8_gathers_without_fp8', {'parallel.strategy': 'fsdp',
                                 'parallel.gather_dtype': 'fp8'},
     'parallel.gather_dtype=fp8 gathers the fp8 Linears\' kernels in fp8, '
     'and no Linear runs in fp8'),
    ('fp8_gathers_under_pmap', {
        'parallel.strategy': 'pmap', 'parallel.gather_dtype': 'fp8',
        'precision.low_bit.modules': 'Linear'},
     'parallel.gather_dtype=fp8: parallel.strategy=pmap gathers no '
     'parameters'),
    ('float16_reduction_without_loss_scale', {
        'precision.policy': 'params=float32,compute=float16,output=float32',
        'parallel.reduce_dtype': 'compute'},
     'parallel.reduce_dtype=compute sums float16 gradients without a loss '
     'scale'),
    ('fsdp_with_privacy', {'parallel.strategy': 'fsdp',
                           'privacy.enabled': True, 'data.augment': False},
     'parallel.strategy=fsdp with privacy.enabled'),
    ('half_reduction_with_privacy', {
        'parallel.reduce_dtype': 'compute', 'privacy.enabled': True,
        'data.augment': False},
     'parallel.reduce_dtype=compute with privacy.enabled'),
    ('rule_over_both_axes',
     {'parallel.sharding_rules': '.*fc1/w=None,batch+model'},
     'shards one dimension over both mesh axes'),
    ('rule_over_batch', {'parallel.sharding_rules': '.*fc1/w=batch,None'},
     "names the 'batch' axis, which holds the data"),
    ('mesh_shape_word', {'parallel.mesh_shape': ('4x2',)},
     "parallel.mesh_shape='4x2': expected two positive integers (batch, "
     'model) like (4,2); one may be -1 (the remaining devices)'),
    ('mesh_shape_one_number', {'parallel.mesh_shape': (4,)},
     'parallel.mesh_shape=(4,): expected two positive integers'),
    ('mesh_shape_fraction', {'parallel.mesh_shape': (4.5, 2)},
     'parallel.mesh_shape=(4.5, 2): expected two positive integers'),
    ('mesh_shape_zero', {'parallel.mesh_shape': (0, 1)},
     'parallel.mesh_shape=(0, 1): expected'),
    ('mesh_shape_two_unknowns', {'parallel.mesh_shape': (-1, -1)},
     'parallel.mesh_shape=(-1, -1): expected'),
    ('sharding_rules', {'parallel.sharding_rules': '.*=batchy'},
     "parallel.sharding_rules: unknown mesh axis 'batchy'"),
    ('data_source', {'data.source': 'disk'},
     "data.source: unknown value 'disk'"),
    ('prefetch_batches', {'data.prefetch_batches': 0},
     'data.prefetch_batches=0 must be at least 1'),
    ('crop_area_above_one', {'data.crop_area': (0.5, 1.5)},
     'data.crop_area=(0.5, 1.5) must be (min, max) fractions of the image '
     'area with 0 < min <= max <= 1'),
    ('crop_area_zero', {'data.crop_area': (0.0, 1.0)},
     'data.crop_area=(0.0, 1.0) must be'),
    ('crop_area_reversed', {'data.crop_area': (1.0, 0.5)},
     'data.crop_area=(1.0, 0.5) must be'),
    ('crop_area_one_number', {'data.crop_area': (0.5,)},
     'data.crop_area=(0.5,) must be'),
    ('crop_aspect_ratio', {'data.crop_aspect_ratio': (0.0, 1.1)},
     'data.crop_aspect_ratio=(0.0, 1.1) must be (min, max) width/height '
     'ratios with 0 < min <= max'),
    ('crop_aspect_ratio_infinite', {'data.crop_aspect_ratio': (1.0,
                                                               math.inf)},
     'data.crop_aspect_ratio=(1.0, inf) must be'),
    ('crop_max_attempts', {'data.crop_max_attempts': 0},
     'data.crop_max_attempts=0 must be positive'),
    ('mean', {'data.mean': (0.5, 0.5)},
     'data.mean=(0.5, 0.5) must be 3 numbers, one per channel'),
    ('std', {'data.std': (0.2, 0.0, 0.2)},
     'data.std=(0.2, 0.0, 0.2) must be 3 positive numbers, one per channel'),
    ('synthetic_train_examples', {'data.synthetic_train_examples': 0},
     'data.synthetic_train_examples=0 must be positive'),
    ('synthetic_eval_examples', {'data.synthetic_eval_examples': -1},
     'data.synthetic_eval_examples=-1 must be positive'),
    ('label_smoothing', {'label_smoothing': 1.0},
     'label_smoothing=1 must be in [0, 1)'),
    ('ema_decay', {'ema_decay': 1.0},
     'ema_decay=1 must be in [0, 1) (0: no moving average)'),
    ('patch_init', {'model.patch_init': 'he_normal'},
     "model.patch_init: unknown value 'he_normal'; expected one of "
     "('lecun_normal', 'xavier_uniform')"),
    ('ema_horizon', {'ema_horizon': 1.5},
     "ema_horizon=1.5 must be in [0, 1] (a share of the run's steps; 0: "
     'ema_decay as set)'),
    ('ema_decay_and_horizon', {'ema_decay': 0.999, 'ema_horizon': 0.05},
     'ema_decay=0.999 and ema_horizon=0.05 both set the moving average; set '
     'one, the other 0'),
    ('drop_path_rate', {'model.drop_path_rate': -0.1},
     'model.drop_path_rate=-0.1 must be in [0, 1)'),
    ('crop', {'data.crop': 'random'},
     "data.crop: unknown value 'random'; expected one of ('resized', 'pad', "
     "'none')"),
    ('crop_padding', {'data.crop_padding': -4},
     'data.crop_padding=-4 must be an integer in [0, 16]'),
    ('data_policy', {'data.policy': 'trivialaugment'},
     "data.policy: unknown value 'trivialaugment'; expected one of ('none', "
     "'randaugment', 'autoaugment')"),
    ('randaugment_ops', {'data.randaugment_ops': 0},
     'data.randaugment_ops=0 must be positive'),
    ('randaugment_magnitude', {'data.randaugment_magnitude': 30.0},
     'data.randaugment_magnitude=30 must be in [0, 10]'),
    ('erasing_probability', {'data.erasing_probability': 1.5},
     'data.erasing_probability=1.5 must be in [0, 1]'),
    ('mixup_alpha', {'data.mixup_alpha': -1.0},
     'data.mixup_alpha=-1 must be a finite number >= 0 (0: off)'),
    ('cutmix_alpha', {'data.cutmix_alpha': math.inf},
     'data.cutmix_alpha=inf must be a finite number >= 0 (0: off)'),
    ('mixing_probability', {'data.mixing_probability': 0.0},
     'data.mixing_probability=0 must be in (0, 1] (to mix nothing, set '
     'data.mixup_alpha and data.cutmix_alpha to 0)'),
    ('mixing_off_share', {'data.mixing_off_share': 1.0},
     'data.mixing_off_share=1 must be in [0, 1) (the share of the run, at '
     'its end, trained without mixing)'),
    ('mixing_with_privacy', {'data.mixup_alpha': 0.8,
                             'privacy.enabled': True},
     "data.mixup_alpha=0.8 / data.cutmix_alpha=0 with privacy.enabled: a "
     "mixed example holds two, so DP-SGD's per-example clipping bounds "
     'neither; set both to 0'),
    ('steps_in_flight', {'steps_in_flight': 17},
     'steps_in_flight=17 must be an integer in [1, 16] (XLA:CPU stalls '
     'multi-device programs when 32 wait on a device)'),
    ('steps_in_flight_zero', {'steps_in_flight': 0},
     'steps_in_flight=0 must be an integer in [1, 16]'),
    ('stall_timeout_sec', {'stall_timeout_sec': -1.0},
     'stall_timeout_sec=-1 must be a finite number of seconds >= 0'),
    ('heartbeat_timeout_below', {'parallel.heartbeat_timeout_sec': 4},
     'parallel.heartbeat_timeout_sec=4 must be an integer number of seconds '
     'in [5, 600]'),
    ('heartbeat_timeout_above', {'parallel.heartbeat_timeout_sec': 601},
     'parallel.heartbeat_timeout_sec=601 must be an integer number of '
     'seconds in [5, 600]'),
    ('compilation_cache_dir', {'compilation_cache_dir': 'README.md'},
     'compilation_cache_dir=README.md is a file, not a directory'),
    ('matmul_precision', {'precision.matmul_precision': 'fastest'},
     "precision.matmul_precision: unknown value 'fastest'"),
    ('residual_stream', {'precision.residual_stream': 'float16'},
     "precision.residual_stream: unknown value 'float16'"),
    ('loss_scale_initial', {'loss_scale.initial': 0.0},
     'loss_scale.initial: must be a positive finite number, got 0.0'),
    # The floor bounds a dynamic scale; a static one may sit below it.
    ('loss_scale_minimum', {'loss_scale.kind': 'dynamic',
                            'loss_scale.minimum': 2.0**16},
     'loss_scale.minimum: must be in (0, loss_scale.initial]'),
    ('loss_scale_hysteresis', {'loss_scale.hysteresis': 0},
     'loss_scale.hysteresis: must be a positive integer, got 0'),
    ('loss_scale_max_consecutive_skips',
     {'loss_scale.max_consecutive_skips': 0},
     'loss_scale.max_consecutive_skips: must be positive, got 0'),
    ('loss_scale_period_of_a_static_scale', {'loss_scale.kind': 'static',
                                           'loss_scale.period': -5},
     'loss_scale.period: must be a positive integer, got -5'),
    ('randaugment_ops_above_the_operations', {'data.randaugment_ops': 99},
     'data.randaugment_ops=99 must be in [1, 14] (operations applied to each '
     "image, drawn among RandAugment's 14)"),
    ('crop_padding_beyond_half_the_image', {'data.crop_padding': 100},
     'data.crop_padding=100 must be an integer in [0, 16] (half of '
     'model.image_size=32)'),
    ('privacy_l2_clip_norm', {'privacy.l2_clip_norm': 0.0},
     'privacy.l2_clip_norm=0.0 must be positive'),
    ('privacy_noise_multiplier', {'privacy.noise_multiplier': -1.0},
     'privacy.noise_multiplier=-1.0 must be >= 0'),
    ('privacy_target_epsilon', {'privacy.target_epsilon': -1.0},
     'privacy.target_epsilon=-1.0 must be >= 0'),
    ('privacy_delta', {'privacy.delta': 1.0},
     'privacy.delta=1.0 must be in (0, 1)'),
    ('privacy_microbatch_size', {'privacy.microbatch_size': -1},
     'privacy.microbatch_size=-1 must be >= 0'),
    ('privacy_padding_stddevs', {'privacy.padding_stddevs': -1.0},
     'privacy.padding_stddevs=-1.0 must be >= 0'),
    ('fp8_scaling', {'precision.low_bit.scaling': 'tensorwise'},
     "precision.low_bit.scaling: unknown value 'tensorwise'"),
    ('low_bit_format', {'precision.low_bit.format': 'fp5'},
     "precision.low_bit.format: unknown value 'fp5'"),
    ('low_bit_gpu', {'precision.low_bit.gpu': 'h300'},
     "precision.low_bit.gpu: unknown value 'h300'; expected one of ('', "
     "'a100', 'h100', 'h200', 'b200')"),
    ('low_bit_gpu_without_auto', {'precision.low_bit.gpu': 'h100',
                                  'precision.low_bit.modules':
                                      '*/encoder_block_*'},
     "precision.low_bit.gpu=h100 chooses the low-bit Linears only with "
     "precision.low_bit.modules='auto' (now '*/encoder_block_*')"),
    ('fp8_history_length', {'precision.low_bit.history_length': 0},
     'precision.low_bit.history_length=0 must be an integer >= 1'),
    ('fp8_margin', {'precision.low_bit.margin': -1.0},
     'precision.low_bit.margin=-1 must be a finite number >= 0'),
    ('fp8_modules_under_float16',
     {'precision.low_bit.modules': '*/encoder_block_*',
      'precision.policy': 'params=float32,compute=float16,output=float32'},
     'precision.low_bit.modules: fp8 matmuls need a bfloat16 or float32 compute '
     'dtype, not float16'),
    ('fp8_modules_with_privacy',
     {'precision.low_bit.modules': '*/encoder_block_*', 'privacy.enabled': True},
     "precision.low_bit.modules='*/encoder_block_*' with privacy.enabled"),
)


# Settings with no range of their own to check here, and where they are.
_CHECKED_ELSEWHERE = {
    'precision.float32_layer_norm': 'a bool: the command line takes only '
                                    'true or false',
    'data.augment': 'a bool', 'data.flip': 'a bool', 'data.download': 'a bool',
    'privacy.enabled': 'a bool',
    'precision.low_bit.two_d_weights': 'a bool', 'precision.low_bit.hadamard': 'a bool',
    'precision.low_bit.stochastic_gradients': 'a bool',
    'data.name': 'against the data: its images and labels '
                 '(tests/commands/bad_input_test.py)',
    'data.data_dir': 'where the data is looked for (tests/commands/bad_input_test.py)',
    'data.arrays_path': 'as it is read (tests/application/npz_source_test.py)',
    'data.train_split': 'against the data (tests/commands/bad_input_test.py)',
    'data.val_split': 'against the data', 'data.test_split': 'against the data',
    'advisor.max_relative_error': 'by launch.lab advise (tests/lab/lab_test.py)',
    'advisor.max_overflow_share': 'by launch.lab advise',
    'advisor.loss_scale_headroom': 'by launch.lab advise',
    'advisor.init_steps': 'by launch.lab advise',
    'advisor.fp8_max_relative_error': 'by launch.lab advise',
    'advisor.fp8_max_underflow_share': 'by launch.lab advise '
                                       '(tests/lab/lab_test.py)',
    'advisor.fp8_max_saturate_share': 'by launch.lab advise',
    'advisor.fp4_max_relative_error': 'by launch.lab advise',
    'advisor.fp4_max_flushed_share': 'by launch.lab advise '
                                     '(tests/lab/lab_test.py)',
    'precision.low_bit.keep_fp8': "against the model's 4-bit Linears, as the "
                              'run is built (tests/library/fp4_test.py, '
                              'bad_input_test.py)',
    'precision.low_bit.modules': "against the model's modules, as the run is "
                             'built (tests/library/fp8_test.py, bad_input_test.py)',
}


def _leaves(config, prefix=''):
  for key, value in config.items():
    if hasattr(value, 'items'):
      yield from _leaves(value, f'{prefix}{key}.')
    else:
      yield f'{prefix}{key}'


class CheckTest(parameterized.TestCase):

  def test_every_setting_has_a_range_here_or_is_checked_elsewhere(self):
    tried = {key for _, settings, _ in _OUT_OF_RANGE for key in settings}
    # The schema's fields (the config's old names are these again).
    schema = settings_lib.Settings()
    unchecked = set(_leaves(settings_fields.to_dict(schema))) - tried - set(
        _CHECKED_ELSEWHERE)
    self.assertEmpty(sorted(unchecked), 'settings with no out-of-range case')


  def test_build_makes_what_the_settings_describe(self):
    """The scaler and the precision the settings describe, built once by
    `experiment.build`; a static scale may sit below the floor, which
    bounds a dynamic one only."""
    config = helpers.with_settings(helpers.tiny_config(), {
        'loss_scale.kind': 'static', 'loss_scale.initial': 0.25,
        'precision.policy': 'params=float32,compute=bfloat16,output=float32',
        'data.source': 'synthetic'})
    exp = experiment.build(settings_lib.parse(config), total_steps=1)
    self.assertEqual((exp.scaler.kind, exp.scaler.initial), ('static', 0.25))
    self.assertEqual(exp.precision.policy.compute_dtype, jax.numpy.bfloat16)

  @parameterized.parameters(*configs_test.CONFIG_NAMES)
  def test_every_config_file_passes(self, name):
    _check(importlib.import_module(f'configs.{name}').get_config())

  @parameterized.named_parameters(
      ('num_train_steps_from_epochs', {'num_train_steps': -1}),
      ('a_given_number_of_steps', {'num_train_steps': 5, 'num_epochs': 0}),
      ('no_learning', {'learning_rate': 0.0}),
      ('clipping_off_and_on', {'grad_clip_norm': math.inf}),
      ('warmup_longer_than_the_run', {'warmup_steps': 10**6}),
      ('seed_zero', {'seed': 0}),
      ('whole_image_crops', {'data.crop_area': (1.0, 1.0),
                             'data.crop_aspect_ratio': (1.0, 1.0)}),
      ('mesh_of_the_remaining_devices', {'parallel.mesh_shape': (-1, 2)}),
      ('mesh_from_json', {'parallel.mesh_shape': [4, 2]}),
      ('dynamic_loss_scale', {'loss_scale.kind': 'dynamic'}),
      ('bfloat16_state_with_a_float32_head', {
          'precision.policy': 'params=bfloat16,compute=bfloat16,output=float32',
          'precision.overrides': '*/head:float32',
          'precision.param_update': 'kahan', 'precision.mu_dtype': 'bfloat16',
          'precision.nu_dtype': 'bfloat16'}),
      ('the_whole_recipe', {'data.crop': 'pad', 'data.policy': 'autoaugment',
                            'data.erasing_probability': 1.0,
                            'data.mixup_alpha': 0.8, 'data.cutmix_alpha': 1.0,
                            'label_smoothing': 0.1,
                            'model.drop_path_rate': 0.1}),
      ('mixing_alphas_without_augmentation_with_privacy',
       {'data.augment': False, 'data.mixup_alpha': 0.8,
        'privacy.enabled': True}))
  def test_valid(self, settings):
    _check(_config(**settings))

  @parameterized.named_parameters(*_OUT_OF_RANGE)
  def test_out_of_range(self, settings, message):
    with self.assertRaises(errors.ConfigError) as raised:
      _check(_config(**settings))
    self.assertIn(message, str(raised.exception))
    self.assertNotIn('\n', str(raised.exception))


class BuildTest(absltest.TestCase):

  def test_mixing_needs_an_even_batch_on_every_device(self):
    config = helpers.tiny_config()
    config.data.mixup_alpha = 0.8
    config.data.source = 'synthetic'
    config.batch_size = 6
    experiment.build(settings_lib.parse(config))  # One device: 6 is even.
    if jax.device_count() < 2:
      self.skipTest('needs several devices (run under the suite\'s XLA_FLAGS)')
    config.parallel.strategy = 'pmap'
    config.parallel.mesh_shape = (2, 1)
    with self.assertRaisesRegex(
        errors.ConfigError,
        r'^batch_size=6 gives each of the 2 devices of the batch axis an odd '
        r'batch, and mixup / CutMix mix its examples in pairs'):
      experiment.build(settings_lib.parse(config), devices=jax.devices()[:2])

  def test_build_checks_first(self):
    config = helpers.tiny_config()
    config.eval_batch_size = -5
    with self.assertRaisesRegex(errors.ConfigError,
                                'eval_batch_size=-5 must be positive'):
      experiment.build(settings_lib.parse(config))

  def test_warmup_as_long_as_the_run_is_a_warning(self):
    config = helpers.tiny_config()
    config.warmup_steps = 10
    with self.assertLogs(logging.get_absl_logger(), 'WARNING') as logs:
      experiment.build(settings_lib.parse(config), total_steps=10)
    self.assertIn("warmup_steps=10 is not shorter than the run's 10 steps: "
                  'the learning rate rises for the whole run and never decays',
                  logs.output[0])
    with self.assertNoLogs(logging.get_absl_logger(), 'WARNING'):
      experiment.build(settings_lib.parse(config), total_steps=11)


if __name__ == '__main__':
  absltest.main()
