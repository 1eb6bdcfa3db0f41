"""The steps since the last log point: their host metrics summarized, and
kept in a checkpoint for the run that resumes from it."""

from typing import Any, Mapping, Sequence

import numpy as np


def _mean_of_kept(values) -> float:
  """The mean of the values that are not NaN; NaN, without numpy's warning,
  when a whole window of steps was skipped."""
  values = np.asarray(values, np.float64)
  kept = values[~np.isnan(values)]
  return float(kept.mean()) if kept.size else float('nan')


def window_summary(window: list[dict[str, Any]], means: Sequence[str]
                   ) -> dict[str, float]:
  """Host summary of the metrics of the steps since the last log point:
  `means` averaged (each over the steps that have it: a resumed run's first
  window starts with the steps its checkpoint kept, which a run of another
  config may have saved, without DP-SGD's metrics, say), the loss scale and
  skipped steps as they stand."""
  summary = {k: _mean_of_kept([m[k] for m in window if k in m])
             for k in means}
  last = window[-1]
  summary['loss_scale'] = float(last['loss_scale'])
  summary['skipped_steps'] = int(last['skipped_steps'])
  summary['window_skipped_steps'] = int(
      sum(not bool(m['grads_finite']) for m in window))
  return summary


def window_record(window: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The host metrics of a log window's steps as JSON-ready values (arrays
  as lists, NaN and inf kept as floats): what a checkpoint keeps of the
  steps since the last log point, for the run that resumes from it."""
  return [{k: np.asarray(v).tolist() for k, v in m.items()} for m in window]


def window_from_record(record: Sequence[Mapping[str, Any]]
                       ) -> list[dict[str, np.ndarray]]:
  """`window_record`'s steps as host metrics again, every value as it was
  (a float32 value comes back as the same number in float64, which is how
  `window_summary` averages it)."""
  return [{k: np.asarray(v) for k, v in m.items()} for m in record]
