"""Prints every module of the configured model: policy, params, dtypes, the
training state's layout and bytes per parameter, and with
`precision.low_bit.modules=auto` each Linear's choice and why.

python -m launch.tabulate --config=configs/vit_fp16.py [--json]
"""

import json

from absl import app
from absl import flags
from ml_collections import config_flags

from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import overview
from launch import cli

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.',
                                          lock_config=True)
_JSON = flags.DEFINE_bool('json', False, 'Print one JSON list of objects.')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  exp = experiment.build_without_data(settings_lib.parse(_CONFIG.value))
  rows = overview.module_rows(exp)
  if _JSON.value:
    print(json.dumps(rows, indent=1))
  else:
    print(overview.format_table(rows))
    print(overview.state_line(exp))
    for line in exp.low_bit_lines():
      print(line)


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  cli.run(main)
