"""Compiled train-step cost per parallel layout, as JSON lines.

XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m launch.benchmark \
    --config=configs/vit_fp32.py --layouts=pjit:8x1,pjit:4x2

Each layout compiles the reference train step on abstract inputs and prints
its compile time, XLA's memory analysis (bytes per device: arguments, outputs,
temporaries, generated code) and the params / optimizer-state bytes one device
holds. A final line compares every layout with the first as ratios.
"""

import copy
import json

from absl import app
from absl import flags
from ml_collections import config_flags

from haiku_mp import compiled_step
from haiku_mp.lab import compare
from haiku_mp import sharding
from launch import cli

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.',
                                          lock_config=True)
_LAYOUTS = flags.DEFINE_list(
    'layouts', ['pjit:8x1', 'pjit:4x2'],
    'STRATEGY:BATCHxMODEL layouts to compare (single needs no mesh: single:1x1).')

_RATIO_FIELDS = ('temp_size_in_bytes', 'argument_size_in_bytes',
                 'params_bytes', 'opt_state_bytes', 'compile_sec')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  results = []
  for layout in _LAYOUTS.value:
    strategy, shape = sharding.parse_layout(layout)
    config = copy.deepcopy(_CONFIG.value)
    config.parallel.strategy = strategy
    config.parallel.mesh_shape = shape
    result = dict(layout=layout, **compiled_step.compiled_step_stats(config))
    results.append(result)
    print(json.dumps(result), flush=True)
  compare.add_ratios(results, 'ratios', _RATIO_FIELDS,
                     is_base=lambda r: r is results[0])
  print(json.dumps(dict(ratios_vs=results[0]['layout'],
                        ratios={r['layout']: r['ratios'] for r in results[1:]})))


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  cli.run(main)
