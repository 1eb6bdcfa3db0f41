"""The precision lab: experiments that print JSON and write JSON + PNG to --out.

python -m launch.lab params --config=configs/vit_fp32.py --out=lab
python -m launch.lab matmul --out=lab [--rows=1024 --cols=65536 --repeats=5]

(More experiments of the precision lab are still to come: sweep, memory,
precision, profile.)
"""

import json
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from haiku_mp import errors
from haiku_mp import plots
from haiku_mp.lab import matmul
from haiku_mp.lab import params
from launch import cli

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/vit_fp32.py',
                                          'Config file.', lock_config=True)
_OUT = flags.DEFINE_string('out', 'lab', 'Directory for JSON and PNG files.')
_ROWS = flags.DEFINE_integer('rows', 1024, 'matmul: rows of A.')
_COLS = flags.DEFINE_integer('cols', 1024 * 64, 'matmul: columns of A.')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'matmul: timed repetitions.')

EXPERIMENTS = ('params', 'matmul')


def main(argv):
  if len(argv) != 2 or argv[1] not in EXPERIMENTS:
    raise errors.ConfigError(f'expected one experiment of {EXPERIMENTS}, got '
                             f'{argv[1:]}')
  experiment = argv[1]
  os.makedirs(_OUT.value, exist_ok=True)
  if experiment == 'params':
    result = params.run(_CONFIG.value)
    dtypes = list(result['totals'])
    plots.bar_chart(os.path.join(_OUT.value, 'params.png'), dtypes,
               [result['totals'][d]['megabytes'] for d in dtypes], 'MB',
               f'{result["totals"]["float32"]["count"]:,} parameters')
  else:
    result = matmul.run(_ROWS.value, _COLS.value, _REPEATS.value)
    plots.bar_chart(os.path.join(_OUT.value, 'matmul.png'),
               [r['dtype'] for r in result['results']],
               [r['gflops_per_sec'] for r in result['results']], 'GFLOP/s',
               f'A @ A.T, A {result["shape"]}, {result["device"]}')
  with open(os.path.join(_OUT.value, f'{experiment}.json'), 'w') as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == '__main__':
  cli.run(main)
