"""pytest: the test package's eight CPU devices before any module loads JAX,
and the longest suites scheduled first.

With two xdist workers (`-n 2 --dist loadscope`), a suite of a minute that
starts last keeps one core busy while the other has nothing left to do;
started first, the short suites fill in around it.
"""

import tests  # pylint: disable=unused-import

LONGEST_FIRST = (
    'tests/parallel_test.py::MultiProcessTest',
    'tests/checkpoint_test.py::InterruptTest',
    'tests/report_test.py::QuickReportTest',
    'tests/lab_test.py::PrecisionExperimentTest',
    'tests/parallel_test.py::StrategiesAgreeTest',
    'tests/lab_test.py::SweepTest',
    'tests/lab_test.py::CommandLineTest',
    'tests/dp_sgd_test.py::StrategiesTest',
)


def pytest_collection_modifyitems(items):
  def rank(item):
    return next((i for i, prefix in enumerate(LONGEST_FIRST)
                 if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))
  items.sort(key=rank)  # Stable: the rest keep their order.
