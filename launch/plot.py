"""Plots runs side by side from their metrics.jsonl.

python -m launch.plot --workdirs=runs/fp32,runs/bf16,runs/fp16 --out=loss.png
"""

import os
import sys

from absl import app
from absl import flags

from haiku_mp import plots

_WORKDIRS = flags.DEFINE_list('workdirs', None, 'Run directories to compare.')
_OUT = flags.DEFINE_string('out', 'runs.png', 'Where to write the PNG.')
_TITLE = flags.DEFINE_string('title', '', 'Figure title.')


def main(argv):
  del argv
  runs = {}
  for workdir in _WORKDIRS.value:
    try:
      runs[os.path.basename(os.path.normpath(workdir))] = plots.read_metrics(
          workdir)
    except OSError as e:
      sys.exit(f'error: --workdirs: cannot read {workdir}/metrics.jsonl ({e})')
  plots.plot_runs(runs, _OUT.value, _TITLE.value)
  print(_OUT.value)


if __name__ == '__main__':
  flags.mark_flag_as_required('workdirs')
  app.run(main)
