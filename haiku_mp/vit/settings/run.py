"""The whole run's settings: the loop's own fields and every area's group.

`configs/base.py` is `default_config()`: the ConfigDict users change with
config files and `--config.FIELD=VALUE` flags is this schema's defaults, so
the schema is the one definition of every field and of its doc.
"""

import math

import ml_collections

from haiku_mp import errors
from haiku_mp.model import remat as remat_lib
from haiku_mp.vit.settings import dataset as data_settings
from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.advisor import AdvisorSettings
from haiku_mp.vit.settings.dataset import DataSettings
from haiku_mp.vit.settings.fields import group
from haiku_mp.vit.settings.fields import setting
from haiku_mp.vit.settings.loss_scale import LossScaleSettings
from haiku_mp.vit.settings.model import ModelSettings
from haiku_mp.vit.settings.parallel import ParallelSettings
from haiku_mp.vit.settings.precision import PrecisionSettings
from haiku_mp.vit.settings.privacy import PrivacySettings

# What `np.random.default_rng` and `jax.random.key` both take.
_MAX_SEED = 2**63 - 1
# The most programs a loop may keep in flight: half XLA:CPU's queue of 32 per
# device, whose filling stalls multi-device programs.
MAX_STEPS_IN_FLIGHT = 16
_FINITE_NON_NEGATIVE = fields.rule(lambda x: 0 <= x < math.inf,
                                   'a finite number >= 0')


