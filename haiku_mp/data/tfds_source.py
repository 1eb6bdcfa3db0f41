"""A TFDS dataset ready to read: TensorFlow imported quietly, the data prepared
or downloaded, and every way that can fail told apart in one line.

Kept apart from the batches (pipeline.py): this is where a run meets the
network, the disk and the installed packages.
"""

import logging as python_logging
import os
import re
import sys
import tempfile
from typing import Iterator

from absl import logging
import ml_collections
import numpy as np

from haiku_mp import errors

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


def _one_line(e: BaseException) -> str:
  return ' '.join(f'{type(e).__name__}: {e}'.split())


def _causes(e: BaseException) -> Iterator[BaseException]:
  while e is not None:
    yield e
    e = e.__cause__ or e.__context__


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


class _Unreachable(Exception):
  """A download server refused or never answered the connection."""

  def __init__(self, url: str, error: Exception):
    super().__init__(url)
    self.url = url
    self.error = error


class _FailFastWhenUnreachable(python_logging.Filter):
  """Stops a download at the first connection that cannot be made.

  TFDS gives urllib3 ten retries with backoff: with no network a run would wait
  over three minutes before failing. urllib3 logs each retry with the error
  that caused it; raised from this filter, the error ends the download at once
  (a connection broken mid-download is still retried).
  """

  def filter(self, record: python_logging.LogRecord) -> bool:
    from urllib3 import exceptions  # pylint: disable=g-import-not-at-top
    args = record.args if isinstance(record.args, tuple) else ()
    if len(args) == 3 and isinstance(args[1], exceptions.ConnectTimeoutError):
      conn = getattr(args[1], 'conn', None)
      url = str(args[2])
      if conn is not None:
        scheme = 'https' if 'HTTPS' in type(conn).__name__ else 'http'
        port = '' if conn.port in (None, 80, 443) else f':{conn.port}'
        url = f'{scheme}://{conn.host}{port}{url}'
      raise _Unreachable(url, args[1])
    return True


class _NoEmptyVariantWarning(python_logging.Filter):
  """Drops TFDS's "Variant folder ... has no dataset_info.json": it comes
  before the one-line error about the same data dir, and asks nothing of the
  user that the error does not."""

  def filter(self, record: python_logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Variant folder %s has no ')


def _download_error(e: Exception, name: str, where: str) -> DataError:
  """The cause of a failed download-and-prepare, in one line."""
  for cause in _causes(e):
    if isinstance(cause, _Unreachable):
      return DataError(
          f'data.data_dir: cannot reach {cause.url} to download {name} '
          f'({_one_line(cause.error)[:200]}). No network? Point '
          '--config.data.data_dir at a prepared copy and set '
          '--config.data.download=false')
    if isinstance(cause, ModuleNotFoundError):
      return DataError(
          f'data.data_dir: preparing {name} needs the Python module '
          f'{cause.name!r}, which is not installed; run `pip install -r '
          'requirements.txt` (or point --config.data.data_dir at a prepared '
          'copy)')
    if type(cause).__name__ in ('ConnectionError', 'Timeout', 'ReadTimeout',
                                'ConnectTimeout', 'DownloadError'):
      return DataError(
          f'data.data_dir: the download of {name} failed '
          f'({_one_line(cause)[:200]}). No network? Point '
          '--config.data.data_dir at a prepared copy and set '
          '--config.data.download=false')
  return DataError(f'data.data_dir: could not download and prepare {name} '
                   f'into {where} ({_one_line(e)[:300]})')


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


def builder(data_config: ml_collections.ConfigDict):
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
                    f'({_one_line(e)[:300]})') from None
  finally:
    absl_log.removeFilter(quiet)
  if prepared:
    return dataset
  if not data_config.download:
    raise _not_prepared(name, where)
  urllib3_log = python_logging.getLogger('urllib3.connectionpool')
  fail_fast = _FailFastWhenUnreachable()
  urllib3_log.addFilter(fail_fast)
  try:
    dataset.download_and_prepare()
  except Exception as e:  # pylint: disable=broad-except
    raise _download_error(e, name, where) from None
  finally:
    urllib3_log.removeFilter(fail_fast)
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
