"""`launch.train` that signals itself once the train metrics of a step are out.

    SIGNAL_AT_STEP=KILL:23 python -m tests.signal_at_step <launch.train flags>

Crash and preemption tests then interrupt the run at the same step on any
machine: a signal sent from the test process races the run, which may finish
first on a fast or idle machine, or later than expected on a loaded one.
`KILL:23+flush` first flushes the writer, as its background flush may have
done before a real kill: the killed run's last points are then on disk.
`STOP:23` stops the process (a frozen host), as the tests of a lost
process do. `INT:23+again` sends a second SIGINT as the checkpoint the first
one asked for starts saving (a user pressing Ctrl-C twice).
"""

import os
import runpy
import signal
import sys
import threading
import time

from haiku_mp.vit.train import checkpoint
from haiku_mp.vit.train import run_dir

ENV = 'SIGNAL_AT_STEP'
# The command to run (default launch.train): any that runs the trainer.
MODULE_ENV = 'SIGNAL_AT_STEP_MODULE'


# The line on stderr before each signal: its wall-clock time (a test's
# bound on what follows the signal starts there).
MARK = 'signal_at_step: {name} at {time:.3f}'


def _signal_main_thread(signum: int) -> None:
  # To the main thread, whose Python handler (if any) then runs before the
  # loop's next statement.
  sys.stderr.write(MARK.format(name=signal.Signals(signum).name,
                               time=time.time()) + '\n')
  sys.stderr.flush()
  signal.pthread_kill(threading.main_thread().ident, signum)


def _signal_after_train_write(signum: int, at_step: int, flush: bool) -> None:
  write = run_dir.MetricsWriter.write
  save = checkpoint.Checkpointer.save
  checkpointers = []

  def write_then_signal(self, step, split, values):
    write(self, step, split, values)
    if split == 'train' and step == at_step:
      if flush:
        self.flush()
      if signum in (signal.SIGKILL, signal.SIGSTOP):
        # Killed (or frozen) past a checkpoint that is on disk: its files,
        # written in the background, are finished first (a kill or a stop
        # during the write would lose that checkpoint, and the run would
        # resume from the one before: a stopped process of a many-process
        # run never joins the save's last barrier).
        for saver in checkpointers:
          saver.wait()
      _signal_main_thread(signum)

  def remember_then_save(self, *args, **kwargs):
    if self not in checkpointers:
      checkpointers.append(self)
    return save(self, *args, **kwargs)

  run_dir.MetricsWriter.write = write_then_signal
  checkpoint.Checkpointer.save = remember_then_save


def _signal_again_when_saving(signum: int, at_step: int) -> None:
  save = checkpoint.Checkpointer.save

  def signal_then_save(self, step, *args, **kwargs):
    if step == at_step:
      _signal_main_thread(signum)
    return save(self, step, *args, **kwargs)

  checkpoint.Checkpointer.save = signal_then_save


if __name__ == '__main__':
  name, step = os.environ[ENV].split(':')
  step, _, option = step.partition('+')
  _signal_after_train_write(getattr(signal, f'SIG{name}'), int(step),
                            option == 'flush')
  if option == 'again':
    _signal_again_when_saving(getattr(signal, f'SIG{name}'), int(step))
  runpy.run_module(os.environ.get(MODULE_ENV, 'launch.train'),
                   run_name='__main__', alter_sys=True)
