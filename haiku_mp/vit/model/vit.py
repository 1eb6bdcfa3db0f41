"""Vision Transformer as small Haiku modules.

Activations flow in whatever dtype the precision policy in force gives them
(the compute dtype). Every matmul (Linear, the patch embedding, attention's
einsums) is a `half_dot` one: operands in the compute dtype, sums in float32.
The casts made here: `Attention` keeps its logits and softmax in float32
while its matmuls run in the compute dtype; `EncoderBlock`
casts each branch back to the residual stream's dtype before adding it;
`VisionTransformer` casts the cls token and position embedding to the
activations' dtype, and the stream to float32 under `float32_residual`.
"""

import math
from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from haiku_mp.model import dropout
from haiku_mp.model import matmul_modules
from haiku_mp.model import matmuls as matmuls_lib
from haiku_mp.model import remat as remat_lib
from haiku_mp.vit.settings import model as model_settings


def _linear_init():
  """Xavier uniform: the original ViT's and big_vision's attention and MLP
  kernels."""
  return hk.initializers.VarianceScaling(1.0, 'fan_avg', 'uniform')


class PatchEmbed(hk.Module):
  """Cuts images into non-overlapping patches and projects each to a vector."""

  def __init__(self, patch_size: int, embed_dim: int,
               matmuls: matmuls_lib.Matmuls = matmuls_lib.Matmuls(),
               init: str = 'lecun_normal', name: Optional[str] = None):
    super().__init__(name=name)
    self.patch_size = patch_size
    self.embed_dim = embed_dim
    self.matmuls = matmuls
    self.init = init

  def __call__(self, images: jax.Array) -> jax.Array:
    x = matmul_modules.Conv2D(self.embed_dim, matmuls=self.matmuls,
                              kernel_shape=self.patch_size,
                              stride=self.patch_size, padding='VALID',
                              w_init=hk.initializers.VarianceScaling(
                                  *model_settings.PATCH_INITS[self.init]),
                              name='conv')(images)
    batch, height, width, dim = x.shape
    return x.reshape(batch, height * width, dim)


class Attention(hk.Module):
  """Multi-head self-attention with float32 logits and softmax."""

  def __init__(self, num_heads: int,
               matmuls: matmuls_lib.Matmuls = matmuls_lib.Matmuls(),
               name: Optional[str] = None):
    super().__init__(name=name)
    self.num_heads = num_heads
    self.matmuls = matmuls

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, tokens, dim = x.shape
    head_dim = dim // self.num_heads

    def project(name):
      y = matmul_modules.Linear(dim, self.matmuls, w_init=_linear_init(),
                                name=name)(x)
      return y.reshape(batch, tokens, self.num_heads, head_dim)

    q, k, v = project('query'), project('key'), project('value')
    logits = self.matmuls.einsum(
        'bqhd,bkhd->bhqk', q, k,
        out_dtype=jnp.promote_types(q.dtype, jnp.float32)) / math.sqrt(head_dim)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = self.matmuls.einsum('bhqk,bkhd->bqhd', weights, v)
    out = out.reshape(batch, tokens, dim)
    return matmul_modules.Linear(dim, self.matmuls, w_init=_linear_init(),
                                 name='out')(out)


class MlpBlock(hk.Module):
  """Linear -> GELU -> Dropout -> Linear -> Dropout."""

  def __init__(self, mlp_dim: int, dropout_rate: float,
               matmuls: matmuls_lib.Matmuls = matmuls_lib.Matmuls(),
               name: Optional[str] = None):
    super().__init__(name=name)
    self.mlp_dim = mlp_dim
    self.dropout_rate = dropout_rate
    self.matmuls = matmuls

  def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
    dim = x.shape[-1]
    y = matmul_modules.Linear(self.mlp_dim, self.matmuls,
                              w_init=_linear_init(), name='fc1')(x)
    y = _dropout(jax.nn.gelu(y), self.dropout_rate, is_training)
    y = matmul_modules.Linear(dim, self.matmuls, w_init=_linear_init(),
                              name='fc2')(y)
    return _dropout(y, self.dropout_rate, is_training)


def _dropout(x: jax.Array, rate: float, is_training: bool) -> jax.Array:
  if not is_training or rate == 0.0:
    return x
  return dropout.dropout(hk.next_rng_key(), rate, x)


class DropPath(hk.Module):
  """Stochastic depth (Huang et al., 2016): a residual branch zeroed for a
  random share `rate` of the examples, the others scaled by 1 / (1 - rate).
  A module, so it runs under its caller's precision policy (or its own, as
  'DropPath' in precision.overrides)."""

  def __init__(self, rate: float, name: Optional[str] = None):
    super().__init__(name=name)
    self.rate = rate

  def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
    if not is_training:
      return x
    return dropout.dropout(hk.next_rng_key(), self.rate, x, per_example=True)


