"""A strategy's train step compiled ahead of its first call, per batch shape,
so that no logged rate includes compilation. (Beside the loop, not in
`parallel/`: it uses the compilation cache, a floor above the strategies.)"""

import time

import jax

from haiku_mp.vit.train import compilation_cache
from haiku_mp.vit.train import console_lines


class CompiledSteps:
  """The train step compiled ahead of a step of each batch shape it meets, so
  that every logged rate, the first window's after a start or a resume
  included, excludes compilation. Ordinary training meets one shape; DP-SGD
  another in the rare step whose Poisson draw outgrows the padded batch."""

  def __init__(self, strategy):
    self._strategy = strategy
    self._compiled = {}

  def compile(self, state, batch):
    shapes = tuple(sorted((k, v.shape) for k, v in batch.items()))
    if shapes not in self._compiled and not self._strategy.compiles_ahead:
      console_lines.info(
          'The train step compiles in its first call (%s over %d '
          'processes cannot be compiled ahead): the first log '
          "window's rate includes it.", self._strategy.name,
          jax.process_count())
      self._compiled[shapes] = self._strategy.train_step
    if shapes not in self._compiled:
      start = time.perf_counter()
      lowered = self._strategy.train_step.lower(state, batch)
      lowered_at = time.perf_counter()
      with compilation_cache.hits() as hits:
        self._compiled[shapes] = lowered.compile()
      end = time.perf_counter()
      # Tracing and lowering run every time; XLA's compile is what the
      # persistent compilation cache saves.
      console_lines.info(
          'Compiled the train step for a batch of %d in %.1fs '
          '(tracing and lowering %.1fs, XLA %.1fs%s).', batch['label'].size,
          end - start, lowered_at - start, end - lowered_at,
          ', loaded from the compilation cache' if hits else '')
    return self._compiled[shapes]

  def __call__(self, state, batch):
    return self.compile(state, batch)(state, batch)
