"""A TFDS dataset ready to read: TensorFlow imported quietly, the data prepared
or downloaded (tfds_download.py), and every way that can fail told apart in
one line.

Kept apart from the batches (pipeline.py): this is where a run meets the
network, the disk and the installed packages.
"""

import logging as python_logging
import os
import re
import sys
import tempfile
from typing import Optional

from absl import logging
import numpy as np

from haiku_mp import errors
from haiku_mp.vit.data import tfds_download
from haiku_mp.vit.settings import DataSettings

DataError = errors.DataError


# A line of absl's C++ log format: level letter, then MMDD.
_CPP_LOG_LINE = re.compile(r'^([IWEF])\d{4} ')
_CPP_PRE_INIT = 'WARNING: All log messages before absl::InitializeLog()'


def _import_tensorflow() -> None:
  """Imports TensorFlow with its C++ start-up notices sent to logging.

  TensorFlow 2.21 prints "oneDNN custom operations are on" (twice) from C++
  before its logging is set up, whatever TF_CPP_MIN_LOG_LEVEL says. Its stderr
  during the import is captured: INFO records are logged at DEBUG level
  (`--verbosity=1` shows them), anything else as a warning.
  """
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as capture:
    os.dup2(capture.fileno(), 2)
    try:
      import tensorflow  # pylint: disable=g-import-not-at-top,unused-import
    finally:
      os.dup2(saved, 2)
      os.close(saved)
    capture.seek(0)
    lines = capture.read().decode(errors='replace').splitlines()
  level = logging.DEBUG
  for line in lines:
    match = _CPP_LOG_LINE.match(line)
    if match:  # A new record; lines without a prefix continue the last one.
      level = logging.DEBUG if match.group(1) == 'I' else logging.WARNING
    elif line.startswith(_CPP_PRE_INIT):
      level = logging.DEBUG
    if line.strip():
      logging.log(level, 'TensorFlow: %s', line)


def tensorflow():
  """TensorFlow, imported quietly once, with accelerators left to JAX."""
  if 'tensorflow' not in sys.modules:
    _import_tensorflow()
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.config.set_visible_devices([], 'GPU')  # Leave accelerators to JAX.
  return tf


def _check_not_foreign(data_dir: str, name: str) -> None:
  """A data dir without the dataset that holds other files (a raw CIFAR-10
  folder, say) is not a TFDS data dir: preparing the data there would mix it
  into someone else's files, and the setting is more likely a mistake."""
  entries = os.listdir(data_dir)
  files = sorted(e for e in entries
                 if os.path.isfile(os.path.join(data_dir, e)))
  if files and not {name, 'downloads'} & set(entries):
    raise DataError(
        f'data.data_dir={data_dir} holds files ({", ".join(files[:3])}'
        f'{", ..." if len(files) > 3 else ""}) and no TFDS {name}: not a TFDS '
        f'data dir. Point it at one that holds {name}/<version>/, or at an '
        'empty or new directory to download into')


class _NoEmptyVariantWarning(python_logging.Filter):
  """Drops TFDS's "Variant folder ... has no dataset_info.json": it comes
  before the one-line error about the same data dir, and asks nothing of the
  user that the error does not."""

  def filter(self, record: python_logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Variant folder %s has no ')


def _why_downloaded(data_dir: Optional[str], name: str, where: str) -> str:
  """What sent `name` to the download: the data dir given, as it was before
  the attempt (which may create it), and what it lacked."""
  if not data_dir:
    return f'data.data_dir is empty: {name} is not prepared in {where}'
  if not os.path.lexists(data_dir):
    return f'data.data_dir={data_dir} does not exist'
  return f'data.data_dir={data_dir} holds no prepared {name}'


def _not_prepared(name: str, where: str) -> DataError:
  return DataError(
      f'data.data_dir: {name} is not prepared in {where}, and data.download '
      'is False. Point --config.data.data_dir at a prepared copy, or allow '
      'the download.')


def _check_without_tensorflow(data_dir: str, name: str, download: bool,
                              where: str) -> None:
  """What a data dir's listing alone shows wrong, found in a moment rather
  than after TensorFlow's import (seconds): a file, a folder of something
  else, or no `name` in it and no download allowed."""
  if os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise DataError(f'data.data_dir={data_dir} is a file, not a directory')
  if os.path.isdir(data_dir) and name in os.listdir(data_dir):
    return  # Prepared or not, TFDS tells.
  if os.path.isdir(data_dir):
    _check_not_foreign(data_dir, name)
  if not download:
    raise _not_prepared(name, where)


def builder(data_config: DataSettings):
  """The TFDS builder of `data_config.name`, prepared (downloaded if allowed).

  Every way this can fail is a one-line `DataError` naming the setting.
  """
  name = data_config.name
  data_dir = data_config.data_dir or None
  where = data_dir or 'the TFDS default data dir (TFDS_DATA_DIR)'
  if data_dir:
    _check_without_tensorflow(data_dir, name, data_config.download, where)
  tensorflow()  # Before TFDS imports it.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  absl_log = python_logging.getLogger('absl')  # TFDS logs through absl.
  quiet = _NoEmptyVariantWarning()
  absl_log.addFilter(quiet)
  try:
    dataset = tfds.builder(name, data_dir=data_dir)
    prepared = dataset.is_prepared()
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'data.data_dir: {name} in {where} cannot be read '
                    f'({tfds_download.one_line(e)[:300]})') from None
  finally:
    absl_log.removeFilter(quiet)
  if prepared:
    return dataset
  if not data_config.download:
    raise _not_prepared(name, where)
  why = _why_downloaded(data_dir, name, where)  # Before it makes the dir.
  tfds_download.download_and_prepare(dataset, name, where, why)
  return dataset


# Examples read at a time: `batch_size=-1` (the whole split in one batch)
# crashes TensorFlow under `tfds.testing.mock_data` (std::length_error).
_READ_BATCH = 5000


def read_split(dataset, split: str) -> tuple[np.ndarray, np.ndarray]:
  """(uint8 images, labels) of `split` of a prepared builder, in its order."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  batches = list(tfds.as_numpy(dataset.as_dataset(
      split=split, shuffle_files=False).batch(_READ_BATCH)))
  if not batches:
    raise ValueError(f'split {split!r} has no example')
  return (np.concatenate([b['image'] for b in batches]),
          np.concatenate([b['label'] for b in batches]))
