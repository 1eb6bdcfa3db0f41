"""The advisor's measurements for any Haiku model: each module's values and
gradients at 16 bits (`measure_model`) and each Linear's operands in a
low-bit format (`measure_matmuls`), over a few batches at fixed params.
They need only the model's loss function: `driver` runs them on the
trainer's ViT, from its workdirs and checkpoints.

  modules = advisor.measure_model(loss_fn, params, batches, key)
  print(advisor.overrides(modules, advisor.judge(modules, limits), 'float16'))
"""

import functools
from typing import Callable, Optional, Sequence, Union

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.advisor import fp4_numerics
from haiku_mp.advisor import fp8_numerics
from haiku_mp.advisor import matmul_formats
from haiku_mp.advisor import numerics
from haiku_mp.advisor import probes
from haiku_mp.advisor import verdicts
from haiku_mp.model import fp8
from haiku_mp.model import low_bit as low_bit_lib
from haiku_mp.model import targets as targets_lib
from haiku_mp.update import losses
from haiku_mp.update import state_check

# The low-bit formats the advisor knows, by name: a new one is one more
# entry (a `matmul_formats.MatmulFormat`).
MATMUL_FORMATS = {f.name: f for f in (fp8_numerics.Fp8Matmuls,
                                      fp4_numerics.Fp4Matmuls)}


def _accumulate(totals: dict, key, stats) -> None:
  stats = np.asarray(stats, np.float64)
  totals[key] = stats if key not in totals else numerics.merge(totals[key],
                                                               stats)


class Totals:
  """Statistics summed over batches: each module's output and output
  gradient, and each param's gradient."""

  def __init__(self):
    self.outputs, self.gradients, self.params = {}, {}, {}

  def add(self, modules, param_stats) -> None:
    for path, vector in jax.tree.map(np.asarray, modules).items():
      _accumulate(self.outputs, path, vector[:numerics.SIZE])
      _accumulate(self.gradients, path, vector[numerics.SIZE:])
    for module, names in param_stats.items():
      for name, vector in names.items():
        _accumulate(self.params, (module, name), vector)

  def modules(self, classes: dict[str, str],
              aliases: dict[str, str]) -> list[verdicts.Module]:
    modules = []
    for path in classes:
      source = aliases.get(path, path)
      modules.append(verdicts.Module(
          path, classes[path], self.outputs[source], self.gradients[source],
          {name: v for (module, name), v in self.params.items()
           if module == path},
          same_as=aliases.get(path)))
    _mark_equal_containers(modules)
    return modules


def module_classes_of(loss_fn: probes.LossFn, params, rng: jax.Array,
                      batch) -> dict[str, str]:
  """Each module path `loss_fn` calls (in call order) -> its class name,
  from one abstract trace (no FLOPs): the modules the advisor judges in a
  model it did not build.

  Example:
    classes = advisor.module_classes_of(loss_fn, params, jax.random.key(0), batch)
    candidates = advisor.low_bit_linears(classes, 'Linear')
  """
  classes = {}

  def record(next_f, args, kwargs, context: hk.MethodContext):
    if context.method_name == '__call__':
      classes.setdefault(context.module.module_name,
                         type(context.module).__name__)
    return next_f(*args, **kwargs)

  def traced(params, rng, batch):
    with hk.intercept_methods(record):
      return loss_fn(params, rng, batch)[0]

  jax.eval_shape(traced, params, rng, batch)
  return classes


def _all_finite(tree) -> jax.Array:
  """Whether every floating value in `tree` is finite (True for none)."""
  # Arrays only: a module's arguments may hold dtypes (an average's), or
  # other values jax cannot read as one.
  flags = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)
           if isinstance(x, (jax.Array, np.ndarray))
           and jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.stack(flags).all() if flags else jnp.bool_(True)


