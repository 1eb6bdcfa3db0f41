"""`launch.train` whose checkpoint of a given step finds no room to write.

    DISK_FULL_AT_STEP=10 python -m tests.disk_full_at_step <launch.train flags>

A test cannot fill a real disk, and mounting a small one needs privileges a
test machine may not grant. From the save of that step on, the process's file
size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) is set below the size of the
checkpoints' largest file, so that TensorStore's write of the new one fails
inside orbax as it does on a full disk; files already larger are not touched.
"""

import os
import resource
import runpy
import signal

from haiku_mp.train import checkpoint

ENV = 'DISK_FULL_AT_STEP'


def _no_room_from(at_step: int) -> None:
  save = checkpoint.Checkpointer.save

  def save_without_room(self, step, *args, **kwargs):
    if step >= at_step:
      sizes = [os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(self.directory) for name in names]
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
      resource.setrlimit(resource.RLIMIT_FSIZE,
                         (max(sizes) // 2, resource.RLIM_INFINITY))
    return save(self, step, *args, **kwargs)

  checkpoint.Checkpointer.save = save_without_room


if __name__ == '__main__':
  _no_room_from(int(os.environ[ENV]))
  runpy.run_module('launch.train', run_name='__main__', alter_sys=True)
