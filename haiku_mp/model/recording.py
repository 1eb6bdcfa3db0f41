"""What a trace of a model did under haiku_mp, for those who ask while it is
traced (the train step's first trace, `describe`): the precisions applied
and each module whose matmul haiku_mp ran, with its form. Nothing is
recorded unless a `recording()` is open, so a model traced outside one pays
nothing. Per thread, as Haiku's own contexts are."""

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import haiku as hk

_LOCAL = threading.local()


@dataclasses.dataclass
class Record:
  """What one `recording()` saw."""
  # Every `Precision` applied (`apply_precision` entered) while it was open.
  precisions: list[Any] = dataclasses.field(default_factory=list)
  # Module path -> the forms haiku_mp ran its matmuls in ('fp8', 'nvfp4',
  # 'native', 'upcast', 'plain', ...).
  matmuls: dict[str, set[str]] = dataclasses.field(default_factory=dict)


def _open() -> list[Record]:
  if not hasattr(_LOCAL, 'records'):
    _LOCAL.records = []
  return _LOCAL.records


@contextlib.contextmanager
def recording() -> Iterator[Record]:
  """A `Record` of what the code traced inside the context does."""
  record = Record()
  _open().append(record)
  try:
    yield record
  finally:
    _open().remove(record)


def applied(precision: Any) -> None:
  """`precision` is being applied (`interception.apply`)."""
  for record in _open():
    record.precisions.append(precision)


def ran(path: str, form: str) -> None:
  """haiku_mp ran the matmul of module `path` in `form`."""
  for record in _open():
    record.matmuls.setdefault(path, set()).add(form)


def ran_here(form: str) -> None:
  """haiku_mp ran a matmul of the Haiku module being called, in `form`
  (nothing outside a module, or with no recording open)."""
  if not _open():
    return
  try:
    path = hk.experimental.current_name()
  except ValueError:  # Outside hk.transform: no module to name.
    return
  ran(path, form)
