"""Statistics of tensors in a forward and backward pass, in one jitted
function with no host callback: every module's output and the gradient
flowing into it (`statistics_fn`, 16 bits), and every Linear's input, output
gradient and weight as a low-bit format would hold them
(`linear_statistics_fn`, any `matmul_formats.MatmulFormat`).

A probed call's output y goes through an identity with a custom VJP (one
`_make_probe` for both) that also takes a tensor x, a zero "probe" vector
and an extra input: the forward keeps x as a residual (the backward pass of
whatever consumes the output keeps it anyway); the backward returns y's
cotangent g unchanged and, as the probe's cotangent, the statistics of x
and g. A module's x is its output itself; a Linear's is its input, whose
real cotangent comes from the matmul. So the gradient with respect to the
probes is every call's statistics, and the gradient with respect to the
params, taken in the same pass, gives theirs.
"""

import functools
from typing import Any, Callable, Iterable, NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

from haiku_mp.advisor import matmul_formats
from haiku_mp.advisor import numerics
from haiku_mp.model import low_bit as low_bit_lib

# (params, rng, batch) -> (scalar loss, aux), as `train_step.LossFn`.
LossFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]]


def _make_probe(measure: Callable[[jax.Array, jax.Array, Any], jax.Array]):
  """The identity `probe(y, x, vector, extra) -> y` whose backward gives
  `vector` the cotangent `measure(x, g, extra)` (g: y's cotangent) and x and
  `extra` none."""

  @jax.custom_vjp
  def probe(y, x, vector, extra):
    del x, vector, extra
    return y

  def fwd(y, x, vector, extra):
    del vector
    return y, (x, extra)

  def bwd(residuals, g):
    x, extra = residuals
    return g, jnp.zeros_like(x), measure(x, g, extra), jnp.zeros_like(extra)

  probe.defvjp(fwd, bwd)
  return probe


def _module_stats(x, g, scale):
  """A module's output's statistics and its gradient's. The output's are
  taken at a traced scale of one: with a literal 1.0 XLA:CPU folds the
  scaling away and fuses the statistics into a slower program (the
  CPU-sized ViT's pass took 0.87 s instead of 0.74 s)."""
  return jnp.concatenate([numerics.tensor_stats(x, scale / scale),
                          numerics.tensor_stats(g, scale)])


def zero_probes(paths: Iterable[str]) -> dict[str, jax.Array]:
  return {p: jnp.zeros(2 * numerics.SIZE, jnp.float32) for p in paths}


def _interceptor(probes: dict[str, jax.Array], scale: jax.Array,
                 aliases: dict[str, str]):
  """Puts each probed module's first call's output through a probe: the
  outermost call of a path (a subclass's `__call__` that calls its base's is
  one call). A module that hands on another's probed output as its own (a
  container returning its last module's output) is recorded in `aliases`
  instead of being measured twice."""
  # id of a probed output -> (its path, the output, kept alive so that no
  # other object takes its id while the function is traced).
  probed = {}
  probed_paths = set()
  running = set()
  probe = _make_probe(_module_stats)

  def intercept(next_f, args, kwargs, context: hk.MethodContext):
    if context.method_name != '__call__':
      return next_f(*args, **kwargs)
    path = context.module.module_name
    if path not in probes or path in running:
      return next_f(*args, **kwargs)
    running.add(path)
    try:
      out = next_f(*args, **kwargs)
    finally:
      running.discard(path)
    if (not isinstance(out, jax.Array)
        or not jnp.issubdtype(out.dtype, jnp.floating)):
      return out
    if id(out) in probed:
      aliases[path] = probed[id(out)][0]
      return out
    if path in probed_paths:
      return out
    out = probe(out, out, probes[path], scale)
    probed[id(out)] = (path, out)
    probed_paths.add(path)
    return out

  return intercept


class StatisticsFn(NamedTuple):
  """`fn(params, rng, batch, loss_scale) -> (modules, params_stats)`,
  jitted: for each probed module path its output's and its output
  gradient's statistics (`numerics.SIZE` each, concatenated), and for each
  param its gradient's; the float16 shares taken at `loss_scale`.
  `aliases` (filled when `fn` is traced): container path -> the path whose
  output it hands on, which has its statistics."""
  fn: Callable[..., Any]
  aliases: dict[str, str]


def statistics_fn(loss_fn: LossFn, paths: Iterable[str]) -> StatisticsFn:
  """The statistics of `loss_fn`'s module calls at `paths` (`StatisticsFn`).

  `loss_fn` runs under the probes' method interceptor, registered before
  any the model registers itself; Haiku runs the first registered outermost,
  so it sees what each module hands on (after its policy's output cast) and
  the gradient that reaches that.
  """
  paths = tuple(dict.fromkeys(paths))
  aliases: dict[str, str] = {}

  def loss_of(params, probes, rng, batch, scale):
    with hk.intercept_methods(_interceptor(probes, scale, aliases)):
      return loss_fn(params, rng, batch)[0]

  @jax.jit
  def stats(params, rng, batch, loss_scale):
    scale = jnp.asarray(loss_scale, jnp.float32)
    probes = zero_probes(paths)
    param_grads, modules = jax.grad(loss_of, argnums=(0, 1))(
        params, probes, rng, batch, scale)
    param_stats = jax.tree.map(
        functools.partial(numerics.tensor_stats, scale=scale), param_grads)
    return {p: modules[p] for p in paths if p not in aliases}, param_stats

  return StatisticsFn(stats, aliases)


class LinearStatisticsFn(NamedTuple):
  """`fn(params, rng, batch, extra) -> {path: statistics}`, jitted: each
  Linear's statistics under a `MatmulFormat` (its operands' parts, as the
  format's `split` reads them); `extra[path]` is the layer's extra input
  (the format's `extra`)."""
  fn: Callable[..., Any]
  paths: tuple[str, ...]


def linear_statistics_fn(loss_fn: LossFn, paths: Iterable[str],
                         fmt: matmul_formats.MatmulFormat
                         ) -> LinearStatisticsFn:
  """The statistics `fmt` takes of the Linear layers at `paths` under
  `loss_fn` (`LinearStatisticsFn`): of x and g in the probes' backward, of
  the weight from the params."""
  paths = tuple(dict.fromkeys(paths))
  probe = _make_probe(fmt.activations)
  activations_size = fmt.size - fmt.part_sizes[-1]

  def interceptor(vectors, extra):
    def intercept(next_f, args, kwargs, context: hk.MethodContext):
      if (context.method_name != '__call__'
          or type(context.module).__name__ != low_bit_lib.LOW_BIT_CLASS
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
    vectors = {p: jnp.zeros(activations_size, jnp.float32) for p in paths}
    found = jax.grad(loss_of, argnums=1)(params, vectors, rng, batch, extra)
    return {p: jnp.concatenate([found[p], fmt.weight(params[p]['w'],
                                                     extra[p])])
            for p in paths}

  return LinearStatisticsFn(stats, paths)
