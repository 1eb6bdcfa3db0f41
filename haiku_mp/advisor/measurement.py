"""The advisor's measurements for any Haiku model: each module's values and
gradients at 16 bits (`measure_model`) and each Linear's operands at 8 bits
(`measure_fp8`) and 4 bits (`measure_fp4`), over a few batches at fixed
params. They need only the
model's loss function: `driver` runs them on the trainer's ViT, from its
workdirs and checkpoints.

  modules = advisor.measure_model(loss_fn, params, batches, key)
  print(advisor.overrides(modules, advisor.judge(modules, limits), 'float16'))
"""

from typing import Callable, Optional, Sequence

import haiku as hk
import jax
import numpy as np

from haiku_mp.advisor import fp4_numerics
from haiku_mp.advisor import fp4_verdicts
from haiku_mp.advisor import fp8_numerics
from haiku_mp.advisor import fp8_probes
from haiku_mp.advisor import fp8_verdicts
from haiku_mp.advisor import numerics
from haiku_mp.advisor import probes
from haiku_mp.advisor import verdicts
from haiku_mp.model import fp4
from haiku_mp.model import fp8
from haiku_mp.model import half_dot
from haiku_mp.model import policies


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
    candidates = advisor.fp8_linears(classes, 'Linear')
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


def measure_model(loss_fn: probes.LossFn, params, batches, key: jax.Array,
                  loss_scale: float = 1.0) -> list[verdicts.Module]:
  """The statistics `verdicts.judge` reads, for any Haiku model: each module
  call's output and output gradient, and each param's gradient, over
  `batches` at fixed `params`, the float16 shares taken at `loss_scale`.

  `loss_fn(params, rng, batch) -> (loss, aux)` is the model's training loss
  under its precision (float32 compute measures what half precision would
  lose; `launch.lab advise` does that for the ViT, with train steps between
  batches).

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
  return totals.modules(classes, stats.aliases)



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


def fp8_linears(classes: dict[str, str],
                targets: str = fp8.DEFAULT_MODULES) -> list[str]:
  """The paths of the Linear layers (stock or haiku_mp's) among `classes`
  (`module_classes_of`'s) that `targets` (``'TARGET;...'``, as
  `make_precision`'s `fp8_modules`) select: the candidates for fp8.

  Example:
    classes = advisor.module_classes_of(loss_fn, params, jax.random.key(0), batch)
    paths = advisor.fp8_linears(classes, '*/linear_0;*/linear_1')
  """
  selected = policies.parse_targets(targets)
  return [p for p, c in classes.items()
          if c == half_dot.FP8_CLASS and half_dot.selects(selected, c, p)]


def measure_fp8(loss_fn: probes.LossFn, params, batches: Sequence,
                paths: Sequence[str], history_length: int = 16,
                margin: float = 0.0,
                log: Optional[Callable[[str], None]] = None
                ) -> dict[str, list[np.ndarray]]:
  """Each Linear at `paths`: its input, weight and output gradient as E4M3 /
  E5M2 would hold them under every scaling (`fp8.SCALINGS`), summed over
  `batches` at `params`; delayed scaling's history is the pass's own (the
  amaxes of the batches before, up to `history_length`). `judge_fp8` reads
  it. `loss_fn` computes in bfloat16 or float32, without fp8.

  Example:
    totals = advisor.measure_fp8(loss_fn, params, batches, paths)
    judged = advisor.judge_fp8(totals, 'current', fp8_limits, 'Linear')
  """
  stats = fp8_probes.statistics_fn(loss_fn, paths, margin)
  histories = {p: [] for p in paths}
  totals = {}
  for i, batch in enumerate(batches):
    delayed = {p: np.max(h[-history_length:], axis=0) if h else np.zeros(2)
               for p, h in histories.items()}
    found = jax.device_get(stats.fn(params, jax.random.key(i), batch,
                                    {p: np.asarray(d, np.float32)
                                     for p, d in delayed.items()}))
    for p, vector in found.items():
      parts = fp8_probes.split(vector)
      histories[p].append([fp8_numerics.amax_of(parts[0]),
                           fp8_numerics.amax_of(parts[1])])  # x's and g's.
      totals[p] = ([fp8_numerics.merge(a, b) for a, b in zip(totals[p], parts)]
                   if p in totals else parts)
    if log is not None:
      log(f'advise: fp8 statistics {i + 1}/{len(batches)}')
  return totals


def judge_fp8(totals: dict[str, list[np.ndarray]], scaling: str,
              limits: fp8_verdicts.Fp8Thresholds, targets: str
              ) -> dict:
  """The 8-bit verdicts of `measure_fp8`'s Linears: per path a verdict and
  its reasons per scaling, the paths judged `keep-bf16` at `scaling`, and
  the `fp8_modules` value (from `targets`, the candidates' setting) that
  keeps bfloat16 in exactly those.

  Example:
    judged = advisor.judge_fp8(totals, 'current', fp8_limits, 'Linear')
    precision = haiku_mp.make_precision(BF16, model_class=hk.nets.MLP,
                                        fp8_modules=judged['fp8_modules'])
  """
  rows, kept = [], []
  for p, parts in totals.items():
    operands = fp8_verdicts.operands(parts)
    judged = {s: fp8_verdicts.judge(operands, s, limits)
              for s in fp8.SCALINGS}
    if judged[scaling][0] == fp8_verdicts.KEEP_BF16:
      kept.append(p)
    rows.append(dict(path=p, verdicts={s: v for s, (v, _) in judged.items()},
                     reasons={s: r for s, (_, r) in judged.items() if r},
                     **operands))
  return dict(scaling=scaling, modules=rows, keep_bf16=kept,
              fp8_modules=fp8_verdicts.modules_setting(list(totals), kept,
                                                       targets))


def measure_fp4(loss_fn: probes.LossFn, params, batches: Sequence,
                paths: Sequence[str],
                log: Optional[Callable[[str], None]] = None
                ) -> dict[str, list[np.ndarray]]:
  """Each Linear at `paths`: its input, weight and output gradient as NVFP4
  and MXFP4 would hold them, blocked as the train step blocks each GEMM's
  operands (the weight gradient's with and without the Hadamard transform,
  the layer's own signs), summed over `batches` at `params`. `judge_fp4`
  reads it. `loss_fn` computes in bfloat16 or float32, without low-bit
  matmuls.

  Example:
    totals = advisor.measure_fp4(loss_fn, params, batches, paths)
    judged = advisor.judge_fp4(totals, 'nvfp4', True, fp4_limits, fp8_judged,
                               'Linear')
  """
  operands = fp8_probes.Operands(
      fp4_numerics.size('input') + fp4_numerics.size('gradient'),
      fp4_numerics.activations, fp4_numerics.weight)
  stats = fp8_probes.statistics_fn(loss_fn, paths, operands=operands)
  signs = {p: fp4.initial_signs(p)((fp4.NVFP4_BLOCK,), np.float32)
           for p in stats.paths}
  totals = {}
  for i, batch in enumerate(batches):
    found = jax.device_get(stats.fn(params, jax.random.key(i), batch, signs))
    for p, vector in found.items():
      parts = fp4_numerics.split(vector)
      totals[p] = ([fp4_numerics.merge(a, b) for a, b in zip(totals[p], parts)]
                   if p in totals else parts)
    if log is not None:
      log(f'advise: 4-bit statistics {i + 1}/{len(batches)}')
  return totals


def judge_fp4(totals: dict[str, list[np.ndarray]], fmt: str, hadamard: bool,
              limits: fp4_verdicts.Fp4Thresholds, fp8_judged: dict,
              targets: str) -> dict:
  """The 4-bit verdicts of `measure_fp4`'s Linears: per path and format
  whether 4 bits hold its operands (and why not); at `fmt`, per path
  `fp4-ok`, `keep-fp8` (its fp8 verdict at current scaling, the one a
  4-bit config's fp8 Linears run, passes in `fp8_judged`, `judge_fp8`'s)
  or `keep-bf16`, and the `fp8_modules` / `keep_fp8` settings that run
  exactly that.

  Example:
    judged = advisor.judge_fp4(totals, 'nvfp4', True, fp4_limits, fp8_judged,
                               'Linear')
    precision = haiku_mp.make_precision(BF16, model_class=hk.nets.MLP,
        fp8_modules=judged['fp8_modules'], fp4=haiku_mp.Fp4('nvfp4'),
        keep_fp8=judged['keep_fp8'])
  """
  fp8_of = {r['path']: r['verdicts']['current']
            for r in fp8_judged['modules']}
  rows, chosen = [], {}
  for p, parts in totals.items():
    operands = fp4_verdicts.operands(parts)
    judged = {f: fp4_verdicts.judge(operands, f, hadamard, limits)
              for f in fp4.FORMATS}
    verdicts = {f: fp4_verdicts.verdict(fits, fp8_of.get(p, ''))
                for f, (fits, _) in judged.items()}
    chosen[p] = verdicts[fmt]
    rows.append(dict(path=p, verdicts=verdicts,
                     reasons={f: r for f, (_, r) in judged.items() if r},
                     **operands))
  setting = fp4_verdicts.settings(list(totals), chosen, targets)
  return dict(format=fmt, hadamard=hadamard, modules=rows,
              keep_fp8=[p for p, v in chosen.items()
                        if v == fp4_verdicts.KEEP_FP8],
              keep_bf16=[p for p, v in chosen.items()
                         if v == fp4_verdicts.KEEP_BF16],
              fp8_modules=setting['modules'],
              keep_fp8_setting=setting['keep_fp8'])