def _layer_norm(name: str, eps: float) -> hk.LayerNorm:
  return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=eps,
                      name=name)


class EncoderBlock(hk.Module):
  """Pre-LayerNorm transformer block: x + MHA(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, num_heads: int, mlp_dim: int, dropout_rate: float,
               layer_norm_epsilon: float,
               matmuls: matmuls_lib.Matmuls = matmuls_lib.Matmuls(),
               drop_path_rate: float = 0.0,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.num_heads = num_heads
    self.drop_path_rate = drop_path_rate
    self.matmuls = matmuls
    self.mlp_dim = mlp_dim
    self.dropout_rate = dropout_rate
    self.layer_norm_epsilon = layer_norm_epsilon

  def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
    def drop_path(name, y):
      # A block at rate 0 has no DropPath module (nor a module call).
      if not self.drop_path_rate:
        return y
      return DropPath(self.drop_path_rate, name=name)(y, is_training)

    # Branch outputs are cast to the residual stream's dtype, so an override on
    # a sub-module (say output=float32) cannot silently promote the stream.
    y = Attention(self.num_heads, self.matmuls)(
        _layer_norm('ln_attention', self.layer_norm_epsilon)(x))
    x = x + drop_path('drop_path_attention', y).astype(x.dtype)
    y = MlpBlock(self.mlp_dim, self.dropout_rate, self.matmuls)(
        _layer_norm('ln_mlp', self.layer_norm_epsilon)(x), is_training)
    return x + drop_path('drop_path_mlp', y).astype(x.dtype)


class VisionTransformer(hk.Module):
  """ViT classifier: patches + cls token + position embedding -> encoder -> head."""

  def __init__(self, *, image_size: int, patch_size: int, num_classes: int,
               embed_dim: int, mlp_dim: int, num_heads: int, num_layers: int,
               dropout_rate: float, layer_norm_epsilon: float,
               drop_path_rate: float = 0.0,
               float32_residual: bool = False,
               matmuls: matmuls_lib.Matmuls = matmuls_lib.Matmuls(),
               remat: str = 'none', patch_init: str = 'lecun_normal',
               name: Optional[str] = 'vit'):
    """`float32_residual` keeps the residual stream (the sum the blocks add
    into) in float32 whatever the compute dtype, as Megatron's fp32-residual
    option; by default the stream is in the compute dtype.
    `matmuls` says how the matmuls run (`matmuls.Matmuls`); `remat` what each
    encoder block keeps for the backward pass (`remat.CHOICES`);
    `patch_init` the patch embedding's kernel init
    (`model_settings.PATCH_INITS`). The
    values are those of `ModelSettings`, checked when parsed."""
    super().__init__(name=name)
    self.image_size = image_size
    self.patch_size = patch_size
    self.num_classes = num_classes
    self.embed_dim = embed_dim
    self.mlp_dim = mlp_dim
    self.num_heads = num_heads
    self.num_layers = num_layers
    self.dropout_rate = dropout_rate
    self.layer_norm_epsilon = layer_norm_epsilon
    self.drop_path_rate = drop_path_rate
    self.float32_residual = float32_residual
    self.matmuls = matmuls
    self.remat = remat
    self.patch_init = patch_init

  def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
    """Maps images [B, H, W, C] to logits [B, num_classes]."""
    x = PatchEmbed(self.patch_size, self.embed_dim, self.matmuls,
                   self.patch_init)(images)
    batch, num_patches, dim = x.shape
    cls_token = hk.get_parameter('cls_token', [1, 1, dim], init=jnp.zeros)
    pos_embedding = hk.get_parameter(
        'pos_embedding', [1, num_patches + 1, dim],
        init=hk.initializers.RandomNormal(stddev=0.02))
    cls_token = jnp.broadcast_to(cls_token, (batch, 1, dim)).astype(x.dtype)
    x = jnp.concatenate([cls_token, x], axis=1) + pos_embedding.astype(x.dtype)
    if self.float32_residual:
      x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    for i in range(self.num_layers):
      # Stochastic depth's rate rises linearly with depth (Huang et al.).
      rate = self.drop_path_rate * i / max(self.num_layers - 1, 1)
      block = EncoderBlock(self.num_heads, self.mlp_dim, self.dropout_rate,
                           self.layer_norm_epsilon, self.matmuls,
                           drop_path_rate=rate, name=f'encoder_block_{i}')
      x = remat_lib.wrap(block, self.remat, static_argnums=(1,))(
          x, is_training)
    x = _layer_norm('ln_final', self.layer_norm_epsilon)(x[:, 0])
    return matmul_modules.Linear(self.num_classes, self.matmuls,
                                 w_init=jnp.zeros, name='head')(x)


MODEL_CLASS = VisionTransformer.__name__
