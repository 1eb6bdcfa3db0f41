"""The rules between the settings and what they build, and where they meet
the machine.

Each field's own rule and the rules between fields are declared in
`settings/` and run when the settings are parsed. `experiment.build` builds
the Precision the settings describe, once, and runs `check` against it
before a dataset is opened, anything is compiled or a file is written (a bad
setting then costs a second, not a run), then `check_batches` once the mesh
is known. What needs data or files (splits, a checkpoint) is checked where
it is read.
"""

import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.model import policies
from haiku_mp.update import param_updates
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.settings import dataset as data_settings
from haiku_mp.vit.train import compilation


def _check_state_layout(precision_settings: settings_lib.PrecisionSettings,
                        precision: policies.Precision) -> None:
  """Rounding into params only where they are bfloat16."""
  update = precision_settings.param_update
  if update == param_updates.MASTER:
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


def _check_communication(settings: settings_lib.Settings,
                         precision: policies.Precision) -> None:
  """`parallel.gather_dtype` and `reduce_dtype`, against the precision and
  loss scaling (against the strategy and DP-SGD: when parsed)."""
  parallel = settings.parallel
  if parallel.gather_dtype == 'fp8' and precision.low_bit is None:
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


def check(settings: settings_lib.Settings,
          precision: policies.Precision) -> None:
  """Raises `errors.ConfigError` naming the first setting that the
  `precision` built from `settings` refuses (the training state's layout,
  the dtypes of the collectives), or a compilation cache that cannot be a
  directory; its value and what would be valid."""
  _check_state_layout(settings.precision, precision)
  _check_communication(settings, precision)
  compilation.check(settings.compilation_cache_dir)


def check_batches(settings: settings_lib.Settings, batch_devices: int,
                  process_count: int) -> None:
  """The global batches split evenly over the processes and over the mesh's
  `batch` axis (and, for mixup / CutMix, in pairs on each device)."""
  for name in ('batch_size', 'eval_batch_size'):
    size = getattr(settings, name)
    if size % process_count:
      raise errors.ConfigError(
          f'{name}={size} is not divisible by the number of processes '
          f'({process_count})')
    if size % batch_devices:
      raise sharding.ShardingError(
          f'{name}={size} is not divisible by the {batch_devices} devices '
          "of the mesh's 'batch' axis")
  if (data_settings.mixes(settings.data) and
      (settings.batch_size // batch_devices) % 2):
    raise errors.ConfigError(
        f'batch_size={settings.batch_size} gives each of the {batch_devices} '
        'devices of the batch axis an odd batch, and mixup / CutMix mix its '
        'examples in pairs: make it an even number per device')
