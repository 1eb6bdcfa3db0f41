"""A many-process run that loses a process ends, on every other, with one line.

JAX's distributed runtime finds a lost process by its heartbeats: the
coordination service (in process 0) marks a process that sent none for the
heartbeat timeout as failed and tells every other; a process that cannot
reach the service (process 0 lost) finds that out itself. Either way the
runtime then ends the process from one of its own threads with a C++ fatal
error: a screen of log lines, every thread's stack, exit status 134. Its one
hook, the client's `missed_heartbeat_callback`, cannot be used (jaxlib 0.10
aborts on calling a Python one: it cannot hand over the status), and no
Python code runs after an abort. That is why this module exists: a command
that trains with many processes forks (`supervised`) before JAX has a
backend; the child trains, and this parent, which holds no runtime, passes
the child's output through. What the runtime says as it ends the child
becomes one line naming the lost process, the last step finished here, the
newest complete checkpoint and the command to restart, and the exit status
`EXIT_PROCESS_LOST`; the runtime's own lines go to a file in the workdir.

The child is in a process group of its own, so a signal reaches it once:
the parent forwards SIGINT, SIGTERM and SIGHUP (a Ctrl-C at the terminal
reaches the parent's group only); and it dies with the parent (Linux's
parent-death signal), so that killing the command kills its trainer.
"""

import ctypes
import os
import re
import selectors
import shlex
import signal
import sys
import time
from typing import Optional

import orbax.checkpoint as ocp

# sysexits' EX_TEMPFAIL, "a temporary failure: retrying may succeed": run
# the same commands again. Documented in docs/parallelism.md.
EXIT_PROCESS_LOST = 75
# What the file of the runtime's own lines is called, per process.
RUNTIME_LOG = 'lost_process.{process}.log'
# A line the distributed runtime logs (glog's form) from its coordination
# service, its client or the preemption sync: held back, since such lines
# come only as the runtime is about to end the process.
_RUNTIME_LINE = re.compile(
    rb'^[IWEF]\d{4} [\d:.]+ +\d+ (coordination_service\w*|preemption_\w+|'
    rb'client|service)\.(cc|h):\d+\]')
# The line with which the runtime ends a process over a lost peer.
_FATAL = b'Terminating process because the JAX distributed service'
_UNHEALTHY = re.compile(
    rb'tasks are unhealthy \(stopped sending heartbeats\):\s*([\d,\s]+)')
# This process's own calls to the service (in process 0) failing: closed,
# or its heartbeats unanswered.
_SERVICE_GONE = re.compile(
    rb'Failed to send RPC to coordination service|'
    rb'CoordinationService/(Heartbeat|PollForError)')
# Held lines that turn out not to end the process go out after this long.
_HOLD_SEC = 5.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def restart_command(argv: list[str]) -> str:
  """The command that started this process (`argv`: sys.argv), as a user
  types it again."""
  return shlex.join(['python', '-m', 'launch.train', *argv[1:]])


def newest_checkpoint(directory: str) -> Optional[int]:
  """The newest complete (finalized) checkpoint's step in `directory`: an
  unfinished save's temporary directory is not one, and a restart skips
  it too."""
  steps = ocp.utils.checkpoint_steps(directory)
  return max(steps) if steps else None


def lost_processes(runtime_text: bytes) -> Optional[list[int]]:
  """The processes the runtime's last words name as lost: those that sent
  no heartbeat, or [0] when the coordination service (process 0) could not
  be reached; [] when they name none (a lost process all the same); None
  when the text is not a lost process's."""
  if _FATAL not in runtime_text:
    return None
  unhealthy = _UNHEALTHY.search(runtime_text)
  if unhealthy:
    return sorted({int(i) for i in re.findall(rb'\d+', unhealthy.group(1))})
  return [0] if _SERVICE_GONE.search(runtime_text) else []


class Reporter:
  """The child's side: tells the parent which process it is (known once
  JAX's runtime started: `--distributed` finds it) and each step known
  finished."""

  def __init__(self, fd: int):
    self._fd, self._step = fd, None

  def started(self, process: int, num_processes: int) -> None:
    os.write(self._fd, b'process %d %d\n' % (process, num_processes))

  def finished(self, step: int) -> None:
    if step != self._step:
      self._step = step
      os.write(self._fd, b'step %d\n' % step)


def _write(stream, data: bytes) -> None:
  """All of `data` to `stream`'s file; nothing once its reader is gone (a
  pipe into `head`): the child's output is still drained, so it never
  blocks."""
  view = memoryview(data)
  try:
    while view:
      view = view[os.write(stream.fileno(), view):]
  except (BrokenPipeError, ValueError):
    pass


def _die_with_parent(parent: int) -> None:
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG,
                                            signal.SIGKILL)
  except (AttributeError, OSError):  # Not Linux: the child may outlive it.
    pass
  if os.getppid() != parent:  # The parent died before prctl.
    os._exit(1)  # pylint: disable=protected-access