def nonfinite_sources(loss_fn: probes.LossFn, params, rng: jax.Array,
                      batch) -> dict[str, jax.Array]:
  """Per module path, whether a forward pass of `loss_fn` made a value that
  is not finite inside that module: its output holds inf or NaN though its
  inputs and the outputs of the modules it called were finite. Run on the
  model's float16 loss, it finds what float32 statistics cannot show: a
  mask value that is -inf in float16 (Haiku's -1e30), an `exp` past 65504
  inside a module, a subtraction of two infinities."""
  frames: list[list[jax.Array]] = []
  sources: dict[str, jax.Array] = {}

  def record(next_f, args, kwargs, context: hk.MethodContext):
    if context.method_name == '__init__':
      return next_f(*args, **kwargs)
    frames.append([])
    try:
      out = next_f(*args, **kwargs)
    finally:
      children = frames.pop()
    out_bad = ~_all_finite(out)
    inner_bad = jnp.stack(children).any() if children else jnp.bool_(False)
    made_here = _all_finite((args, kwargs)) & out_bad & ~inner_bad
    path = context.module.module_name
    sources[path] = sources.get(path, jnp.bool_(False)) | made_here
    if frames:
      frames[-1].append(out_bad)
    return out

  with hk.intercept_methods(record):
    loss_fn(params, rng, batch)
  return sources


def nonfinite_state_sources(loss_fn: losses.LossWithState, params,
                            model_state, rng: jax.Array, batch
                            ) -> jax.Array:
  """Per floating leaf of the Haiku state (`state_check.leaves`' order),
  whether `loss_fn`'s forward pass wrote it not finite: run on the model's
  float16 loss, it finds the module whose state a float16 step would
  corrupt while its gradients stay finite (an average's epsilon that is 0
  in float16, then a division by it)."""
  _, _, new_state = loss_fn(params, model_state, rng, batch)
  return state_check.flags(new_state)


def measure_model(loss_fn: probes.LossFn, params, batches, key: jax.Array,
                  loss_scale: float = 1.0, *,
                  float16_loss_fn: Optional[Union[
                      probes.LossFn, losses.LossWithState]] = None,
                  model_state=None) -> list[verdicts.Module]:
  """The statistics `verdicts.judge` reads, for any Haiku model: each module
  call's output and output gradient, and each param's gradient, over
  `batches` at fixed `params`, the float16 shares taken at `loss_scale`.

  `loss_fn(params, rng, batch) -> (loss, aux)` is the model's training loss
  under its precision (float32 compute measures what half precision would
  lose; `launch.lab advise` does that for the ViT, with train steps between
  batches). Given `float16_loss_fn`, the same model's loss under a float16
  policy, it also runs a float16 forward pass on each batch
  (`nonfinite_sources`): a module that makes inf or NaN there is kept in
  float32 whatever its float32 statistics say. A model with Haiku state
  gives `float16_loss_fn` as a `LossWithState` and its `model_state`: a
  module whose state the float16 pass leaves not finite is kept in float32
  too (`nonfinite_state_sources`), the outermost where several are.

  Example:
    modules = advisor.measure_model(loss_fn, params, batches, jax.random.key(0))
    advice = advisor.judge(modules, limits)
  """
  classes = module_classes_of(loss_fn, params, key, batches[0])
  stats = probes.statistics_fn(loss_fn, classes)
  totals = Totals()
  for i, batch in enumerate(batches):
    totals.add(*stats.fn(params, jax.random.fold_in(key, i), batch,
                         loss_scale))
  modules = totals.modules(classes, stats.aliases)
  if float16_loss_fn is not None:
    stateful = isinstance(float16_loss_fn, losses.LossWithState)
    stateless = float16_loss_fn
    if stateful:
      stateless = lambda p, rng, batch: float16_loss_fn(
          p, model_state, rng, batch)[:2]
    sources = jax.jit(functools.partial(nonfinite_sources, stateless))
    states = jax.jit(functools.partial(nonfinite_state_sources,
                                       float16_loss_fn))
    made, corrupted = set(), set()
    for i, batch in enumerate(batches):
      rng = jax.random.fold_in(key, i)
      found = jax.device_get(sources(params, rng, batch))
      made |= {p for p, bad in found.items() if bad}
      if stateful:
        corrupted |= set(state_check.modules_of(
            model_state, jax.device_get(states(params, model_state, rng,
                                               batch))))
    outermost = {c for c in corrupted
                 if not any(c.startswith(o + '/') for o in corrupted)}
    for m in modules:
      m.float16_nonfinite = m.path in made
      if stateful:
        m.float16_state_nonfinite = m.path in outermost
  return modules



