"""The rules between settings, and those a field's own check cannot say.

Each field's own rule (a positive count, a rate in [0, 1)) is declared with
it in `settings/` and runs when the settings are parsed. `experiment.build`
runs `check` first, before a dataset is opened, anything
is compiled or a file is written (a bad setting then costs a second, not a
run), then `check_batches` once the mesh is known. Modules whose objects a
library user builds directly (the loss scaler, DP-SGD's settings) validate
their own arguments, and `check` asks them; what needs data or files (splits,
a checkpoint) is checked where it is read.
"""

import numbers
from typing import Any, NamedTuple

import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.model import policies
from haiku_mp.update import loss_scaling
from haiku_mp.update import optimizer as optimizer_lib
from haiku_mp.vit.data import augment
from haiku_mp.vit.data import auto_augment
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.privacy import dp_sgd
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.settings import fields as settings_fields
from haiku_mp.vit.settings import precision as precision_settings
from haiku_mp.vit.train import compilation

_shown = settings_fields.shown


def _require(ok: bool, setting: str, value: Any, valid: str) -> None:
  if not ok:
    raise errors.ConfigError(f'{setting}={_shown(value)} must be {valid}')


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_training(config: settings_lib.Settings) -> None:
  steps = config.num_train_steps
  if steps == -1:
    _require(config.num_epochs > 0, 'num_epochs', config.num_epochs,
             'positive (or set num_train_steps)')
  if config.ema_decay > 0 and config.ema_horizon > 0:
    raise errors.ConfigError(
        f'ema_decay={config.ema_decay:g} and ema_horizon='
        f'{config.ema_horizon:g} both set the moving average; set one, the '
        'other 0')
  if config.privacy.enabled and augment.mixes(config.data):
    raise errors.ConfigError(
        f'data.mixup_alpha={config.data.mixup_alpha:g} / data.cutmix_alpha='
        f'{config.data.cutmix_alpha:g} with privacy.enabled: a mixed example '
        'holds two, so DP-SGD\'s per-example clipping bounds neither; set '
        'both to 0')


def _check_model(config: settings_lib.Settings) -> policies.Precision:
  model = config.model
  if model.image_size % model.patch_size:
    raise errors.ConfigError(
        f'model.image_size={model.image_size} is not divisible by '
        f'model.patch_size={model.patch_size}')
  if model.embed_dim % model.num_heads:
    raise errors.ConfigError(
        f'model.embed_dim={model.embed_dim} is not divisible by '
        f'model.num_heads={model.num_heads}')
  low_bit = config.precision.low_bit
  # fp8.Fp8 checks its own settings.
  precision = forward_lib.precision_from_config(config)
  _check_state_layout(config.precision, precision)
  if low_bit.gpu and not precision_settings.chooses_modules(low_bit):
    raise errors.ConfigError(
        f'precision.low_bit.gpu={low_bit.gpu} chooses the low-bit Linears '
        "only with precision.low_bit.modules='auto' (now "
        f'{low_bit.modules!r}); set modules=auto, or gpu=\'\'')
  if config.privacy.enabled and low_bit.modules.strip():
    raise errors.ConfigError(
        f'precision.low_bit.modules={low_bit.modules!r} with privacy.enabled: '
        "DP-SGD clips per-example gradients that fp8's per-tensor scales do "
        "not follow (untested); set precision.low_bit.modules='' for a "
        'private run')
  return precision


def _check_state_layout(precision_config: settings_lib.PrecisionSettings,
                        precision: policies.Precision) -> None:
  """Rounding into params only where they are bfloat16."""
  update = precision_config.param_update
  if update == optimizer_lib.MASTER:
    return
  half = sorted(d for d in precision.param_dtypes if d != 'float32')
  if not half:
    raise errors.ConfigError(
        f'precision.param_update={update!r} rounds updates into half-'
        'precision params, but precision.policy and overrides keep every '
        "param in float32: set params=bfloat16 in precision.policy, or "
        "param_update='master'")
  if half != ['bfloat16']:
    raise errors.ConfigError(
        f'precision.param_update={update!r} keeps params without a float32 '
        f'copy only in bfloat16; the policy stores {", ".join(half)} params '
        "(float16's range loses small updates and weights): use "
        "params=bfloat16, or param_update='master'")


def _check_parallel(parallel_config: settings_lib.ParallelSettings) -> None:
  sharding.parse_rules(parallel_config.sharding_rules)


