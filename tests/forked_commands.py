"""Runs the tests' `python -m launch...` commands in processes forked from one
that has already imported their libraries.

A fresh interpreter spends over a second of CPU importing JAX, Haiku, optax
and orbax before a command reads its first flag; the suite starts about a
hundred commands (sixty for the bad-input table alone), and on two cores that
second is most of what such a test costs. Each command here is still a
process of its own: forked before JAX has created a backend (XLA reads
XLA_FLAGS, and so the device count, when it does), with its own argv,
environment, working directory, stdout and stderr, its module run as
`__main__` the way `python -m` runs it, leaving as the interpreter's
shutdown does up to freeing the modules (`launch.cli.leave`, as every
command ends). What the preloaded libraries read from the environment as
they were imported (JAX's JAX_* settings) is the launcher's: `helpers`
sends only commands whose environment differs from the launcher's in
variables read after the fork alone (XLA_FLAGS, say), and starts any other
afresh. Both start from the
test process's environment as `helpers` was imported, not as a library the
process imported since (TensorFlow) left it.

    python -m tests.forked_commands  # a JSON request per line on stdin (the
                                     # commands to run together), a JSON
                                     # reply per line on stdout
"""

import json
import os
import runpy
import select
import signal
import sys
import tempfile
import time
import traceback

# What every `launch` command imports, and matplotlib (through the plots),
# most of what a lab, benchmark or plot command imports besides; none of it
# defines a flag (the launch modules do, so each command imports its own).
import haiku_mp.lab.run_plots  # pylint: disable=unused-import
import haiku_mp.vit.train.experiment  # pylint: disable=unused-import
import haiku_mp.vit.train.loop  # pylint: disable=unused-import
import launch.cli

# The modules a request may run: the project's commands, and the test
# wrappers that only patch a class before they run a command (the train
# loop's, TFDS's cifar10 builder's URL); not those that hide a preloaded
# package or limit the process's files.
RUNNABLE_PREFIX = 'launch.'
RUNNABLE_WRAPPERS = ('tests.signal_at_step', 'tests.fake_cifar10')


def _run_as_main(module: str, args: list[str], env: dict[str, str], cwd: str,
                 stdout: str, stderr: str) -> None:
  """In the forked child: `python -m module *args`, then exit as it would."""
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  for fd, path in ((1, stdout), (2, stderr)):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
  os.environ.clear()
  os.environ.update(env)
  os.chdir(cwd)
  sys.argv = [module, *args]
  try:
    runpy.run_module(module, run_name='__main__', alter_sys=True)
  except SystemExit as e:
    launch.cli.leave(e.code)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()  # As the interpreter does, then status 1.
    launch.cli.leave(1)
  launch.cli.leave(0)


def _wait(pid: int, timeout: float) -> tuple[int, bool]:
  """The child's status as subprocess reports it, and whether it timed out
  (then it is killed)."""
  pidfd = os.pidfd_open(pid)
  try:
    ready, _, _ = select.select([pidfd], [], [], max(timeout, 0.0))
  finally:
    os.close(pidfd)
  if not ready:
    os.kill(pid, signal.SIGKILL)
  _, status = os.waitpid(pid, 0)
  return os.waitstatus_to_exitcode(status), not ready


def _temp_file(name: str) -> str:
  fd, path = tempfile.mkstemp(prefix=f'forked_{name}_')
  os.close(fd)
  return path


def _serve() -> None:
  """Each request is a list of commands that run at the same time (the
  processes of one multi-process run; usually one command); the reply, once
  all have ended, is the list of their results. A command still running
  when the request's `timeout` (seconds from its start) is up is killed."""
  for line in sys.stdin:
    request = json.loads(line)
    deadline = time.monotonic() + request['timeout']
    started = []
    for command in request['commands']:
      # Files the parent removes: the child leaves by `launch.cli.leave`,
      # without unwinding this function.
      out, err = _temp_file('stdout'), _temp_file('stderr')
      sys.stdout.flush()
      pid = os.fork()
      if pid == 0:
        _run_as_main(command['module'], command['args'], command['env'],
                     command['cwd'], out, err)
      started.append((pid, out, err))
    replies = []
    for pid, out, err in started:
      returncode, timed_out = _wait(pid, deadline - time.monotonic())
      reply = dict(returncode=returncode, timed_out=timed_out)
      for key, path in (('stdout', out), ('stderr', err)):
        with open(path, errors='replace') as f:
          reply[key] = f.read()
        os.remove(path)
      replies.append(reply)
    sys.stdout.write(json.dumps(replies) + '\n')
    sys.stdout.flush()


if __name__ == '__main__':
  _serve()