def _same_values(a: verdicts.Module, b: verdicts.Module) -> bool:
  """Whether two modules saw the same values: equal counts, histograms and
  largest magnitudes, sums equal to float32 rounding."""
  for x, y in ((a.output, b.output), (a.gradient, b.gradient)):
    if not (np.array_equal(numerics.histogram_of(x), numerics.histogram_of(y))
            and np.allclose(x, y, rtol=1e-5, atol=0)):
      return False
  return True


def _mark_equal_containers(modules: list[verdicts.Module]) -> None:
  """A container whose values are a descendant's (a reshape of them, say)
  is `same_as` that descendant."""
  for m in modules:
    if m.same_as is not None:
      continue
    for d in modules:
      if (d is not m and d.same_as is None and d.path.startswith(m.path + '/')
          and _same_values(m, d)):
        m.same_as = d.path
        break


def low_bit_linears(classes: dict[str, str],
                    targets: str = fp8.DEFAULT_MODULES) -> list[str]:
  """The paths of the Linear layers (stock or haiku_mp's) among `classes`
  (`module_classes_of`'s) that `targets` (``'TARGET;...'``, as
  `LowBit`'s `modules`) select: the candidates for low-bit matmuls.

  Example:
    classes = advisor.module_classes_of(loss_fn, params, jax.random.key(0), batch)
    paths = advisor.low_bit_linears(classes, '*/linear_0;*/linear_1')
  """
  selected = targets_lib.parse_targets(targets)
  return [p for p, c in classes.items()
          if c == low_bit_lib.LOW_BIT_CLASS
          and low_bit_lib.selects(selected, c, p)]


def measure_matmuls(loss_fn: probes.LossFn, params, batches: Sequence,
                    paths: Sequence[str], fmt: matmul_formats.MatmulFormat,
                    log: Optional[Callable[[str], None]] = None
                    ) -> dict[str, list[np.ndarray]]:
  """Each Linear at `paths`: its input, output gradient and weight as `fmt`
  would hold them (`advisor.Fp8Matmuls()` under every fp8 scaling,
  `advisor.Fp4Matmuls()` in NVFP4 and MXFP4), summed over `batches` at
  `params`; per path the operands' parts, which `judge_matmuls` reads.
  `loss_fn` computes in bfloat16 or float32, without low-bit matmuls.

  Example:
    totals = advisor.measure_matmuls(loss_fn, params, batches, paths,
                                     advisor.Fp8Matmuls())
    judged = advisor.judge_matmuls(totals, advisor.Fp8Matmuls(), 'current',
                                   fp8_limits, 'Linear')
  """
  stats = probes.linear_statistics_fn(loss_fn, paths, fmt)
  history = {p: [] for p in stats.paths}
  totals = {}
  for i, batch in enumerate(batches):
    extra = {p: np.asarray(fmt.extra(p, h), np.float32)
             for p, h in history.items()}
    found = jax.device_get(stats.fn(params, jax.random.key(i), batch, extra))
    for p, vector in found.items():
      parts = fmt.split(vector)
      history[p].append(parts)
      totals[p] = fmt.merge(totals[p], parts) if p in totals else parts
    if log is not None:
      log(f'advise: {fmt.title} statistics {i + 1}/{len(batches)}')
  return totals