def _check_communication(settings: settings_lib.Settings,
                         precision: policies.Precision) -> None:
  """`parallel.gather_dtype` and `reduce_dtype`, against the strategy, the
  precision, loss scaling and DP-SGD."""
  parallel = settings.parallel
  fp8_gathers = parallel.gather_dtype == 'fp8'
  if fp8_gathers and parallel.strategy != 'fsdp':
    raise errors.ConfigError(
        f'parallel.gather_dtype=fp8: parallel.strategy={parallel.strategy} '
        'gathers no parameters (every device holds them whole); only fsdp '
        "splits them over 'batch'")
  if fp8_gathers and precision.low_bit is None:
    raise errors.ConfigError(
        'parallel.gather_dtype=fp8 gathers the fp8 Linears\' kernels in fp8, '
        'and no Linear runs in fp8 (precision.low_bit.modules is empty): use '
        "'compute', or configs/vit_fp8.py")
  half_reduce = parallel.reduce_dtype == 'compute'
  compute = jnp.dtype(precision.policy.compute_dtype)
  if (half_reduce and compute == jnp.float16 and
      settings.loss_scale.kind == 'none'):
    raise errors.ConfigError(
        'parallel.reduce_dtype=compute sums float16 gradients without a loss '
        "scale (loss_scale.kind='none'): small ones flush to zero; set "
        "loss_scale.kind='dynamic', or reduce in 'float32'")
  if settings.privacy.enabled and parallel.strategy == 'fsdp':
    raise errors.ConfigError(
        'parallel.strategy=fsdp with privacy.enabled: DP-SGD computes its '
        'gradients per example in its own step, which does not gather '
        'parameters; use pjit or pmap')
  if settings.privacy.enabled and half_reduce:
    raise errors.ConfigError(
        'parallel.reduce_dtype=compute with privacy.enabled: DP-SGD sums its '
        "clipped gradients in float32; use 'float32'")


def _check_data(data: settings_lib.DataSettings, image_size: int) -> None:
  pipeline.check_settings(data)
  ops = len(auto_augment.RANDAUGMENT_OPS)
  _require(data.randaugment_ops <= ops, 'data.randaugment_ops',
           data.randaugment_ops, f'in [1, {ops}] (operations applied to each '
           f'image, drawn among RandAugment\'s {ops})')
  # A crop from beyond half the image's side would be mostly padding.
  most = image_size // 2
  _require(_is_int(data.crop_padding) and 0 <= data.crop_padding <= most,
           'data.crop_padding', data.crop_padding,
           f'an integer in [0, {most}] (half of model.image_size={image_size})')


class Checked(NamedTuple):
  """What the check built on its way, for `experiment.build` to use: the
  objects the settings describe."""
  precision: policies.Precision
  scaler: loss_scaling.LossScaler


def check(settings: settings_lib.Settings) -> Checked:
  """Raises `errors.ConfigError` naming the first setting out of its range
  (each field's own rule ran when the settings were parsed), its value and
  what would be valid; else returns the objects the settings describe that
  it built to check them (each built once)."""
  _check_training(settings)
  precision = _check_model(settings)
  scaler = loss_scaling.LossScaler.from_config(settings.loss_scale)
  _check_parallel(settings.parallel)
  _check_communication(settings, precision)
  _check_data(settings.data, settings.model.image_size)
  dp_sgd.check_settings(settings.privacy)
  compilation.check(settings.compilation_cache_dir)
  return Checked(precision, scaler)


def check_batches(config: settings_lib.Settings, batch_devices: int,
                  process_count: int) -> None:
  """The global batches split evenly over the processes and over the mesh's
  `batch` axis (and, for mixup / CutMix, in pairs on each device)."""
  for name in ('batch_size', 'eval_batch_size'):
    size = getattr(config, name)
    if size % process_count:
      raise errors.ConfigError(
          f'{name}={size} is not divisible by the number of processes '
          f'({process_count})')
    if size % batch_devices:
      raise sharding.ShardingError(
          f'{name}={size} is not divisible by the {batch_devices} devices '
          "of the mesh's 'batch' axis")
  if augment.mixes(config.data) and (config.batch_size // batch_devices) % 2:
    raise errors.ConfigError(
        f'batch_size={config.batch_size} gives each of the {batch_devices} '
        'devices of the batch axis an odd batch, and mixup / CutMix mix its '
        'examples in pairs: make it an even number per device')