@fields.frozen
class Settings:
  """A run: the seeds' reference ViT on CIFAR-10 in float32 by default."""

  seed: int = setting(
      0, 'Params, dropout, data order and augmentation draws.',
      check=fields.rule(lambda s: 0 <= s <= _MAX_SEED,
                        'a non-negative 64-bit integer'))
  batch_size: int = setting(
      128, 'Train images per step, over every device.',
      check=fields.POSITIVE)
  eval_batch_size: int = setting(
      1000, 'Divides val (5,000) and test (10,000).',
      check=fields.POSITIVE)
  num_epochs: int = setting(
      10,
      'Passes over the train split (num_train_steps=-1).')
  num_train_steps: int = setting(-1, '-1: derived from num_epochs.',
      check=fields.rule(
          lambda s: s > 0 or s == -1,
          'positive, or -1 for num_epochs over the train split'))
  learning_rate: float = setting(
      0.001,
      "Adam's peak rate, reached after warmup.",
      check=_FINITE_NON_NEGATIVE)
  weight_decay: float = setting(0.0, "AdamW's decoupled weight decay.",
      check=_FINITE_NON_NEGATIVE)
  warmup_steps: int = setting(0, 'Linear warm-up, then cosine decay to 0.',
      check=fields.rule(lambda s: s >= 0, '>= 0'))
  grad_clip_norm: float = setting(0.0, '0: no clipping.',
      check=fields.rule(lambda n: n >= 0, '>= 0 (0: no clipping)'))
  label_smoothing: float = setting(
      0.0,
      "The train loss's targets: (1 - label_smoothing) on the label (or "
      'the mixed labels) plus label_smoothing spread evenly over the '
      'classes.',
      check=fields.rule(lambda x: 0 <= x < 1, 'in [0, 1)'))
  ema_decay: float = setting(
      0.0,
      '> 0: a moving average of the params (this decay per step) is kept '
      'and evaluated beside them (val_ema and test_ema events, ema_* in '
      'the summary).',
      check=fields.rule(lambda d: 0 <= d < 1,
                        'in [0, 1) (0: no moving average)'))
  ema_horizon: float = setting(
      0.0,
      "> 0: the moving average follows the run's length instead: its time "
      "constant is this share of the run's train steps (ema_decay = 1 - 1 "
      '/ (ema_horizon * steps)), so a shorter run gets a faster average.',
      check=fields.rule(
          lambda h: 0 <= h <= 1,
          "in [0, 1] (a share of the run's steps; 0: ema_decay as set)"))
  log_every_steps: int = setting(
      50, 'A progress line and a metrics event.',
      check=fields.POSITIVE)
  eval_every_steps: int = setting(
      1000, 'On val; also at the end (and test).',
      check=fields.POSITIVE)
  checkpoint_every_steps: int = setting(
      1000, 'Also at the end and on SIGTERM.',
      check=fields.POSITIVE)
  keep_checkpoints: int = setting(
      3, 'The newest kept; older ones deleted.',
      check=fields.POSITIVE)
  steps_in_flight: int = setting(
      2,
      'Train (and eval) steps the host dispatches ahead of the devices: a '
      'few keep them fed; a stop or a checkpoint waits for as many. At '
      'most 16: XLA:CPU stalls multi-device programs when a device queue '
      '(32) fills.',
      check=fields.rule(
          lambda n: 1 <= n <= MAX_STEPS_IN_FLIGHT,
          f'an integer in [1, {MAX_STEPS_IN_FLIGHT}] (XLA:CPU stalls '
          'multi-device programs when 32 wait on a device)'))
  stall_timeout_sec: float = setting(
      300.0,
      'A step (or eval batch) not finished after this long, or after 4x '
      'the slowest so far, ends the run with one line (a stalled device); '
      '0: never.',
      check=lambda t: None if 0 <= t < math.inf else (
          'must be a finite number of seconds >= 0 (0: never)'))
  compilation_cache_dir: str = setting(
      'auto',
      "JAX's persistent compilation cache: 'auto' (~/.cache/haiku_mp/jax "
      'on a GPU or TPU, none on the CPU), a directory (on every backend) '
      "or '' (off). A restarted or resumed run then loads its compiled "
      'steps.')
  remat: str = setting(
      'none',
      "What each encoder block keeps for the backward pass: 'none' (every "
      "residual), 'dots' (the weight matmuls' outputs; the rest "
      "recomputed) or 'full' (the block's input; the block recomputed). "
      'haiku_mp/model/remat.py.', check=fields.one_of(remat_lib.CHOICES))
  model: ModelSettings = group(ModelSettings, 'The ViT.')
  precision: PrecisionSettings = group(
      PrecisionSettings,
      'Dtypes of params, activations, matmuls and optimizer state.')
  loss_scale: LossScaleSettings = group(
      LossScaleSettings, 'Loss scaling, on jmp\'s.')
  parallel: ParallelSettings = group(
      ParallelSettings,
      "Devices: the strategy and the ('batch', 'model') mesh.")
  privacy: PrivacySettings = group(
      PrivacySettings,
      'DP-SGD (haiku_mp/vit/privacy/dp_sgd.py, on JAX Privacy). On: batch_size '
      'is the expected size of a Poisson-sampled batch; each example\'s '
      'gradient is clipped to l2_clip_norm and Gaussian noise of std '
      'noise_multiplier * l2_clip_norm is added to their float32 sum; '
      'epsilon at delta is reported.')
  advisor: AdvisorSettings = group(
      AdvisorSettings,
      'The precision advisor (`python -m launch.lab advise`): how much of a '
      'tensor a format may lose before a module keeps a wider one.')
  data: DataSettings = group(
      DataSettings,
      'The data, held in memory, and its augmentation on the device.')

  def check_rules(self, path: str) -> None:
    """The rules between the run's fields and its groups' (each group's own
    have run)."""
    del path  # The whole run's settings: the paths from the root.
    shown = fields.shown
    if self.num_train_steps == -1 and not self.num_epochs > 0:
      raise errors.ConfigError(
          f'num_epochs={shown(self.num_epochs)} must be positive (or set '
          'num_train_steps)')
    if self.ema_decay > 0 and self.ema_horizon > 0:
      raise errors.ConfigError(
          f'ema_decay={self.ema_decay:g} and ema_horizon='
          f'{self.ema_horizon:g} both set the moving average; set one, the '
          'other 0')
    self._check_privacy()
    # A crop from beyond half the image's side would be mostly padding.
    size, padding = self.model.image_size, self.data.crop_padding
    if not 0 <= padding <= size // 2:
      raise errors.ConfigError(
          f'data.crop_padding={shown(padding)} must be an integer in [0, '
          f'{size // 2}] (half of model.image_size={size})')

  def _check_privacy(self) -> None:
    """What DP-SGD cannot run with: mixed examples, fp8 scales, fsdp's
    gathers, half-precision sums."""
    if not self.privacy.enabled:
      return
    data, parallel = self.data, self.parallel
    if data_settings.mixes(data):
      raise errors.ConfigError(
          f'data.mixup_alpha={data.mixup_alpha:g} / data.cutmix_alpha='
          f'{data.cutmix_alpha:g} with privacy.enabled: a mixed example '
          'holds two, so DP-SGD\'s per-example clipping bounds neither; set '
          'both to 0')
    modules = self.precision.low_bit.modules
    if modules.strip():
      raise errors.ConfigError(
          f'precision.low_bit.modules={modules!r} with privacy.enabled: '
          "DP-SGD clips per-example gradients that fp8's per-tensor scales do "
          "not follow (untested); set precision.low_bit.modules='' for a "
          'private run')
    if parallel.strategy == 'fsdp':
      raise errors.ConfigError(
          'parallel.strategy=fsdp with privacy.enabled: DP-SGD computes its '
          'gradients per example in its own step, which does not gather '
          'parameters; use pjit or pmap')
    if parallel.reduce_dtype == 'compute':
      raise errors.ConfigError(
          'parallel.reduce_dtype=compute with privacy.enabled: DP-SGD sums its '
          "clipped gradients in float32; use 'float32'")


def default_config() -> ml_collections.ConfigDict:
  """The schema's defaults as the locked ConfigDict config files change."""
  config = ml_collections.ConfigDict(fields.to_dict(Settings()))
  config.lock()
  return config


def parse(config) -> Settings:
  """A config (ConfigDict or the dict of a run's config.json) as Settings."""
  return fields.parse(Settings, config)


__all__ = ['Settings', 'default_config', 'parse']
