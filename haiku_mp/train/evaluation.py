"""Evaluation over a whole split: every example once, padded batches masked."""

import time
from typing import Optional

from absl import logging
import jax
import jax.numpy as jnp

from haiku_mp.data import pipeline


def evaluate(eval_step, params, batches, unreplicate=lambda x: x
             ) -> dict[str, float]:
  """Loss and accuracy over every (unpadded) example of `batches`.

  `eval_step` returns metrics over the whole global batch, so the result
  covers every process's examples.
  """
  totals = None
  for batch in batches:
    out = eval_step(params, batch)
    out = unreplicate({k: out[k] for k in ('loss', 'accuracy',
                                           'num_examples')})
    n = out['num_examples']
    sums = dict(loss=out['loss'] * n, accuracy=out['accuracy'] * n,
                num_examples=n)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  n = float(totals['num_examples'])
  return dict(loss=float(totals['loss']) / n,
              accuracy=float(totals['accuracy']) / n, num_examples=int(n))


class Evaluator:
  """Evaluates on a split, logs and writes the result, keeps the time spent."""

  def __init__(self, exp, splits, shard, writer, progress):
    self._exp, self._splits, self._shard = exp, splits, shard
    self._writer, self._progress = writer, progress

  def __call__(self, split_name: str, step: int, params,
               label: Optional[str] = None, **extra) -> dict[str, float]:
    """The split's metrics, written with `extra` ones (DP-SGD's epsilon) as
    the split `label` (default: its name; 'val_ema' for the params' moving
    average)."""
    label = label or split_name
    exp = self._exp
    start = time.perf_counter()
    with pipeline.DevicePrefetch(
        pipeline.eval_batches(exp.config,
                                    getattr(self._splits, split_name),
                                    self._shard),
        exp.strategy.place_batch, exp.config.data.prefetch_batches) as batches:
      result = dict(evaluate(exp.strategy.eval_step, params, batches,
                             exp.strategy.unreplicate), **extra)
    self._progress.eval_seconds += time.perf_counter() - start
    self._writer.write(step, label, result)
    logging.info('%s at step %d: loss %.4f accuracy %.4f (%d examples)',
                 label, step, result['loss'], result['accuracy'],
                 result['num_examples'])
    return result
