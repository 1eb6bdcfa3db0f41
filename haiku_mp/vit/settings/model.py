"""The reference ViT's shape and regularization (haiku_mp/vit/model/vit.py)."""

from haiku_mp import errors
from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import setting

# The patch embedding's kernel inits (`model.patch_init`), as the
# (scale, mode, distribution) of the `hk.initializers.VarianceScaling`
# haiku_mp/vit/model/vit.py makes. LeCun normal (truncated) is how the
# original ViT and big_vision start it. Xavier uniform was used before
# 2026-11-26: Haiku counts a convolution's fan-out as kh * kw * out, so it
# gave a 384-wide embedding of 4x4 patches a std of 0.018 instead of 0.144,
# and the reference ViT's output tokens started nearly collapsed
# (docs/training.md). Kept to reproduce older runs.
PATCH_INITS = {
    'lecun_normal': (1.0, 'fan_in', 'truncated_normal'),
    'xavier_uniform': (1.0, 'fan_avg', 'uniform'),
}


@fields.frozen
class ModelSettings:
  """The ViT: its shape, dropout, stochastic depth and patch init."""

  image_size: int = setting(
      32,
      'Side of the square input images (CIFAR-10: 32).', check=fields.POSITIVE)
  patch_size: int = setting(
      4, 'Side of the square patches that become tokens.',
      check=fields.POSITIVE)
  num_classes: int = setting(
      10, 'Logits (CIFAR-10: 10).',
      check=fields.POSITIVE)
  embed_dim: int = setting(384, 'Token width.', check=fields.POSITIVE)
  mlp_dim: int = setting(
      1536, "Hidden width of each block's MLP.",
      check=fields.POSITIVE)
  num_heads: int = setting(
      8, 'Attention heads (they divide embed_dim).',
      check=fields.POSITIVE)
  num_layers: int = setting(6, 'Encoder blocks.', check=fields.POSITIVE)
  dropout_rate: float = setting(
      0.1, "Dropout in each block's MLP.",
      check=fields.rule(lambda r: 0 <= r < 1, 'in [0, 1)'))
  drop_path_rate: float = setting(
      0.0,
      "Stochastic depth: each block's two residual branches dropped for a "
      'random subset of examples, at rates rising linearly from 0 in the '
      'first block to drop_path_rate in the last.',
      check=fields.rule(lambda r: 0 <= r < 1, 'in [0, 1)'))
  layer_norm_epsilon: float = setting(
      1e-06,
      "The seeds' (Haiku's default is 1e-5).",
      check=fields.rule(lambda e: e > 0, 'positive'))
  patch_init: str = setting(
      'lecun_normal',
      "The patch embedding's kernel init: 'lecun_normal' (the original "
      "ViT's and big_vision's) or 'xavier_uniform' (before 2026-11-26: 8x "
      'too small for a convolution; kept to reproduce old runs).',
      check=fields.one_of(tuple(PATCH_INITS)))

  def check_rules(self, path: str) -> None:
    """Patches that tile the image, heads that split the tokens' width."""
    if self.image_size % self.patch_size:
      raise errors.ConfigError(
          f'{path}image_size={self.image_size} is not divisible by '
          f'{path}patch_size={self.patch_size}')
    if self.embed_dim % self.num_heads:
      raise errors.ConfigError(
          f'{path}embed_dim={self.embed_dim} is not divisible by '
          f'{path}num_heads={self.num_heads}')


__all__ = ['ModelSettings', 'PATCH_INITS']
