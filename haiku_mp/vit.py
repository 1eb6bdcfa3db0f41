"""Vision Transformer as small Haiku modules.

Activations flow in whatever dtype the precision policy in force gives them
(the compute dtype). The casts made here: `Attention` keeps its logits and
softmax in float32 while its matmuls run in the compute dtype; `EncoderBlock`
casts each branch back to the residual stream's dtype before adding it;
`VisionTransformer` casts the cls token and position embedding to the
activations' dtype, and the stream to float32 under `float32_residual`.
"""

import functools
import math
from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from haiku_mp import errors


def _linear_init():
  return hk.initializers.VarianceScaling(1.0, 'fan_avg', 'uniform')


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def attention_logits(q: jax.Array, k: jax.Array,
                     matmul_precision: Optional[str] = None) -> jax.Array:
  """``q . k`` over heads with operands in their own dtype, result in float32 (or wider).

  The custom VJP casts the float32 cotangent back to the operands' dtype, so the
  two backward matmuls also run in the compute dtype (JAX's own transpose would
  run them on a float32 x half pair). `matmul_precision` is the
  `jax.default_matmul_precision` in force when the forward pass was traced: the
  backward pass is traced later, outside it, and must use the same.
  """
  del matmul_precision  # In force already.
  return jnp.einsum('bqhd,bkhd->bhqk', q, k,
                    preferred_element_type=jnp.promote_types(q.dtype,
                                                             jnp.float32))


def _attention_logits_fwd(q, k, matmul_precision):
  return attention_logits(q, k, matmul_precision), (q, k)


def _attention_logits_bwd(matmul_precision, residuals, g):
  q, k = residuals
  g = g.astype(q.dtype)
  with jax.default_matmul_precision(matmul_precision):
    dq = jnp.einsum('bhqk,bkhd->bqhd', g, k)
    dk = jnp.einsum('bhqk,bqhd->bkhd', g, q)
  return dq, dk


attention_logits.defvjp(_attention_logits_fwd, _attention_logits_bwd)


