"""Data commands.

python -m launch.data export --out=cifar10.npz [--config=configs/base.py] \
  [--config.data.data_dir=DIR]

`export` writes the prepared TFDS CIFAR-10 (train and test, in the TFDS copy's
order) as uint8 arrays in one `.npz` (haiku_mp/vit/data/npz_source.py), which NumPy
reads without TensorFlow. Where the data dir lacks it and `data.download`
allows, TFDS downloads and prepares it first (its progress shown once the
server answers); a download that fails is one `error:` line and leaves the data
dir as it was (haiku_mp/vit/data/tfds_download.py).
"""

import os

from absl import app
from absl import flags
from ml_collections import config_flags

from haiku_mp import errors
from haiku_mp.vit import settings
from haiku_mp.vit.data import npz_source
from launch import cli

_CONFIG = config_flags.DEFINE_config_file(
    'config', os.path.join(os.path.dirname(os.path.dirname(__file__)),
                           'configs', 'base.py'),
    'Config file: its data settings say which TFDS copy to read.',
    lock_config=True)
_OUT = flags.DEFINE_string('out', None, 'The .npz to write.')

COMMANDS = ('export',)


def main(argv):
  if len(argv) != 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f'expected one command of {COMMANDS}; got {argv[1:]}')
  out = _OUT.value
  if not out:
    raise errors.ConfigError('--out is required: the .npz to write')
  directory = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(directory):
    raise errors.ConfigError(f'--out={out}: {directory} is not a directory')
  counts = npz_source.export_from_tfds(settings.parse(_CONFIG.value).data,
                                      out)
  print(f'wrote {out}: {counts["train"]} train, {counts["test"]} test images')


if __name__ == '__main__':
  cli.run(main)
