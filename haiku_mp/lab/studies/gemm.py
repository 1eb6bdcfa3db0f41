"""Study `gemm`: each Linear shape of the model, each of its three GEMMs,
timed in bfloat16, in fp8 on operands already quantized (the GEMM alone) and
in fp8 with its casts, beside the speed model's prediction of each, as
Transformer Engine's `benchmark_gemm.py` separates a GEMM from its
quantization.

Each GEMM is the one the project's fp8 Linear runs (`fp8.DIMENSIONS`,
`fp8.scaled_dot`): fprop `x @ w`, dgrad `g @ w.T`, wgrad `x.T @ g`, E4M3
forward and E5M2 gradients, float32 sums, a bfloat16 result. "With its
casts" adds what the pass itself quantizes, as the speed model counts it
(`haiku_mp.advisor.speed`): fprop quantizes x and w from their amaxes,
dgrad g; wgrad takes the copies already made. Each fp8 function's compiled
program is read for the per-matmul proof (`fp8_gemms.is_fp8_gemm`): on a GPU
whether XLA made an fp8 GEMM of it; on a CPU every time is of an emulation
(XLA:CPU has no fp8 GEMM), measured for its structure only, and the result
says so.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.advisor import gpus
from haiku_mp.advisor import speed as speed_lib
from haiku_mp.lab import charts
from haiku_mp.lab import timing
from haiku_mp.lab.studies import fp8_gemms
from haiku_mp.model import fp8 as fp8_lib
from haiku_mp.model.fp8_scales import amax
from haiku_mp.model.fp8_scales import E4M3
from haiku_mp.model.fp8_scales import E5M2
from haiku_mp.model.fp8_scales import quantize
from haiku_mp.model.fp8_scales import scale_from_amax
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit.train import experiment

VARIANTS = ('bf16', 'fp8_prequantized', 'fp8_with_casts')
CPU_NOTE = ('emulated: XLA:CPU has no fp8 GEMM (f8 converted to f16, a '
            'float32 dot); these times show the structure, not what a GPU '
            'runs')


def linear_shapes(settings: settings_lib.Settings
                  ) -> list[tuple[tuple[int, int, int], list[str]]]:
  """Each distinct (M tokens, K in, N out) of the model's Linears at the
  config's batch, with the Linears of that shape."""
  exp = experiment.build_without_data(settings)
  shapes: dict[tuple[int, int, int], list[str]] = {}
  for l in forward_lib.linear_shapes(exp.module_calls, settings.batch_size):
    shapes.setdefault((l.m, l.k, l.n), []).append(l.path)
  return sorted(shapes.items())


def _operands(m: int, k: int, n: int, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (k, n), jnp.float32) /
       np.sqrt(k)).astype(jnp.bfloat16)
  g = (jax.random.normal(keys[2], (m, n), jnp.float32) * 1e-3).astype(
      jnp.bfloat16)
  return x, w, g


def _scaled(t, dtype):
  scale = scale_from_amax(amax(t), dtype)
  return quantize(t, dtype, scale), scale


def _functions(pass_: str) -> dict[str, Callable]:
  """The pass's three variants, each `f(x, w, g) -> result` jitted; the
  pre-quantized one takes the quantized copies and scales."""
  dims = fp8_lib.DIMENSIONS[pass_]
  scope = {'fprop': fp8_lib.FPROP, 'dgrad': fp8_lib.DGRAD,
           'wgrad': fp8_lib.WGRAD}[pass_]

  def pick(x, w, g):
    return {'fprop': (x, w), 'dgrad': (g, w), 'wgrad': (x, g)}[pass_]

  def bf16(x, w, g):
    a, b = pick(x, w, g)
    return jax.lax.dot_general(a, b, dims,
                               preferred_element_type=jnp.float32).astype(
                                   jnp.bfloat16)

  def prequantized(qa, qb, a_scale, b_scale):
    return fp8_lib.scaled_dot(qa, qb, dims, a_scale, b_scale, scope).astype(
        jnp.bfloat16)

  def with_casts(x, w, g, qx, qw, qg, scales):
    """What the pass quantizes itself (fprop: x and w; dgrad: g), the rest
    taken as the earlier passes left it."""
    x_scale, w_scale, g_scale = scales
    if pass_ == 'fprop':
      (qa, a_scale), (qb, b_scale) = _scaled(x, E4M3), _scaled(w, E4M3)
    elif pass_ == 'dgrad':
      (qa, a_scale), qb, b_scale = _scaled(g, E5M2), qw, w_scale
    else:
      qa, a_scale, qb, b_scale = qx, x_scale, qg, g_scale
    return prequantized(qa, qb, a_scale, b_scale)

  return dict(bf16=jax.jit(bf16), fp8_prequantized=jax.jit(prequantized),
              fp8_with_casts=jax.jit(with_casts))


