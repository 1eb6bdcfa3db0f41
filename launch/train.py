"""Trains the configured ViT on CIFAR-10 and evaluates it.

python -m launch.train --config=configs/vit_fp16.py --workdir=runs/fp16 \
    [--config.batch_size=256 ...]
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from haiku_mp import input_pipeline
from haiku_mp import loss_scaling
from haiku_mp import precision
from haiku_mp import trainer

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for metrics, '
                               'TensorBoard files and the summary.')

# Errors in what the user asked for: reported in one line, no traceback.
USER_ERRORS = (precision.PrecisionError, loss_scaling.LossScaleError,
               input_pipeline.DataError, ValueError)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  try:
    trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except USER_ERRORS as e:
    logging.error('%s', e)
    sys.exit(f'error: {e}')


if __name__ == '__main__':
  flags.mark_flags_as_required(['config', 'workdir'])
  app.run(main)