class PatchEmbed(hk.Module):
  """Cuts images into non-overlapping patches and projects each to a vector."""

  def __init__(self, patch_size: int, embed_dim: int,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.patch_size = patch_size
    self.embed_dim = embed_dim

  def __call__(self, images: jax.Array) -> jax.Array:
    x = hk.Conv2D(self.embed_dim, kernel_shape=self.patch_size,
                  stride=self.patch_size, padding='VALID',
                  w_init=_linear_init(), name='conv')(images)
    batch, height, width, dim = x.shape
    return x.reshape(batch, height * width, dim)


class Attention(hk.Module):
  """Multi-head self-attention with float32 logits and softmax."""

  def __init__(self, num_heads: int, matmul_precision: Optional[str] = None,
               name: Optional[str] = None):
    """`matmul_precision`: the `jax.default_matmul_precision` the forward
    pass runs under, which the backward of the logits must use too."""
    super().__init__(name=name)
    self.num_heads = num_heads
    self.matmul_precision = matmul_precision

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, tokens, dim = x.shape
    if dim % self.num_heads:
      raise errors.ConfigError(f'model.embed_dim={dim} is not divisible by '
                               f'model.num_heads={self.num_heads}')
    head_dim = dim // self.num_heads

    def project(name):
      y = hk.Linear(dim, w_init=_linear_init(), name=name)(x)
      return y.reshape(batch, tokens, self.num_heads, head_dim)

    q, k, v = project('query'), project('key'), project('value')
    logits = attention_logits(q, k, self.matmul_precision) / math.sqrt(head_dim)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum('bhqk,bkhd->bqhd', weights, v)
    out = out.reshape(batch, tokens, dim)
    return hk.Linear(dim, w_init=_linear_init(), name='out')(out)


class MlpBlock(hk.Module):
  """Linear -> GELU -> Dropout -> Linear -> Dropout."""

  def __init__(self, mlp_dim: int, dropout_rate: float,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.mlp_dim = mlp_dim
    self.dropout_rate = dropout_rate

  def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
    dim = x.shape[-1]
    y = hk.Linear(self.mlp_dim, w_init=_linear_init(), name='fc1')(x)
    y = _dropout(jax.nn.gelu(y), self.dropout_rate, is_training)
    y = hk.Linear(dim, w_init=_linear_init(), name='fc2')(y)
    return _dropout(y, self.dropout_rate, is_training)


def _dropout(x: jax.Array, rate: float, is_training: bool) -> jax.Array:
  if not is_training or rate == 0.0:
    return x
  return hk.dropout(hk.next_rng_key(), rate, x)


def _layer_norm(name: str, eps: float) -> hk.LayerNorm:
  return hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, eps=eps,
                      name=name)


class EncoderBlock(hk.Module):
  """Pre-LayerNorm transformer block: x + MHA(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, num_heads: int, mlp_dim: int, dropout_rate: float,
               layer_norm_epsilon: float, matmul_precision: Optional[str] = None,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.num_heads = num_heads
    self.matmul_precision = matmul_precision
    self.mlp_dim = mlp_dim
    self.dropout_rate = dropout_rate
    self.layer_norm_epsilon = layer_norm_epsilon

  def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
    # Branch outputs are cast to the residual stream's dtype, so an override on
    # a sub-module (say output=float32) cannot silently promote the stream.
    y = Attention(self.num_heads, self.matmul_precision)(
        _layer_norm('ln_attention', self.layer_norm_epsilon)(x))
    x = x + y.astype(x.dtype)
    y = MlpBlock(self.mlp_dim, self.dropout_rate)(
        _layer_norm('ln_mlp', self.layer_norm_epsilon)(x), is_training)
    return x + y.astype(x.dtype)


class VisionTransformer(hk.Module):
  """ViT classifier: patches + cls token + position embedding -> encoder -> head."""

  def __init__(self, *, image_size: int, patch_size: int, num_classes: int,
               embed_dim: int, mlp_dim: int, num_heads: int, num_layers: int,
               dropout_rate: float, layer_norm_epsilon: float,
               float32_residual: bool = False,
               matmul_precision: Optional[str] = None,
               name: Optional[str] = 'vit'):
    """`float32_residual` keeps the residual stream (the sum the blocks add
    into) in float32 whatever the compute dtype, as Megatron's fp32-residual
    option; by default the stream is in the compute dtype.
    `matmul_precision` is the `jax.default_matmul_precision` the model runs
    under (None: JAX's default), for the attention logits' backward pass."""
    super().__init__(name=name)
    if image_size % patch_size:
      raise errors.ConfigError(
          f'model.image_size={image_size} is not divisible by '
          f'model.patch_size={patch_size}')
    if not layer_norm_epsilon > 0:
      raise errors.ConfigError(
          f'model.layer_norm_epsilon={layer_norm_epsilon:g} must be positive')
    self.image_size = image_size
    self.patch_size = patch_size
    self.num_classes = num_classes
    self.embed_dim = embed_dim
    self.mlp_dim = mlp_dim
    self.num_heads = num_heads
    self.num_layers = num_layers
    self.dropout_rate = dropout_rate
    self.layer_norm_epsilon = layer_norm_epsilon
    self.float32_residual = float32_residual
    self.matmul_precision = matmul_precision

  def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
    """Maps images [B, H, W, C] to logits [B, num_classes]."""
    x = PatchEmbed(self.patch_size, self.embed_dim)(images)
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
      x = EncoderBlock(self.num_heads, self.mlp_dim, self.dropout_rate,
                       self.layer_norm_epsilon, self.matmul_precision,
                       name=f'encoder_block_{i}')(x, is_training)
    x = _layer_norm('ln_final', self.layer_norm_epsilon)(x[:, 0])
    return hk.Linear(self.num_classes, w_init=jnp.zeros, name='head')(x)


MODEL_CLASS = VisionTransformer.__name__
