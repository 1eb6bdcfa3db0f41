"""Evaluation over a whole split: every example once, padded batches masked."""

import time
from typing import Optional


from haiku_mp.vit.data import prefetch
from haiku_mp.vit.train import console_lines
from haiku_mp.vit.train import in_flight


_SUMMED = ('loss', 'accuracy', 'num_examples')


def evaluate(eval_step, params, batches, to_host,
             watch: in_flight.InFlight) -> dict[str, float]:
  """Loss and accuracy over every (unpadded) example of `batches`.

  `eval_step` returns metrics over the whole global batch, so the result
  covers every process's examples. Each batch is one program on the devices:
  its metrics are summed on the host (`to_host`: the strategy's copy of
  replicated values) once it is finished, with at most `watch.limit`
  batches in flight (`watch`: an empty `InFlight`).
  """
  sums = dict.fromkeys(_SUMMED, 0.0)

  def add(finished):
    _, out = finished
    out = to_host(out)
    n = float(out['num_examples'])
    sums['loss'] += float(out['loss']) * n
    sums['accuracy'] += float(out['accuracy']) * n
    sums['num_examples'] += n

  for i, batch in enumerate(batches):
    out = eval_step(params, batch)
    finished = watch.push(f'eval batch {i + 1}', {k: out[k] for k in _SUMMED})
    if finished is not None:
      add(finished)
  for finished in watch.drain():
    add(finished)
  n = sums['num_examples']
  return dict(loss=sums['loss'] / n, accuracy=sums['accuracy'] / n,
              num_examples=int(n))


class Evaluator:
  """Evaluates on a split, logs and writes the result, keeps the time spent."""

  def __init__(self, exp, splits, shard, writer, progress,
               on_stall: Optional[in_flight.OnStall] = None):
    self._exp, self._splits, self._shard = exp, splits, shard
    self._writer, self._progress = writer, progress
    self._on_stall = on_stall

  def __call__(self, split_name: str, step: int, params,
               label: Optional[str] = None, **extra) -> dict[str, float]:
    """The split's metrics, written with `extra` ones (DP-SGD's epsilon) as
    the split `label` (default: its name; 'val_ema' for the params' moving
    average)."""
    label = label or split_name
    exp = self._exp
    start = time.perf_counter()
    with prefetch.DevicePrefetch(
        exp.eval_batches(getattr(self._splits, split_name), self._shard),
        exp.strategy.place_batch, exp.settings.data.prefetch_batches
    ) as batches, in_flight.InFlight(
        exp.settings.steps_in_flight, exp.settings.stall_timeout_sec,
        self._on_stall) as watch:
      result = dict(evaluate(exp.strategy.eval_step, params, batches,
                             exp.strategy.to_host, watch), **extra)
    self._progress.eval_seconds += time.perf_counter() - start
    self._writer.write(step, label, result)
    console_lines.info('%s at step %d: loss %.4f accuracy %.4f (%d examples)',
                       label, step, result['loss'], result['accuracy'],
                       result['num_examples'])
    return result