def _proof(fn, args, backend: str) -> str:
  """Whether the compiled program of an fp8 variant holds an fp8 GEMM."""
  if backend == 'cpu':
    return 'emulated (XLA:CPU)'
  matmuls = fp8_gemms.hlo_matmuls(fn.lower(*args).compile().as_text())
  if any(fp8_gemms.is_fp8_gemm(m) for m in matmuls):
    return 'fp8 GEMM'
  kinds = sorted({m['target'] or m['opcode'] for m in matmuls})
  return 'NOT an fp8 GEMM: ' + (', '.join(kinds) or 'no matmul')


def run(settings: settings_lib.Settings, gpu_name: str = '',
        repeats: int = 5, log: Callable[[str], None] = print
        ) -> dict[str, Any]:
  """Every Linear shape's three GEMMs in `VARIANTS`, timed (median of
  `repeats`) and predicted for `gpu_name` (default: the GPU it runs on)."""
  backend = jax.default_backend()
  device = str(jax.devices()[0].device_kind)
  gpu = gpus.gpu(gpu_name or gpus.detect(device))
  assumptions = gpus.Assumptions()
  rows = []
  for (m, k, n), paths in linear_shapes(settings):
    x, w, g = _operands(m, k, n, settings.seed)
    (qx, x_scale), (qw, w_scale) = _scaled(x, E4M3), _scaled(w, E4M3)
    qg, g_scale = _scaled(g, E5M2)
    for pass_ in speed_lib.PASSES:
      log(f'gemm: {m}x{k}x{n} {pass_}')
      fns = _functions(pass_)
      quantized = {'fprop': (qx, qw, x_scale, w_scale),
                   'dgrad': (qg, qw, g_scale, w_scale),
                   'wgrad': (qx, qg, x_scale, g_scale)}[pass_]
      args = dict(bf16=(x, w, g), fp8_prequantized=quantized,
                  fp8_with_casts=(x, w, g, qx, qw, qg,
                                  (x_scale, w_scale, g_scale)))
      gm, gk, gn = speed_lib.linear_gemm(pass_, m, k, n)
      predicted = dict(
          bf16=speed_lib.gemm(gm, gk, gn, 'bf16', gpu, assumptions, 2,
                              2).seconds,
          fp8_prequantized=speed_lib.gemm(gm, gk, gn, 'fp8', gpu,
                                          assumptions, 1, 2).seconds,
          fp8_with_casts=speed_lib.linear_pass_seconds(
              pass_, m, k, n, 'fp8_current', gpu, assumptions))
      measured, proof = {}, {}
      for variant in VARIANTS:
        fn = fns[variant]
        jax.block_until_ready(fn(*args[variant]))  # Compiles.
        measured[variant] = timing.median_seconds(fn, args[variant], repeats)
        if variant != 'bf16':
          proof[variant] = _proof(fn, args[variant], backend)
      rows.append(dict(
          shape=[m, k, n], linears=paths, gemm=[gm, gk, gn],
          measured=measured, predicted=predicted,
          measured_over_predicted=None if backend == 'cpu' else {
              v: measured[v] / predicted[v] for v in VARIANTS},
          fp8_gemm=proof))
      rows[-1]['pass'] = pass_  # A keyword `pass` is not Python.
  return dict(experiment='gemm', backend=backend, device=device,
              jax_version=jax.__version__, predicted_for=gpu.name,
              note=CPU_NOTE if backend == 'cpu' else '', repeats=repeats,
              batch_size=settings.batch_size, rows=rows)


def table(result: dict[str, Any]) -> str:
  lines = []
  if result['note']:
    lines.append(result['note'] + '.')
  lines.append(f'Measured on {result["device"]} ({result["backend"]}, jax '
               f'{result["jax_version"]}); predicted for the '
               f'{result["predicted_for"]}, in us:')
  lines.append('| Linear M x K x N | GEMM | ' + ' | '.join(
      f'{v} measured / predicted' for v in VARIANTS) + ' | fp8 GEMM |')
  lines.append('|---|---|' + '---|' * (len(VARIANTS) + 1))
  for row in result['rows']:
    cells = [f'{row["measured"][v] * 1e6:,.1f} / '
             f'{row["predicted"][v] * 1e6:,.1f}' for v in VARIANTS]
    lines.append(f'| {"x".join(map(str, row["shape"]))} | {row["pass"]} | ' +
                 ' | '.join(cells) + f' | {row["fp8_gemm"]["fp8_prequantized"]} |')
  return '\n'.join(lines)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Measured against predicted time per GEMM and variant (GPU only: a
  CPU's emulated times are no GPU's, so no plot)."""
  if result['backend'] == 'cpu':
    return []
  labels = [f'{"x".join(map(str, r["shape"]))}\n{r["pass"]}'
            for r in result['rows']]
  path = f'{out_dir}/gemm.png'
  series = {}
  for v in VARIANTS:
    series[f'{v} measured'] = [r['measured'][v] * 1e6 for r in result['rows']]
    series[f'{v} predicted'] = [r['predicted'][v] * 1e6
                                for r in result['rows']]
  charts.grouped_bar_chart(path, labels, series, 'microseconds',
                           f'GEMMs on {result["device"]}: measured and '
                           f'predicted for the {result["predicted_for"]}')
  return [path]
