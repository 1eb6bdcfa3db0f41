"""A run's files written so that a kill or a full disk never leaves one half
written: JSON-ready values, and atomic replaces."""

import json
import math
import os
from typing import Any, Mapping

import numpy as np


def to_python(value: Any) -> Any:
  """A JSON-ready number or container (NaN and inf as strings JSON accepts)."""
  if isinstance(value, Mapping):
    return {k: to_python(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_python(v) for v in value]
  value = np.asarray(value).item() if hasattr(value, 'dtype') else value
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


def write_atomically(path: str, text: str) -> None:
  """A temp file renamed over `path`: a kill leaves the old or the new file,
  and so does a failed write (a full disk), whose OSError names `path`."""
  tmp = f'{path}.tmp'
  try:
    with open(tmp, 'w') as f:
      f.write(text)
    os.replace(tmp, path)
  except OSError as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise OSError(e.errno, e.strerror, path) from None


def write_json(path: str, data: Mapping[str, Any]) -> None:
  """Writes `data` atomically."""
  write_atomically(path, json.dumps(to_python(data), indent=1) + '\n')
