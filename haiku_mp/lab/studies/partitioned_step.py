"""A jitted step compiled, its collectives read from the program as the
SPMD partitioner left it, with its memory and FLOPs per device.

`step_collectives` compiles a jitted function and lists every collective of
the program as partitioned: the SPMD partitioner's output, the collectives'
dtypes as the step wrote them. It is read there because XLA:CPU's later
passes widen half-precision collectives (bfloat16 and float16 to float32, fp8
to float16: it has no narrower ones), which a GPU does not; the final
program's collectives are listed beside them (`compiled`). The per-device
bytes and FLOPs are those of the partitioned program, for the mesh it was
compiled for.
"""

import glob
import os
import random
import tempfile
from typing import Any, Callable

from haiku_mp.lab.studies import collectives


def _partitioned_text(lowered, options: dict[str, Any]
                      ) -> tuple[Any, str, str]:
  """(compiled, text, source): the program after SPMD partitioning, read
  from XLA's dump of that pass into a temporary directory, or the final
  program where no dump appears."""
  with tempfile.TemporaryDirectory() as tmp:
    dump = {'xla_dump_to': tmp, 'xla_dump_hlo_pass_re': 'spmd-partitioning'}
    compiled = lowered.compile(compiler_options={**options, **dump})
    dumps = glob.glob(os.path.join(tmp, '*after_spmd-partitioning*'))
    if not dumps:
      # Loaded from JAX's persistent compilation cache, which leaves dump
      # options out of its key: no pass ran. Compiled again under a key no
      # cached program has (the option only sizes a debug printout of
      # XLA's; a value drawn at random, so that no earlier call's is met).
      compiled = lowered.compile(compiler_options={
          **options, **dump, 'xla_debug_buffer_assignment_show_max':
              random.SystemRandom().randrange(2**20, 2**30)})
      dumps = glob.glob(os.path.join(tmp, '*after_spmd-partitioning*'))
    if dumps:
      with open(sorted(dumps)[-1]) as f:
        return compiled, f.read(), 'partitioned'
  return compiled, compiled.as_text(), 'compiled'


def _memory(compiled) -> dict[str, int]:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  fields = ('argument_size_in_bytes', 'output_size_in_bytes',
            'temp_size_in_bytes', 'alias_size_in_bytes',
            'generated_code_size_in_bytes')
  return {f.replace('_size_in_bytes', '_bytes'): int(getattr(analysis, f))
          for f in fields if hasattr(analysis, f)}


def _flops(compiled) -> float:
  costs = compiled.cost_analysis()
  if isinstance(costs, (list, tuple)):
    costs = costs[0] if costs else {}
  return float((costs or {}).get('flops', 0.0))


def step_collectives(jitted: Callable[..., Any], *args,
                     compiler_options: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
  """`jitted` (a `jax.jit` or `jax.pmap` function) lowered on `args`
  (arrays or ShapeDtypeStructs with shardings) and compiled: its
  collectives as partitioned and as compiled, its per-device memory from
  XLA's analysis, and its FLOPs per device. `compiler_options`: those the
  function is compiled with (a dump's are added). XLA's cost analysis
  counts a loop's body once (a scan of 5 matmuls: one matmul's FLOPs),
  where the collectives count every trip."""
  lowered = jitted.lower(*args)
  compiled, text, source = _partitioned_text(lowered,
                                             compiler_options or {})
  return dict(
      source=source,
      collectives=collectives.summarize(collectives.parse_collectives(text)),
      compiled_collectives=collectives.summarize(
          collectives.parse_collectives(compiled.as_text())),
      memory=_memory(compiled), flops=_flops(compiled))
