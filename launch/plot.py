"""Plots runs side by side from their metrics.jsonl.

python -m launch.plot --workdirs=runs/fp32,runs/bf16,runs/fp16 --out=loss.png
"""

import os

from absl import app
from absl import flags

from haiku_mp import errors
from haiku_mp.lab import run_plots
from launch import cli

_WORKDIRS = flags.DEFINE_list('workdirs', None, 'Run directories to compare.')
_OUT = flags.DEFINE_string('out', 'runs.png', 'Where to write the PNG.')
_TITLE = flags.DEFINE_string('title', '', 'Figure title.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  out_dir = os.path.dirname(os.path.abspath(_OUT.value))
  if not os.path.isdir(out_dir):
    raise errors.ConfigError(f'--out={_OUT.value}: {out_dir} is not a '
                             'directory')
  runs = {}
  for workdir in _WORKDIRS.value:
    try:
      runs[os.path.basename(os.path.normpath(workdir))] = run_plots.read_metrics(
          workdir)
    except OSError as e:
      raise errors.ConfigError(f'--workdirs: cannot read {workdir}/'
                               f'metrics.jsonl ({e.strerror})') from None
  run_plots.plot_runs(runs, _OUT.value, _TITLE.value)
  print(_OUT.value)


if __name__ == '__main__':
  flags.mark_flag_as_required('workdirs')
  cli.run(main)
