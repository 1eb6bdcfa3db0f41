"""Every bad input of docs/bad_input.md's table through the real command
line: one line `error: ...` naming it, printed once (no absl E-line repeats
it), exit status 2 for a usage error, no traceback, and the existing run
directory and checkpoint untouched."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import contextlib
import glob
import hashlib
import io
import re
import shutil
import subprocess
import tempfile
import textwrap
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from haiku_mp import errors
from haiku_mp.vit.train import run_dir
from launch import cli
from tests import fake_cifar10
from tests import helpers

TINY = ['--config.data.source=synthetic', '--config.num_train_steps=2',
        '--config.log_every_steps=1', '--config.eval_every_steps=2',
        '--config.checkpoint_every_steps=1', '--config.batch_size=8',
        '--config.eval_batch_size=8', '--config.data.synthetic_eval_examples=8',
        '--config.data.synthetic_train_examples=64', *helpers.TINY_MODEL_FLAGS]


# An absl ERROR log line: E, then MMDD.
_ABSL_ERROR = re.compile(r'^E\d{4} ')


# fp8 matmuls need a bfloat16 (or float32) compute dtype: the base run's is
# float16.
_BF16 = '--config.precision.policy=p=f32,c=bf16,o=f32'

def _train(workdir, *flags, devices=8, config='configs/vit_fp16.py'):
  return helpers.run_module('launch.train', f'--config={config}',
                            f'--workdir={workdir}', *TINY, *flags,
                            devices=devices)


def _digest(directory):
  """A hash of every file (path and bytes) under `directory`."""
  h = hashlib.sha256()
  for path in sorted(glob.glob(f'{directory}/**', recursive=True)):
    if os.path.isfile(path):
      h.update(os.path.relpath(path, directory).encode())
      with open(path, 'rb') as f:
        h.update(f.read())
  return h.hexdigest()


@helpers.long_running
class BadInputTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    cls.finished = os.path.join(cls.tmp, 'finished')
    # A warmup as long as the run: valid, with a warning.
    result = _train(cls.finished, '--config.warmup_steps=2')
    assert result.returncode == 0, result.stderr[-3000:]
    cls.finished_stderr = result.stderr

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp)
    super().tearDownClass()

  def _assert_one_line_error(self, result, message, status=cli.EXIT_USAGE):
    """`message` in the one `error:` line, the last, and in no absl ERROR
    line; exit `status` (None: any but 0). Returns the line."""
    if status is None:
      self.assertNotEqual(result.returncode, 0)
    else:
      self.assertEqual(result.returncode, status, result.stderr[-3000:])
    self.assertNotIn('Traceback', result.stderr)
    lines = result.stderr.strip().splitlines()
    self.assertLen([l for l in lines if l.startswith('error:')], 1,
                   result.stderr[-3000:])
    self.assertStartsWith(lines[-1], 'error: ')
    self.assertIn(message, lines[-1])
    self.assertEmpty([l for l in lines
                      if _ABSL_ERROR.match(l) and message in l])
    return lines[-1]

  def test_warmup_as_long_as_the_run_is_a_warning(self):
    self.assertRegex(
        self.finished_stderr, r"(?m)^W\d{4} .*warmup_steps=2 is not shorter "
        r"than the run's 2 steps: the learning rate rises for the whole run "
        'and never decays$')

  @parameterized.named_parameters(
      ('config_file_missing', ['--config=configs/vit_fp61.py', 'WORKDIR'],
       'error: --config=configs/vit_fp61.py: no such file; the configs are '
       'configs/base.py, configs/vit_bf16.py, configs/vit_cpu.py, '
       'configs/vit_cpu_recipe.py, configs/vit_fp16.py, configs/vit_fp32.py, '
       'configs/vit_fp8.py, configs/vit_mxfp4.py, configs/vit_nvfp4.py, '
       'configs/vit_pure_bf16.py, configs/vit_pure_bf16_8bit.py, '
       'configs/vit_recipe.py'),
      ('config_variant_unknown', ['--config=configs/vit_cpu.py:fp4',
                                  'WORKDIR'],
       "error: --config=configs/vit_cpu.py:fp4: unknown variant 'fp4'; "
       "expected one of ('fp32', 'bf16', 'fp16', 'fp8', 'nvfp4', 'mxfp4', "
       "'pure_bf16', 'pure_bf16_8bit')"),
      ('required_flag_missing', ['--config=configs/vit_fp16.py'],
       'error: --workdir is required'),
      # A missing file failed every override of its fields with a 58-line
      # traceback.
      ('config_file_missing_with_an_override',
       ['--config=configs/vit_fp61.py', '--config.batch_size=3', 'WORKDIR'],
       'error: --config=configs/vit_fp61.py: no such file; the configs are '
       'configs/base.py, '),
      ('a_variant_to_a_config_without_one',
       ['--config=configs/vit_fp32.py:bf16', 'WORKDIR'],
       'error: --config=configs/vit_fp32.py:bf16: configs/vit_fp32.py takes '
       'no variant (:bf16); the configs that do are configs/vit_cpu.py, '
       'configs/vit_cpu_recipe.py, configs/vit_recipe.py (:VARIANT, one of '
       "('fp32', 'bf16', 'fp16', 'fp8', 'nvfp4', 'mxfp4', 'pure_bf16', "
       "'pure_bf16_8bit')) and configs/vit_fp8.py (:PLACEMENT, one of "
       "('auto', 'blocks'))"),
      ('fp8_placement_unknown', ['--config=configs/vit_fp8.py:all',
                                 'WORKDIR'],
       "error: --config=configs/vit_fp8.py:all: configs/vit_fp8.py:PLACEMENT: "
       "unknown value 'all'; expected one of ('auto', 'blocks')"),
      # A 56-line traceback ending in a SyntaxError.
      # A file of its own: README.md's first syntax error moves as it grows.
      ('config_file_not_python',
       ['--config=tests/data/not_python.txt', 'WORKDIR'],
       'error: --config=tests/data/not_python.txt: tests/data/not_python.txt '
       'is not Python (SyntaxError at line 1: unterminated string literal '
       '(detected at line 1)); --config takes a config file: Python with a '
       'get_config() that returns the settings, like configs/vit_cpu.py'),
      # "error: IsADirectoryError: [Errno 21] Is a directory: 'configs'".
      ('config_file_a_directory', ['--config=configs', 'WORKDIR'],
       'error: --config=configs: configs is a directory; --config takes a '
       'config file: Python with a get_config() that returns the settings: '
       'one of configs/base.py, configs/vit_bf16.py, '),
      # "error: AttributeError: module 'config_config' has no attribute
      # 'get_config'"; the same with the path after the flag.
      ('config_file_without_get_config',
       ['--config', 'configs/__init__.py', 'WORKDIR'],
       'error: --config=configs/__init__.py: configs/__init__.py defines no '
       'get_config(); --config takes a config file: Python with a '
       'get_config() that returns the settings, like configs/vit_cpu.py'),
      # Not "not writable (No such file or directory)" once the data had
      # loaded: before the data is looked for (here: a dir without it).
      ('workdir_empty', ['--config=configs/vit_fp16.py', '--workdir=',
                         '--config.data.data_dir=/nonexistent/tfds',
                         '--config.data.download=false'],
       'error: --workdir is required: an empty --workdir= names no '
       'directory'))
  def test_command_line(self, args, message):
    before = _digest(self.finished)
    args = [f'--workdir={self.finished}' if a == 'WORKDIR' else a
            for a in args]
    self._assert_one_line_error(helpers.run_module('launch.train', *args),
                                message)
    self.assertEqual(_digest(self.finished), before)

  @parameterized.named_parameters(
      ('unknown_config_key', ['--config.batch_sise=3'],
       'error: --config.batch_sise: the config has no such setting; did you '
       'mean --config.batch_size?'),
      ('not_a_boolean', ['--config.data.augment=yes'],
       'error: --config.data.augment=yes: expected true or false'),
      ('not_an_integer', ['--config.batch_size=eight'],
       'error: --config.batch_size=eight: expected an integer'),
      ('mesh_shape_not_two_integers', ['--config.parallel.strategy=pjit',
                                       '--config.parallel.mesh_shape=4x2'],
       "error: parallel.mesh_shape='4x2': expected two positive integers "
       '(batch, model) like (4,2); one may be -1 (the remaining devices)'),
      # A tuple's items are typed by the settings' parse, before any range.
      ('mean_not_numbers', ['--config.data.mean=a,b,c'],
       "error: data.mean='a,b,c': expected 3 numbers, one per channel"),
      ('eval_batch_size', ['--config.eval_batch_size=-5'],
       'error: eval_batch_size=-5 must be positive'),
      # One step an epoch: a run that took 0 for -1 would end, not hang.
      ('no_train_steps', ['--config.num_train_steps=0',
                          '--config.data.synthetic_train_examples=8'],
       'error: num_train_steps=0 must be positive, or -1 for num_epochs over '
       'the train split'),
      ('negative_learning_rate', ['--config.learning_rate=-1'],
       'error: learning_rate=-1 must be a finite number >= 0'),
      ('heads_not_dividing_embed_dim', ['--config.model.num_heads=3'],
       'error: model.embed_dim=16 is not divisible by model.num_heads=3'),
      ('malformed_override', ['--config.precision.overrides=head'],
       "malformed entry 'head'"),
      ('invalid_policy', ['--config.precision.policy=p=f32,cc=f16'],
       'precision.policy'),
      ('unknown_dtype', ['--config.precision.policy=p=f32,c=float8'],
       "Unknown dtype 'float8'"),
      ('unknown_matmul_precision',
       ['--config.precision.matmul_precision=fastest'],
       "precision.matmul_precision: unknown value 'fastest'"),
      ('unknown_residual_stream', ['--config.precision.residual_stream=f32'],
       "precision.residual_stream: unknown value 'f32'"),
      ('unknown_dot_form', ['--config.precision.dot_form=fast'],
       "precision.dot_form: unknown value 'fast'"),
      ('unknown_dot_platform', ['--config.precision.dot_platform=cuda'],
       "precision.dot_platform: unknown value 'cuda'"),
      ('group_retired_in_0_2', ['--config.precision.fp8.scaling=delayed'],
       '--config.precision.fp8: the config has no such setting'),
      ('unknown_fp8_scaling', ['--config.precision.low_bit.scaling=rowwise'],
       "precision.low_bit.scaling: unknown value 'rowwise'; expected one of "
       "('current', 'delayed', 'mx')"),
      ('fp8_history_below_one', ['--config.precision.low_bit.history_length=0'],
       'precision.low_bit.history_length=0 must be an integer >= 1'),
      ('fp8_negative_margin', ['--config.precision.low_bit.margin=-2'],
       'precision.low_bit.margin=-2 must be a finite number >= 0'),
      ('fp8_target_matching_nothing',
       ['--config.precision.low_bit.modules=*/decoder', _BF16],
       "precision.low_bit.modules: target '*/decoder' matches no module class or "
       'module path'),
      ('fp8_on_a_module_without_fp8_matmuls',
       ['--config.precision.low_bit.modules=LayerNorm', _BF16],
       "precision.low_bit.modules: target 'LayerNorm' selects no Linear "
       '(LayerNorm): only Linear layers run fp8 matmuls'),
      ('fp8_under_float16',
       ['--config.precision.low_bit.modules=*/encoder_block_*',
        '--config.precision.policy=p=f32,c=f16,o=f32'],
       'precision.low_bit.modules: fp8 matmuls need a bfloat16 or float32 '
       'compute dtype, not float16'),
      ('unknown_low_bit_format', ['--config.precision.low_bit.format=fp4'],
       "precision.low_bit.format: unknown value 'fp4'; expected one of "
       "('fp8', 'nvfp4', 'mxfp4')"),
      ('four_bits_with_delayed_scaling',
       ['--config.precision.low_bit.modules=*/encoder_block_*', _BF16,
        '--config.precision.low_bit.format=nvfp4',
        '--config.precision.low_bit.scaling=delayed'],
       'precision.low_bit.scaling=delayed with precision.low_bit.format=nvfp4: '
       '4-bit formats scale per block themselves'),
      ('four_bit_blocks_that_do_not_divide',
       ['--config.precision.low_bit.modules=*/encoder_block_*', _BF16,
        '--config.precision.low_bit.format=mxfp4'],
       'precision.low_bit.format=mxfp4: vit/encoder_block_0/attention/query: '
       'input features: 16, not a multiple of 32'),
      ('fp8_kept_without_4_bits', ['--config.precision.low_bit.keep_fp8=*/fc1'],
       'precision.low_bit.keep_fp8: keeps fp8 among 4-bit Linears; set '
       "precision.low_bit.format to 'nvfp4' or 'mxfp4' and precision.low_bit.modules"),
      ('fp8_kept_outside_the_4_bit_linears',
       ['--config.precision.low_bit.modules=*/encoder_block_*', _BF16,
        '--config.precision.low_bit.format=nvfp4',
        '--config.precision.low_bit.keep_fp8=*/head'],
       "precision.low_bit.keep_fp8: target '*/head' selects no Linear that "
       'precision.low_bit.modules runs in 4 bits'),
      ('unknown_param_update', ['--config.precision.param_update=floor'],
       "precision.param_update: unknown value 'floor'; expected one of "
       "('master', 'nearest', 'stochastic', 'kahan')"),
      ('stochastic_rounding_of_float32_params',
       ['--config.precision.param_update=stochastic'],
       "precision.param_update='stochastic' rounds updates into half-"
       'precision params, but precision.policy and overrides keep every '
       'param in float32'),
      ('no_master_for_float16_params',
       ['--config.precision.param_update=kahan',
        '--config.precision.policy=p=f16,c=f16,o=f32'],
       "precision.param_update='kahan' keeps params without a float32 copy "
       'only in bfloat16; the policy stores float16 params'),
      ('unknown_moment_dtype', ['--config.precision.nu_dtype=float16'],
       "precision.nu_dtype: unknown value 'float16'; expected one of "
       "('float32', 'bfloat16', 'float8_blocks')"),
      ('moment_block_of_no_values',
       ['--config.precision.moment_block_size=0'],
       'precision.moment_block_size=0 must be positive'),
      ('unknown_remat', ['--config.remat=some'],
       "remat: unknown value 'some'"),
      ('dropout_rate_out_of_range', ['--config.model.dropout_rate=1.5'],
       'model.dropout_rate=1.5 must be in [0, 1)'),
      ('moving_average_set_twice', ['--config.ema_decay=0.999',
                                    '--config.ema_horizon=0.05'],
       'ema_decay=0.999 and ema_horizon=0.05 both set the moving average'),
      ('non_positive_batch', ['--config.batch_size=-8'], 'batch_size=-8'),
      ('batch_not_divisible', ['--config.parallel.strategy=pmap',
                               '--config.parallel.mesh_shape=(8,1)',
                               '--config.batch_size=12'],
       'batch_size=12 is not divisible'),
      ('mesh_too_large', ['--config.parallel.strategy=pjit',
                          '--config.parallel.mesh_shape=(8,2)'],
       'needs 16 devices; there are 8'),
      ('unknown_strategy', ['--config.parallel.strategy=dp'],
       "parallel.strategy: unknown value 'dp'; expected one of ('single', "
       "'pmap', 'pjit', 'fsdp')"),
      ('unknown_loss_scale', ['--config.loss_scale.kind=auto'],
       "loss_scale.kind: unknown value 'auto'"),
      ('non_positive_layer_norm_epsilon',
       ['--config.model.layer_norm_epsilon=0'],
       'model.layer_norm_epsilon=0 must be positive'),
      ('privacy_delta_out_of_range', ['--config.privacy.enabled=true',
                                      '--config.privacy.delta=2'],
       'privacy.delta=2.0 must be in (0, 1)'),
      ('fp8_with_privacy', ['--config.privacy.enabled=true', _BF16,
                            '--config.precision.low_bit.modules=*/encoder_block_*'],
       "precision.low_bit.modules='*/encoder_block_*' with privacy.enabled: "
       'DP-SGD clips per-example gradients'),
      ('unknown_augmentation_policy', ['--config.data.policy=trivialaugment'],
       "data.policy: unknown value 'trivialaugment'; expected one of ('none', "
       "'randaugment', 'autoaugment')"),
      ('no_prefetch', ['--config.data.prefetch_batches=0'],
       'data.prefetch_batches=0 must be at least 1'),
      ('randaugment_ops_beyond_the_operations',
       ['--config.data.randaugment_ops=99'],
       'data.randaugment_ops=99 must be in [1, 14]'),
      ('crop_padding_beyond_half_the_image', ['--config.data.crop_padding=100'],
       'data.crop_padding=100 must be an integer in [0, 16]'),
      ('too_many_steps_in_flight', ['--config.steps_in_flight=40'],
       'steps_in_flight=40 must be an integer in [1, 16]'),
      ('negative_stall_timeout', ['--config.stall_timeout_sec=-1'],
       'stall_timeout_sec=-1 must be a finite number of seconds >= 0'),
      ('heartbeat_timeout_below_its_range',
       ['--config.parallel.heartbeat_timeout_sec=2'],
       'parallel.heartbeat_timeout_sec=2 must be an integer number of '
       'seconds in [5, 600]'),
      ('loss_scale_period_of_a_static_scale',
       ['--config.loss_scale.kind=static', '--config.loss_scale.period=0'],
       'loss_scale.period: must be a positive integer, got 0'),
      ('compilation_cache_dir_a_file',
       [f'--config.compilation_cache_dir={os.path.abspath(__file__)}'],
       f'compilation_cache_dir={os.path.abspath(__file__)} is a file, not a '
       'directory'),
      ('batch_larger_than_the_train_split',
       ['--config.batch_size=16', '--config.data.synthetic_train_examples=10'],
       "batch_size=16 is larger than the 10 examples of data.train_split="),
      ('arrays_path_empty', ['--config.data.source=arrays'],
       'data.arrays_path is empty'),
      ('arrays_path_missing', ['--config.data.source=arrays',
                               '--config.data.arrays_path=/nonexistent/c.npz'],
       'data.arrays_path=/nonexistent/c.npz cannot be read as .npz'),
      ('checkpoint_of_another_model', ['--config.model.embed_dim=32',
                                       '--config.num_train_steps=4'],
       'can be restored'))
  def test_existing_run_untouched(self, flags, message):
    before = _digest(self.finished)
    self._assert_one_line_error(_train(self.finished, *flags), message)
    self.assertEqual(_digest(self.finished), before)

  def test_missing_or_empty_data_dir_offline(self):
    empty = self.enter_context(tempfile.TemporaryDirectory())
    workdir = os.path.join(empty, 'run')
    result = _train(workdir, '--config.data.source=tfds',
                    f'--config.data.data_dir={empty}',
                    '--config.data.download=false')
    self._assert_one_line_error(result, 'data.data_dir')
    # TFDS's own warning about the same dir asks nothing the error does not.
    self.assertNotIn('has no dataset_info.json', result.stderr)
    self.assertEmpty(os.listdir(empty))

  def _assert_data_error(self, result, workdir, *messages):
    self._assert_one_line_error(result, messages[0])
    last = result.stderr.strip().splitlines()[-1]
    for message in messages[1:]:
      self.assertIn(message, last)
    self.assertFalse(os.path.exists(workdir))

  def test_missing_python_module_for_the_download(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    data = fake_cifar10.archive(train_per_file=2, num_test=2)
    with fake_cifar10.serve(data) as (url, requests):
      result = fake_cifar10.train(url, f'{tmp}/run',
                                  f'--config.data.data_dir={tmp}/d',
                                  block='importlib_resources')
    self.assertEmpty(requests)
    self._assert_data_error(result, f'{tmp}/run', "'importlib_resources'",
                            'pip install -r requirements.txt')

  @parameterized.named_parameters(
      ('holds_files', 'data_batch_1.bin',
       'holds files (data_batch_1.bin) and no TFDS cifar10'),
      ('is_a_file', '', 'is a file, not a directory'))
  def test_data_dir_holding_something_else(self, name, message):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    data_dir = os.path.join(tmp, 'cifar-10-batches-bin')
    if name:
      os.makedirs(data_dir)
    with open(os.path.join(data_dir, name) if name else data_dir, 'wb') as f:
      f.write(b'not TFDS data')
    # The listing alone tells, before TensorFlow is imported: the same line
    # where it is not installed (the GPU machines).
    result = helpers.run_module(
        'tests.without_modules', 'tensorflow,tensorflow_datasets',
        'launch.train', '--config=configs/vit_fp16.py', f'--workdir={tmp}/run',
        *TINY, '--config.data.source=tfds', f'--config.data.data_dir={data_dir}',
        devices=8)
    self._assert_data_error(result, f'{tmp}/run', message)

  @parameterized.named_parameters(
      ('past_the_end', '--config.data.train_split=train[:70000]',
       "data.train_split='train[:70000]': Requested slice [:70000] "
       'incompatible with 50000 examples'),
      ('unknown_split', '--config.data.val_split=valid',
       "data.val_split='valid': Unknown split 'valid'"))
  def test_split_the_data_does_not_have(self, flag, message):
    helpers.skip_without_real_data(self)
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    result = _train(f'{tmp}/run', '--config.data.source=tfds',
                    f'--config.data.data_dir={helpers.real_data_dir()}',
                    '--config.data.download=false', flag)
    self._assert_data_error(result, f'{tmp}/run', message)

  @parameterized.named_parameters(
      ('unknown_split', ['--config.data.val_split=validation'],
       "data.val_split='validation': no split 'validation' (there are test, "
       'train)'),
      ('image_size', ['--config.model.image_size=8'],
       'model.image_size=8, but data.source=arrays has 32x32 images'),
      ('not_cifar_arrays', ['--spoil'], 'train_image is float32'),
      ('fewer_classes_than_the_labels', ['--config.model.num_classes=5'],
       'model.num_classes=5, but data.source=arrays has labels up to 9'))
  def test_arrays_the_run_cannot_use(self, flags, message):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    rng = np.random.default_rng(0)
    arrays = dict(train_image=rng.integers(0, 256, (20, 32, 32, 3), np.uint8),
                  train_label=np.arange(20, dtype=np.int32) % 10,
                  test_image=rng.integers(0, 256, (8, 32, 32, 3), np.uint8),
                  test_label=np.zeros(8, np.int32))
    if flags == ['--spoil']:
      arrays['train_image'] = arrays['train_image'].astype(np.float32)
      flags = []
    np.savez(f'{tmp}/c.npz', **arrays)
    result = _train(f'{tmp}/run', '--config.data.source=arrays',
                    f'--config.data.arrays_path={tmp}/c.npz',
                    '--config.data.train_split=train[:16]',
                    '--config.data.val_split=train[16:]', *flags)
    self._assert_data_error(result, f'{tmp}/run', message)

  def test_workdir_not_writable(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    blocker = os.path.join(tmp, 'a_file')
    with open(blocker, 'w') as f:
      f.write('not a directory')
    result = _train(os.path.join(blocker, 'run'))
    self._assert_one_line_error(result, 'is not writable', status=None)

  def test_corrupt_checkpoint_falls_back_or_stops_cleanly(self):
    workdir = os.path.join(self.enter_context(tempfile.TemporaryDirectory()),
                           'run')
    shutil.copytree(self.finished, workdir)
    steps = sorted(os.listdir(f'{workdir}/checkpoints'), key=int)
    self.assertEqual(steps, ['1', '2'])
    for path in glob.glob(f'{workdir}/checkpoints/2/**', recursive=True):
      if os.path.isfile(path):
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 2)
    # The newest is truncated: the run resumes from step 1 and finishes.
    result = _train(workdir, '--config.num_train_steps=3')
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertIn('cannot be restored', result.stderr)
    self.assertIn('at step 1.', result.stderr)
    # Every checkpoint's arrays cut short (their metadata whole): one line
    # that names an array and says what to do, not "See full TensorStore
    # details" (which were shown nowhere).
    for path in glob.glob(f'{workdir}/checkpoints/*/default/ocdbt.process_0/'
                          'd/*'):
      with open(path, 'r+b') as f:
        f.truncate(8)
    result = _train(workdir, '--config.num_train_steps=5')
    line = self._assert_one_line_error(result, 'can be restored')
    self.assertRegex(line, r'unreadable: its array [\w./]+ cannot be read: '
                     'damaged or cut short')
    self.assertIn(f'Move {workdir}/checkpoints aside (or delete it) to train '
                  'this run again from step 0, or give another --workdir',
                  line)
    self.assertNotIn('See full TensorStore details', result.stderr)
    # Every checkpoint corrupt: one line, and nothing rewritten.
    for path in glob.glob(f'{workdir}/checkpoints/**', recursive=True):
      if os.path.isfile(path):
        with open(path, 'wb') as f:
          f.write(b'\0')
    before = _digest(workdir)
    result = _train(workdir, '--config.num_train_steps=5')
    self._assert_one_line_error(result, 'can be restored')
    self.assertEqual(_digest(workdir), before)


class WorkdirCheckTest(parameterized.TestCase):
  """Why a workdir cannot be written, in this process: a read-only mount
  takes root to make, and root may write any other directory."""

  @parameterized.named_parameters(
      ('read_only_mount', os.ST_RDONLY, 'Read-only file system'),
      ('no_permission', 0, 'Permission denied'))
  def test_a_directory_that_cannot_be_written(self, mount_flags, why):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    # What access(2) and statvfs(2) say of a directory on such a mount.
    with mock.patch.object(os, 'access', return_value=False), \
        mock.patch.object(os, 'statvfs',
                          return_value=mock.Mock(f_flag=mount_flags)), \
        self.assertRaises(errors.ConfigError) as raised:
      run_dir.check_writable(f'{tmp}/run')
    self.assertEqual(str(raised.exception),
                     f'--workdir={tmp}/run is not writable ({why}: {tmp})')


class CliTest(parameterized.TestCase):
  """What `cli.run` makes of a command's errors, in this process."""

  @parameterized.named_parameters(
      ('config_error', errors.ConfigError('batch_size=-8 must be positive'),
       'error: batch_size=-8 must be positive', cli.EXIT_USAGE),
      ('run_error', errors.RunError('cannot write DIR/metrics.jsonl: No space '
                                    'left on device'),
       'error: cannot write DIR/metrics.jsonl: No space left on device',
       cli.EXIT_FAILURE),
      ('ctrl_c', KeyboardInterrupt(),
       'interrupted (Ctrl-C); stopped without saving', cli.EXIT_INTERRUPTED),
      ('ctrl_c_the_command_handled', KeyboardInterrupt(
          'a second Ctrl-C: stopped at once'),
       'interrupted: a second Ctrl-C: stopped at once', cli.EXIT_INTERRUPTED))
  def test_one_line_and_the_exit_status(self, error, line, status):

    def main(argv):
      del argv
      raise error

    stderr = io.StringIO()
    with mock.patch.object(sys, 'argv', ['prog']), \
        contextlib.redirect_stderr(stderr), \
        self.assertRaises(SystemExit) as exited:
      cli.run(main, leave_at_exit=False)
    self.assertEqual(exited.exception.code, status)
    self.assertEqual(stderr.getvalue(), line + '\n')

  def test_a_command_leaves_as_the_interpreter_would(self):
    """A command ends without freeing its modules (`cli.run`), and still
    joins its threads, runs the atexit functions, flushes its output and
    exits with its status."""
    out = self.enter_context(tempfile.TemporaryDirectory())
    program = textwrap.dedent('''
        import atexit, os, sys, threading
        from launch import cli

        def main(argv):
          go = threading.Event()

          def late():  # Not a daemon: still running when main returns.
            go.wait()
            with open(os.path.join(sys.argv[1], 'thread'), 'w') as f:
              f.write('joined')

          def at_exit():
            with open(os.path.join(sys.argv[1], 'atexit'), 'w') as f:
              f.write('ran')

          threading.Thread(target=late).start()
          atexit.register(at_exit)
          sys.stdout.write('a line without its newline')
          go.set()
          sys.exit(3)

        cli.run(main)
        ''')
    result = subprocess.run([sys.executable, '-c', program, out],
                            cwd=helpers.ROOT, capture_output=True, text=True,
                            timeout=120)
    self.assertEqual(result.returncode, 3, result.stderr[-3000:])
    self.assertEqual(result.stdout, 'a line without its newline')
    for name, text in (('thread', 'joined'), ('atexit', 'ran')):
      with open(os.path.join(out, name)) as f:
        self.assertEqual(f.read(), text)

  def test_a_bug_keeps_its_traceback(self):

    def main(argv):
      del argv
      raise ZeroDivisionError('a bug')

    with mock.patch.object(sys, 'argv', ['prog']), \
        self.assertRaises(ZeroDivisionError):
      cli.run(main, leave_at_exit=False)


if __name__ == '__main__':
  absltest.main()
