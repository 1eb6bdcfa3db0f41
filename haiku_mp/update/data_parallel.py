"""The data-parallel axis of a train step, and the precision of what crosses it.

Every replica computes the gradients of its own examples; they are then
reduced over the axis. Where the parameters are split over the same axis
(FSDP, ZeRO-3), each is all-gathered before the forward pass and its gradient
reduce-scattered back onto the shards. The dtype of both is a choice, as in
PyTorch FSDP2's `MixedPrecisionPolicy(param_dtype, reduce_dtype)`:
parameters gathered in the compute dtype (half the bytes of float32) or in
fp8 (a quarter), gradients reduced in float32 ("mixed") or in the compute
dtype ("pure").

Both happen in one custom vector-Jacobian product, `DataParallel.whole`: its
forward gathers a parameter (or passes a replicated one through), its backward
reduces the cotangent, which is still multiplied by the loss scale. So a
float16 reduction runs on scaled gradients, and a sum that overflows is an
inf the step's finite check sees: the step is skipped like any overflow.
The collectives are written here, explicitly, inside `shard_map` or `pmap`,
so the compiled program carries them in the chosen dtype (a cast after a
float32 gather would save nothing).
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

# fp8 gathers: E4M3, per-tensor scale from the whole parameter's amax (a
# scalar max over the shards), as current scaling does for a matmul's weight.
FP8_WIRE = 'fp8'
_E4M3 = jnp.float8_e4m3fn
_E4M3_MAX = float(jnp.finfo(_E4M3).max)


class Layout(NamedTuple):
  """How one parameter crosses the axis.

  `dim`: the dimension split over the axis (FSDP), or None: every replica
  holds it whole, and only its gradient travels. `wire`: the dtype a split
  parameter is gathered in: None (as stored), a dtype name ('bfloat16'), or
  'fp8' (E4M3, scaled on the shards before the gather).
  """
  dim: Optional[int] = None
  wire: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class DataParallel:
  """A step's data-parallel axis: pass it where `gradients` takes
  `axis_name`, inside `pmap` or `shard_map` over `axis_name`.

  Example:
    parallel = haiku_mp.DataParallel('batch', reduce_dtype=jnp.bfloat16)
    grads, loss, metrics = haiku_mp.gradients(loss_fn, scaler, scale, params,
                                              rng, batch, parallel)

  `layouts`, a tree like the params without fp8 histories (`Layout` leaves),
  says which parameters arrive split and how they are gathered; None: every
  parameter arrives whole. The gradients come back as the parameters came:
  whole, or each replica's shard of the mean.
  """
  axis_name: str
  reduce_dtype: Any = jnp.float32
  layouts: Any = None

  def whole(self, params: Any, stored: Any) -> Any:
    """`params` as the model takes them, in `stored`'s dtypes (the state's
    params, of which `params` are float32 copies): split ones gathered.
    Differentiate through it: the gradients are then reduced over the axis
    (mean), in `reduce_dtype`, and come back in float32, not rounded to a
    half-precision parameter's dtype."""
    layouts = self.layouts
    if layouts is None:
      layouts = jax.tree.map(lambda _: Layout(), params)
    is_layout = lambda x: isinstance(x, Layout)
    return jax.tree.map(
        lambda layout, p, s: self._whole(p, layout, s.dtype), layouts,
        params, stored, is_leaf=is_layout)

  def _whole(self, x: jax.Array, layout: Layout, dtype) -> jax.Array:
    axis, reduce_dtype = self.axis_name, self.reduce_dtype

    @jax.custom_vjp
    def whole(x):
      return _gathered(x.astype(dtype), layout, axis)

    def forward(x):
      return whole(x), None

    def backward(_, cotangent):
      sent = cotangent.astype(reduce_dtype)
      if layout.dim is None:
        summed = jax.lax.psum(sent, axis)
      else:
        summed = jax.lax.psum_scatter(sent, axis, scatter_dimension=layout.dim,
                                      tiled=True)
      # pmean's division, after the sum: in float32, on the scaled values.
      return (summed.astype(x.dtype) / jax.lax.axis_size(axis),)

    whole.defvjp(forward, backward)
    return whole(x)


def _gathered(x: jax.Array, layout: Layout, axis: str) -> jax.Array:
  """The whole parameter from this replica's shard `x`, in `layout.wire`."""
  if layout.dim is None:
    return x
  if layout.wire != FP8_WIRE:
    wire = x if layout.wire is None else x.astype(layout.wire)
    # Not cast back: the model casts to its compute dtype itself.
    return jax.lax.all_gather(wire, axis, axis=layout.dim, tiled=True)
  amax = jax.lax.pmax(jnp.max(jnp.abs(x)).astype(jnp.float32), axis)
  scale = jnp.where(amax > 0, _E4M3_MAX / amax, 1.0)
  quantized = (x.astype(jnp.float32) * scale).astype(_E4M3)
  gathered = jax.lax.all_gather(quantized, axis, axis=layout.dim, tiled=True)
  return gathered.astype(jnp.float32) / scale


def of(axis_name: Any) -> Optional[DataParallel]:
  """`gradients`' `axis_name` (None, a name, or a DataParallel) as a
  DataParallel: a bare name reduces in float32 and splits nothing."""
  if axis_name is None or isinstance(axis_name, DataParallel):
    return axis_name
  return DataParallel(axis_name)
