"""Where a test run's JAX time goes: tracing, lowering and compiling, per test
class and per command, and the programs compiled (docs/testing.md).

    HAIKU_MP_TESTS_JAX_EVENTS=DIR python -m pytest -q -n 2 --dist loadscope tests
    python -m tests.jax_events DIR [--top=25]

With the variable set, every process that imports `tests` (the pytest
workers, the commands forked from their launcher, the test wrappers) appends
each of JAX's duration events to DIR/PID.jsonl as it happens: a forked
command leaves without unwinding, so nothing waits for an exit to be
written. A command started afresh (an environment the launcher lacks) does
not import `tests` and is not counted, nor is an event a process could not
write (a test that leaves it no room for files). The events' durations are
wall clock: on two busy cores a compile takes longer than alone.
"""

import collections
import json
import os
import sys
import time
from typing import Any, Callable, Iterator

import tests

ENV = tests.JAX_EVENTS_ENV
# The events counted, by the short name the summary gives them.
KINDS = {
    '/jax/core/compile/jaxpr_trace_duration': 'trace',
    '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
    '/jax/core/compile/backend_compile_duration': 'compile',
    '/jax/compilation_cache/cache_retrieval_time_sec': 'cache_read',
}
# JAX's persistent cache keeps programs that compile in this long or longer
# (set by tests/__init__.py): the summary counts them apart from the one-op
# ones.
CACHED_COMPILE_SEC = float(
    os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'])


def _scope() -> str:
  """The test class a worker is running, or the command this process is."""
  test = os.environ.get('PYTEST_CURRENT_TEST')
  if test:
    return '::'.join(test.split(' ')[0].split('::')[:2])
  # A forked command's argv[0] is its module's file (launch/train.py).
  program = '/'.join(sys.argv[0].split(os.sep)[-2:]) if sys.argv else ''
  return ' '.join([program, *sys.argv[1:2]])


def record(directory: str) -> Callable[[], None]:
  """Appends this process's (and its forks') JAX events under `directory`
  until the function returned is called."""
  import jax  # pylint: disable=g-import-not-at-top

  os.makedirs(directory, exist_ok=True)
  files = {}

  def listen(event: str, duration: float, **kwargs) -> None:
    if event not in KINDS:
      return
    pid = os.getpid()
    if pid not in files:  # A fork writes a file of its own.
      files[pid] = os.open(os.path.join(directory, f'{pid}.jsonl'),
                           os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    line = json.dumps(dict(kind=KINDS[event], seconds=duration,
                           program=kwargs.get('fun_name'), scope=_scope(),
                           time=time.time()))
    try:
      os.write(files[pid], (line + '\n').encode())
    except OSError:  # A test that leaves its process no room: the event is
      pass           # lost, the test's own write fails as it should.

  jax.monitoring.register_event_duration_secs_listener(listen)

  def stop() -> None:
    jax.monitoring.unregister_event_duration_listener(listen)
    for fd in files.values():
      os.close(fd)
    files.clear()

  return stop


def read(directory: str) -> Iterator[dict[str, Any]]:
  for name in sorted(os.listdir(directory)):
    if name.endswith('.jsonl'):
      with open(os.path.join(directory, name)) as f:
        for line in f:
          if line.endswith('\n'):  # A line cut short by a kill is left out.
            yield json.loads(line)


def summary(events) -> dict[str, Any]:
  """Seconds and counts per kind, per scope and per program compiled."""
  kinds = collections.defaultdict(lambda: [0, 0.0])
  scopes = collections.defaultdict(collections.Counter)
  programs = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    kind = e['kind']
    if kind == 'compile':
      kind = ('compile' if e['seconds'] >= CACHED_COMPILE_SEC
              else 'compile_small')
      programs[e['program']][0] += 1
      programs[e['program']][1] += e['seconds']
    kinds[kind][0] += 1
    kinds[kind][1] += e['seconds']
    scopes[e['scope']][kind] += e['seconds']
  return dict(
      kinds={k: dict(count=n, seconds=s) for k, (n, s) in kinds.items()},
      scopes={k: dict(v) for k, v in scopes.items()},
      programs={k: dict(count=n, seconds=s) for k, (n, s) in programs.items()})


def _table(result: dict[str, Any], top: int) -> Iterator[str]:
  yield '| events | count | seconds |'
  yield '|---|---|---|'
  for kind, v in sorted(result['kinds'].items()):
    yield f"| {kind} | {v['count']:,} | {v['seconds']:.1f} |"
  columns = ('trace', 'lower', 'compile', 'compile_small', 'cache_read')
  yield ''
  yield f"| test class or command | all | {' | '.join(columns)} |"
  yield '|---|' + '---|' * (len(columns) + 1)
  scopes = sorted(result['scopes'].items(), key=lambda kv: -sum(kv[1].values()))
  for scope, v in scopes[:top]:
    cells = ' | '.join(f'{v.get(c, 0):.1f}' for c in columns)
    yield f'| `{scope}` | {sum(v.values()):.1f} | {cells} |'
  yield ''
  yield '| program compiled | count | seconds |'
  yield '|---|---|---|'
  programs = sorted(result['programs'].items(), key=lambda kv: -kv[1]['seconds'])
  for program, v in programs[:top]:
    yield f"| `{program}` | {v['count']:,} | {v['seconds']:.1f} |"


def main(argv: list[str]) -> int:
  args = [a for a in argv if not a.startswith('--top=')]
  top = next((a[6:] for a in argv if a.startswith('--top=')), '25')
  if len(args) != 1 or not os.path.isdir(args[0]) or not top.isdigit():
    print('usage: python -m tests.jax_events DIR [--top=25] (DIR: the '
          f'{ENV} of a test run)', file=sys.stderr)
    return 2
  for line in _table(summary(read(args[0])), int(top)):
    print(line)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
