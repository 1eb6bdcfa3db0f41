"""`launch.train` whose checkpoint of a given step finds no room to write.

    DISK_FULL_AT_STEP=10 python -m tests.disk_full_at_step <launch.train flags>
    DISK_FULL_AT_STEP=10+close ...
    DISK_FULL_AT_STEP=0 ...

`0`: no file can grow past a few bytes from the start (the run's first
files, before any checkpoint, find no room).

`+close`: orbax's closing of its checkpoint manager then fails too, as it
does when its metadata writes (a thread of their own) also found no room:
a second error from orbax, on the main thread, after the save's.

A test cannot fill a real disk, and mounting a small one needs privileges a
test machine may not grant. From the save of that step on, the process's file
size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) is set below the size of the
checkpoints' largest file, so that TensorStore's write of the new one fails
inside orbax as it does on a full disk; files already larger are not touched.
"""

import errno
import os
import resource
import runpy
import signal
from typing import Callable

import orbax.checkpoint as ocp

from haiku_mp.vit.train import checkpoint

ENV = 'DISK_FULL_AT_STEP'


def leave_no_room(directory: str) -> Callable[[], None]:
  """Sets the process's file size limit to half the largest file under
  `directory` (SIGXFSZ ignored, so that a write fails instead); returns a
  function that gives the room back."""
  sizes = [os.path.getsize(os.path.join(root, name))
           for root, _, names in os.walk(directory) for name in names]
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  limits = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (max(sizes) // 2, limits[1]))

  def give_room_back():
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    signal.signal(signal.SIGXFSZ, handler)

  return give_room_back


def _no_room_from(at_step: int, closing_fails: bool) -> None:
  save = checkpoint.Checkpointer.save
  no_room = []

  def save_without_room(self, step, *args, **kwargs):
    if step >= at_step:
      # The save before it may still be writing (`save` waits for it first):
      # it finishes with room, so that this step's is the one that finds
      # none (under load, the last save's write failed instead).
      self.wait()
      leave_no_room(self.directory)
      no_room.append(step)
    return save(self, step, *args, **kwargs)

  checkpoint.Checkpointer.save = save_without_room
  if closing_fails:
    # What CheckpointManager.close calls last, after its own waits.
    close = ocp.AsyncCheckpointer.close

    def close_without_room(self):
      close(self)
      if no_room:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                      f'checkpoint {no_room[0]}/_CHECKPOINT_METADATA')

    ocp.AsyncCheckpointer.close = close_without_room


# What a file may hold with `DISK_FULL_AT_STEP=0`: less than any the run writes.
_FROM_THE_START_BYTES = 16

if __name__ == '__main__':
  step, _, option = os.environ[ENV].partition('+')
  if int(step) == 0:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (
        _FROM_THE_START_BYTES, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
  _no_room_from(int(step), option == 'close')
  runpy.run_module('launch.train', run_name='__main__', alter_sys=True)
