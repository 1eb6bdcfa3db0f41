"""Low-bit statistics of every Linear layer's matmul operands, from one
forward and backward pass in one jitted function, as `probes` does for
outputs.

Each Linear call's output goes through an identity with a custom VJP that
also takes the call's input `x`, a zero probe vector and an extra input per
layer (fp8: the delayed amaxes of `x` and of the output gradient `g`; 4
bits: the layer's Hadamard signs): its backward returns `g` unchanged,
nothing for `x` (its real cotangent comes from the matmul), and, as the
probe's cotangent, the statistics of `x` and `g` (`Operands.activations`).
The weight's come from the params (`Operands.weight`). By default, fp8's:
`x`'s E4M3 statistics and `g`'s E5M2 ones (`fp8_numerics`), each blocked for
MX along its last axis (the forward's and the input gradient's contracting
dimension), the weight's E4M3 ones blocked along its first axis.
"""

from typing import Any, Callable, Iterable, NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.advisor import fp8_numerics
from haiku_mp.model import half_dot

LossFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]
# Per Linear: x's statistics, then g's, then the weight's.
SIZE = 3 * fp8_numerics.SIZE


def split(vector) -> list[np.ndarray]:
  """A Linear's statistics as its three parts: x's, g's, the weight's."""
  vector = np.asarray(vector, np.float64)
  return [vector[i * fp8_numerics.SIZE:(i + 1) * fp8_numerics.SIZE]
          for i in range(3)]


class Operands(NamedTuple):
  """What is measured of a Linear's operands: `activations(x, g, extra)`,
  a vector of `size` statistics of its input and output gradient, and
  `weight(w, extra)`, its weight's; `extra` is the layer's extra input."""
  size: int
  activations: Callable[..., jax.Array]
  weight: Callable[..., jax.Array]


def fp8_operands(margin: float = 0.0) -> Operands:
  """E4M3 / E5M2 statistics under every fp8 scaling; the extra input is the
  delayed amaxes of x and g."""

  def activations(x, g, delayed):
    return jnp.concatenate([
        fp8_numerics.tensor_stats(x, fp8_numerics.E4M3, delayed[0],
                                  margin=margin),
        fp8_numerics.tensor_stats(g, fp8_numerics.E5M2, delayed[1],
                                  margin=margin)])

  def weight(w, delayed):
    del delayed
    return fp8_numerics.tensor_stats(w, fp8_numerics.E4M3, jnp.float32(0.0),
                                     block_axis=0, margin=margin)

  return Operands(2 * fp8_numerics.SIZE, activations, weight)


def _make_probe(operands: Operands):
  @jax.custom_vjp
  def probe(y, x, vector, extra):
    del x, vector, extra
    return y

  def fwd(y, x, vector, extra):
    del vector
    return y, (x, extra)

  def bwd(residuals, g):
    x, extra = residuals
    return (g, jnp.zeros_like(x), operands.activations(x, g, extra),
            jnp.zeros_like(extra))

  probe.defvjp(fwd, bwd)
  return probe


class Fp8StatisticsFn(NamedTuple):
  """`fn(params, rng, batch, extra) -> {path: statistics}`, jitted;
  `extra[path]` is the layer's extra input (fp8: the delayed amaxes of x
  and g, 0: none yet)."""
  fn: Callable[..., Any]
  paths: tuple[str, ...]


def statistics_fn(loss_fn: LossFn, paths: Iterable[str],
                  margin: float = 0.0,
                  operands: Optional[Operands] = None) -> Fp8StatisticsFn:
  """Statistics of the Linear layers at `paths` under `loss_fn`: fp8's
  (`fp8_operands(margin)`), or `operands`'."""
  paths = tuple(dict.fromkeys(paths))
  operands = operands or fp8_operands(margin)
  probe = _make_probe(operands)

  def interceptor(vectors, extra):
    def intercept(next_f, args, kwargs, context: hk.MethodContext):
      if (context.method_name != '__call__'
          or type(context.module).__name__ != half_dot.FP8_CLASS
          or context.module.module_name not in vectors):
        return next_f(*args, **kwargs)
      path = context.module.module_name
      out = next_f(*args, **kwargs)
      return probe(out, args[0], vectors[path], extra[path])
    return intercept

  def loss_of(params, vectors, rng, batch, extra):
    with hk.intercept_methods(interceptor(vectors, extra)):
      return loss_fn(params, rng, batch)[0]

  @jax.jit
  def stats(params, rng, batch, extra):
    vectors = {p: jnp.zeros(operands.size, jnp.float32) for p in paths}
    found = jax.grad(loss_of, argnums=1)(params, vectors, rng, batch, extra)
    return {p: jnp.concatenate([
        found[p], operands.weight(params[p]['w'], extra[p])]) for p in paths}

  return Fp8StatisticsFn(stats, paths)
