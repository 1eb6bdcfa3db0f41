"""pytest: the test package's eight CPU devices before any module loads JAX,
and the long test classes scheduled first.

With two xdist workers (`-n 2 --dist loadscope`), a class of half a minute
that starts last keeps one core busy while the other has nothing left to do;
started first, the short classes fill in around it. A class says it is long
itself (`@helpers.long_running`); one that took long without saying so is
named at the end of the run, so none is missed silently. xdist would hand
out classes by their number of tests instead (its `--loadscope-reorder`, on
by default), which started the one-test classes of twenty seconds last: the
order here is kept.
"""

import collections

import tests  # pylint: disable=unused-import

# A class whose tests together take longer than this (cold, on the slower
# CPU kind, a Xeon) should be marked: the quick subset then stays under two
# minutes there.
LONG_CLASS_SEC = 10.0

_class_seconds = collections.Counter()


def _is_long(item) -> bool:
  return bool(getattr(item.cls, 'LONG_RUNNING', False))


_marked = set()


def pytest_configure(config):
  if hasattr(config.option, 'loadscopereorder'):  # xdist's; the items' order.
    config.option.loadscopereorder = False
  config.addinivalue_line(
      'markers', 'long_running: a class marked @helpers.long_running; '
      "`-m 'not long_running'` is the quick subset (docs/testing.md)")


def pytest_collection_modifyitems(items):
  items.sort(key=lambda item: not _is_long(item))  # Stable otherwise.
  for item in items:  # Reaches the reports, from every worker.
    item.user_properties.append(('long_running', _is_long(item)))
    if _is_long(item):
      item.add_marker('long_running')


def pytest_runtest_logreport(report):
  """Sums each class's time (every phase, setUpClass included) as the
  reports arrive, from every worker."""
  scope = report.nodeid.rsplit('::', 1)[0]
  if '::' in scope:
    _class_seconds[scope] += report.duration
    if ('long_running', True) in report.user_properties:
      _marked.add(scope)


def pytest_terminal_summary(terminalreporter):
  unmarked = [(seconds, scope) for scope, seconds in _class_seconds.items()
              if seconds > LONG_CLASS_SEC and scope not in _marked]
  for seconds, scope in sorted(unmarked, reverse=True):
    terminalreporter.write_line(
        f'{scope} took {seconds:.0f}s: mark it @helpers.long_running so that '
        'it starts first')
