"""`launch.train` that signals itself once the train metrics of a step are out.

    SIGNAL_AT_STEP=KILL:23 python -m tests.signal_at_step <launch.train flags>

Crash and preemption tests then interrupt the run at the same step on any
machine: a signal sent from the test process races the run, which may finish
first on a fast or idle machine, or later than expected on a loaded one.
`KILL:23+flush` first flushes the writer, as its background flush may have
done before a real kill: the killed run's last points are then on disk.
"""

import os
import runpy
import signal
import threading

from haiku_mp import metrics

ENV = 'SIGNAL_AT_STEP'


def _signal_after_train_write(signum: int, at_step: int, flush: bool) -> None:
  write = metrics.MetricsWriter.write

  def write_then_signal(self, step, split, values):
    write(self, step, split, values)
    if split == 'train' and step == at_step:
      if flush:
        self.flush()
      # To the main thread, whose Python handler (if any) then runs before the
      # loop's next statement.
      signal.pthread_kill(threading.main_thread().ident, signum)

  metrics.MetricsWriter.write = write_then_signal


if __name__ == '__main__':
  name, step = os.environ[ENV].split(':')
  step, _, flush = step.partition('+')
  _signal_after_train_write(getattr(signal, f'SIG{name}'), int(step),
                            flush == 'flush')
  runpy.run_module('launch.train', run_name='__main__', alter_sys=True)
