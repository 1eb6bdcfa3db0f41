"""A run's resources closed on leaving its ExitStack, the first failure kept."""

import contextlib
from typing import Iterator, TypeVar

from absl import logging

_Resource = TypeVar('_Resource')


@contextlib.contextmanager
def closed_on_exit(resource: _Resource) -> Iterator[_Resource]:
  """Closes `resource` on leaving the block. Leaving on an error, an error
  of the closing itself is dropped: the first failure is the one reported
  (a full disk that failed a save fails the checkpoints' and the metrics'
  closing too, and would replace the save's error with theirs)."""
  try:
    yield resource
  except BaseException:
    try:
      resource.close()
    except Exception:  # pylint: disable=broad-except
      logging.debug('Closing %s after an error failed too.', resource,
                    exc_info=True)
    raise
  resource.close()
