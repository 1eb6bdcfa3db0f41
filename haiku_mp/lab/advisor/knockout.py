"""The advisor's knockout (`--level=knockout`): one module at a time in a
half format on the float32 model, ranked by how far its logits and loss
move from float32's on the same batches.
"""

import math
from typing import Any, Callable

import jax
import numpy as np

from haiku_mp.advisor import verdicts
from haiku_mp.update import classification
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit import settings as settings_schema


def knockout(settings: settings_schema.Settings, params, inputs,
             paths: list[str], dtypes: list[str], log: Callable[[str], None]
             ) -> dict[str, list[dict[str, Any]]]:
  """Per dtype, each module alone in it (a path override on the float32
  model): its eval loss and logits against the float32 model's, over
  `inputs`, most sensitive first."""

  def logits_and_loss(variant):
    precision = forward_lib.precision_from_config(variant)
    step = jax.jit(classification.make_eval_step(
        forward_lib.make_forward(variant.model, precision)))
    outs = [step(params, batch) for batch in inputs]
    return (np.concatenate([np.asarray(o['logits'], np.float64) for o in outs]),
            float(np.mean([float(o['loss']) for o in outs])))

  ref_logits, ref_loss = logits_and_loss(settings)
  norm = np.linalg.norm(ref_logits)
  ranked = {}
  for dtype in dtypes:
    half = verdicts.policy(settings.precision.policy, dtype, dtype)
    rows = []
    for i, path in enumerate(paths):
      variant = settings_schema.replace(
          settings, precision=dict(overrides=f'{path}:{half}'))
      logits, loss = logits_and_loss(variant)
      finite = bool(np.all(np.isfinite(logits)))
      error = (float(np.linalg.norm(logits - ref_logits) / norm)
               if finite and norm else math.inf)
      rows.append(dict(path=path, loss=loss, loss_change=loss - ref_loss,
                       logits_relative_error=error, finite=finite))
      log(f'advise: knockout {dtype} {i + 1}/{len(paths)} {path}: logits '
          f'error {error:.3g}')
    ranked[dtype] = sorted(rows, key=lambda r: -r['logits_relative_error'])
  return ranked
