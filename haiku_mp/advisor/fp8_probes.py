"""fp8 statistics of every Linear layer's matmul operands, from one forward
and backward pass in one jitted function, as `probes` does for outputs.

Each Linear call's output goes through an identity with a custom VJP that
also takes the call's input `x`, a zero probe vector and the delayed amaxes
of `x` and of the output gradient `g`: its backward returns `g` unchanged,
nothing for `x` (its real cotangent comes from the matmul), and, as the
probe's cotangent, `x`'s E4M3 statistics and `g`'s E5M2 ones
(`fp8_numerics`), each blocked for MX along its last axis (the forward's and
the input gradient's contracting dimension). The weight's E4M3 statistics
come from the params, blocked along their first axis.
"""

from typing import Any, Callable, Iterable, NamedTuple

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


def _stats(x, g, delayed, margin):
  return jnp.concatenate([
      fp8_numerics.tensor_stats(x, fp8_numerics.E4M3, delayed[0],
                                margin=margin),
      fp8_numerics.tensor_stats(g, fp8_numerics.E5M2, delayed[1],
                                margin=margin)])


def _make_probe(margin: float):
  @jax.custom_vjp
  def probe(y, x, vector, delayed):
    del x, vector, delayed
    return y

  def fwd(y, x, vector, delayed):
    del vector
    return y, (x, delayed)

  def bwd(residuals, g):
    x, delayed = residuals
    return (g, jnp.zeros_like(x), _stats(x, g, delayed, margin),
            jnp.zeros_like(delayed))

  probe.defvjp(fwd, bwd)
  return probe


class Fp8StatisticsFn(NamedTuple):
  """`fn(params, rng, batch, delayed) -> {path: SIZE statistics}`, jitted;
  `delayed[path]` holds the delayed amaxes of x and g (0: none yet)."""
  fn: Callable[..., Any]
  paths: tuple[str, ...]


def statistics_fn(loss_fn: LossFn, paths: Iterable[str],
                  margin: float = 0.0) -> Fp8StatisticsFn:
  """fp8 statistics of the Linear layers at `paths` under `loss_fn`."""
  paths = tuple(dict.fromkeys(paths))
  probe = _make_probe(margin)

  def interceptor(vectors, delayed):
    def intercept(next_f, args, kwargs, context: hk.MethodContext):
      if (context.method_name != '__call__'
          or type(context.module).__name__ != half_dot.FP8_CLASS
          or context.module.module_name not in vectors):
        return next_f(*args, **kwargs)
      path = context.module.module_name
      out = next_f(*args, **kwargs)
      return probe(out, args[0], vectors[path], delayed[path])
    return intercept

  def loss_of(params, vectors, rng, batch, delayed):
    with hk.intercept_methods(interceptor(vectors, delayed)):
      return loss_fn(params, rng, batch)[0]

  @jax.jit
  def stats(params, rng, batch, delayed):
    vectors = {p: jnp.zeros(2 * fp8_numerics.SIZE, jnp.float32)
               for p in paths}
    found = jax.grad(loss_of, argnums=1)(params, vectors, rng, batch, delayed)
    return {p: jnp.concatenate([
        found[p], fp8_numerics.tensor_stats(
            params[p]['w'], fp8_numerics.E4M3, jnp.float32(0.0),
            block_axis=0, margin=margin)]) for p in paths}

  return Fp8StatisticsFn(stats, paths)
