"""Batches placed on the devices ahead of the loop that reads them, by one
background thread (`DevicePrefetch`)."""

import queue
import threading
from typing import Any, Callable, Iterator

from haiku_mp.vit.data.pipeline import Batch


class DevicePrefetch:
  """`place(batch)` of each batch, made by a background thread up to `size`
  batches ahead of the loop that reads them.

  Drawing a batch's indices, gathering its uint8 rows and starting its copy
  to the devices is host time; on the loop's thread it would be time the loop
  does not spend dispatching steps, so the device would wait for it. One
  producer thread keeps the order (a resumed run reads the same batches).
  An error in the thread is raised by the `next()` that would have returned
  its batch. A context manager: leaving it stops and joins the thread.
  """

  _END = object()

  def __init__(self, batches: Iterator[Batch], place: Callable[[Batch], Any],
               size: int):
    # The standard library's queue, not a dataset library: the batches are
    # already in memory, and the loop needs exactly this (bounded, ordered,
    # errors passed on).
    self._queue = queue.Queue(maxsize=size)
    self._stopping = threading.Event()
    self._thread = threading.Thread(target=self._produce,
                                    args=(batches, place), daemon=True,
                                    name='haiku_mp-prefetch')
    self._thread.start()

  def _produce(self, batches, place) -> None:
    try:
      for batch in batches:
        self._queue.put((place(batch), None))
        if self._stopping.is_set():
          return
    except BaseException as e:  # pylint: disable=broad-except
      # Whatever stops the thread reaches the loop, which would otherwise
      # wait for a batch forever.
      self._queue.put((None, e))
      return
    self._queue.put((self._END, None))

  def __iter__(self):
    return self

  def __next__(self):
    item, error = self._queue.get()
    if error is not None:
      self._queue.put((self._END, None))  # Every later next() ends.
      raise error
    if item is self._END:
      self._queue.put((self._END, None))
      raise StopIteration
    return item

  def close(self) -> None:
    """Stops the thread. After `_stopping` is set it makes at most one more
    put, which the emptied queue has room for, so the join never hangs."""
    self._stopping.set()
    while True:
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    self._thread.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()