class _Parent:
  """Passes the child's output through, holding back the runtime's lines;
  keeps the last step the child reported."""

  def __init__(self, out: int, err: int, status: int):
    self.last_step = None
    self.process = self.num_processes = None
    self._err_line = b''
    self._held, self._held_since = [], None
    self._selector = selectors.DefaultSelector()
    for fd, on_data in ((out, self._out), (err, self._err),
                        (status, self._status)):
      self._selector.register(fd, selectors.EVENT_READ, on_data)
    self._status_line = b''

  @staticmethod
  def _out(data: bytes) -> None:
    _write(sys.stdout, data)

  def _status(self, data: bytes) -> None:
    lines = (self._status_line + data).split(b'\n')
    self._status_line = lines.pop()
    for line in lines:
      kind, *values = line.split()
      if kind == b'step':
        self.last_step = int(values[0])
      else:
        self.process, self.num_processes = map(int, values)

  def _err(self, data: bytes) -> None:
    lines = (self._err_line + data).split(b'\n')
    self._err_line = lines.pop()
    for line in lines:
      self._err_complete(line + b'\n')

  def _err_complete(self, line: bytes) -> None:
    if self._held or _RUNTIME_LINE.match(line):
      if not self._held:
        self._held_since = time.monotonic()
      self._held.append(line)
    else:
      _write(sys.stderr, line)

  def _release_stale(self) -> None:
    """Held lines with no fatal error after them were only warnings."""
    if (self._held and time.monotonic() - self._held_since > _HOLD_SEC and
        _FATAL not in b''.join(self._held)):
      held, self._held = self._held, []
      _write(sys.stderr, b''.join(held))

  def pass_through(self) -> bytes:
    """Until the child's output ends; then what was held back."""
    while self._selector.get_map():
      for key, _ in self._selector.select(timeout=1.0):
        data = os.read(key.fd, 65536)
        if data:
          key.data(data)
        else:
          self._selector.unregister(key.fd)
          os.close(key.fd)
      self._release_stale()
    if self._err_line:
      self._err_complete(self._err_line)
    return b''.join(self._held)


def _step_text(step: Optional[int]) -> str:
  return f'after step {step}' if step else 'before its first step'


def supervised(workdir: str, heartbeat_sec: int, command: str) -> Reporter:
  """Forks. In the child (which trains) returns its `Reporter`; the parent
  waits for the child and exits (`sys.exit`) with the child's own status,
  or `EXIT_PROCESS_LOST` after the one line."""
  for stream in (sys.stdout, sys.stderr):
    stream.flush()
  out_r, out_w = os.pipe()
  err_r, err_w = os.pipe()
  status_r, status_w = os.pipe()
  parent = os.getpid()
  child = os.fork()
  if child == 0:
    os.setpgid(0, 0)
    _die_with_parent(parent)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for fd in (out_r, out_w, err_r, err_w, status_r):
      os.close(fd)
    return Reporter(status_w)
  for fd in (out_w, err_w, status_w):
    os.close(fd)
  previous = {s: signal.signal(s, lambda signum, _: os.kill(child, signum))
              for s in _FORWARDED}
  try:
    watched = _Parent(out_r, err_r, status_r)
    held = watched.pass_through()
    status = os.waitpid(child, 0)[1]  # Retried over signals (PEP 475).
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  sys.exit(_verdict(held, status, watched, workdir, heartbeat_sec, command))


def _verdict(held: bytes, status: int, watched: _Parent, workdir: str,
             heartbeat_sec: int, command: str) -> int:
  """The exit status, after the one line if the child was lost or killed;
  held lines that say neither go out as they are."""
  lost = lost_processes(held)
  killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
  if lost is None and not killed:
    _write(sys.stderr, held)
    if os.WIFSIGNALED(status):
      return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)
  process, of = watched.process, f' of {watched.num_processes}'
  this = f'process {process}' if process is not None else 'this process'
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  newest = newest_checkpoint(directory)
  resume = (f'the newest complete checkpoint is step {newest} in {directory}'
            if newest is not None else
            'there is no complete checkpoint yet (a restart starts at step 0)')
  restart = ('Restart: run the same command on every process again (here: '
             f'{command}).')
  stopped = _step_text(watched.last_step)
  if lost is None:
    line = (f'error: {this}{of if process is not None else ""} was killed '
            f'(SIGKILL) {stopped}; {resume}. The others end with a line '
            f'naming it within {heartbeat_sec}s (its missed heartbeats). '
            f'{restart}')
    code = 128 + signal.SIGKILL
  else:
    names = (f'process {lost[0]}{of} was' if len(lost) == 1 else
             f'processes {", ".join(map(str, lost))}{of} were' if lost else
             'a process of the run was')
    why = ('it cannot be reached: it ran the coordination service'
           if lost == [0] else f'no heartbeat for {heartbeat_sec}s')
    log = os.path.join(workdir, RUNTIME_LOG.format(
        process=process if process is not None else os.getpid()))
    try:
      with open(log, 'wb') as f:
        f.write(held)
      where = f" (the runtime's messages: {log})"
    except OSError:  # The workdir's disk: the line matters more.
      where = ''
    line = (f'error: {names} lost ({why}); {this} stopped {stopped}; '
            f'{resume}. {restart}{where}')
    code = EXIT_PROCESS_LOST
  _write(sys.stderr, (line + '\n').encode())
  return code
