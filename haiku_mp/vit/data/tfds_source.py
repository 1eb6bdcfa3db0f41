"""A TFDS dataset ready to read: TensorFlow imported quietly, the data prepared
or downloaded, and every way that can fail told apart in one line.

Kept apart from the batches (pipeline.py): this is where a run meets the
network, the disk and the installed packages.
"""

import contextlib
import logging as python_logging
import os
import re
import shutil
import sys
import tempfile
import threading
from typing import Callable, Iterator, Optional

from absl import logging
import numpy as np

from haiku_mp import errors
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


# urllib3's DEBUG record of a server's answer; its last two arguments are the
# status and the length. Only DEBUG: the record is made only while the logger
# is enabled for DEBUG.
_URLLIB3_ANSWER = '%s://%s:%s "%s %s %s" %s %s'


class _HeldConsole:
  """stdout or stderr, held back until a download server answers.

  TFDS prints "Downloading and preparing dataset ..." (stdout) and draws its
  progress bars (tqdm, stderr) as the download starts: with no network, some
  twenty lines came before the one-line error. Held here, they reach the
  console from the first answer on (then they are the download's progress), or
  when the download and preparation succeed without one (the archive was
  already downloaded); they are dropped if it fails before any answer.
  """

  def __init__(self, stream):
    self._stream = stream
    self._held = []
    self._lock = threading.Lock()
    self._passing = False

  def write(self, text: str) -> int:
    with self._lock:
      if self._passing:
        return self._stream.write(text)
      self._held.append(text)
      return len(text)

  def flush(self) -> None:
    with self._lock:
      if self._passing:
        self._stream.flush()

  def release(self) -> None:
    """What was held, then everything as it comes."""
    with self._lock:
      if not self._passing:
        self._passing = True
        self._stream.write(''.join(self._held))
        self._held.clear()
        self._stream.flush()

  def __getattr__(self, name):  # isatty, fileno, encoding: the console's.
    return getattr(self._stream, name)


class _ReleaseOnAnswer(python_logging.Filter):
  """Releases the held consoles at a server's first 2xx answer.

  Makes the DEBUG record of an answer (the logger is set to DEBUG for the
  download) and lets through only what the logger showed before.
  """

  def __init__(self, release: Callable[[], None], shown_level: int):
    super().__init__()
    self._release = release
    self._shown_level = shown_level

  def filter(self, record: python_logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    if (record.msg == _URLLIB3_ANSWER and len(args) == 8 and
        isinstance(args[6], int) and 200 <= args[6] < 300):
      self._release()
    return record.levelno >= self._shown_level


@contextlib.contextmanager
def _progress_held_until_answered() -> Iterator[Callable[[], None]]:
  """The fail-fast above, and what TFDS prints held until a server answers
  (`_HeldConsole`); yields what releases it."""
  out, err = _HeldConsole(sys.stdout), _HeldConsole(sys.stderr)

  def release():
    out.release()
    err.release()

  urllib3_log = python_logging.getLogger('urllib3.connectionpool')
  level = urllib3_log.level
  filters = (_FailFastWhenUnreachable(),
             _ReleaseOnAnswer(release, urllib3_log.getEffectiveLevel()))
  for f in filters:
    urllib3_log.addFilter(f)
  urllib3_log.setLevel(python_logging.DEBUG)
  try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      yield release
  finally:
    urllib3_log.setLevel(level)
    for f in filters:
      urllib3_log.removeFilter(f)


def _highest_missing(path: str) -> Optional[str]:
  """The highest of `path` and its parents that does not exist; None if
  `path` exists."""
  path = os.path.abspath(path)
  missing = None
  while not os.path.lexists(path):
    missing, parent = path, os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return missing


def _remove(path: str) -> None:
  try:
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    else:
      os.unlink(path)
  except OSError as e:
    logging.warning('Could not remove %s, left by the failed download: %s',
                    path, e)


class _Leftovers:
  """What a download and preparation adds to a data dir, taken back if it
  fails: the folders it created (the data dir itself, `NAME/`, `downloads/`
  ...), and what it added to those that existed (TFDS's `*.tmp.*` download
  folders, a finished archive, an extraction). Nothing that was there before
  is touched, nor any other entry of the data dir itself (another dataset
  being prepared there, say)."""

  def __init__(self, root: str, name: str):
    downloads = os.path.join(root, 'downloads')
    self._root = root
    self._missing = _highest_missing(root)
    # Parents before children.
    self._dirs = (root, os.path.join(root, name), downloads,
                  os.path.join(downloads, name),
                  os.path.join(downloads, 'extracted'),
                  os.path.join(downloads, 'manual'))
    self._before = {d: set(os.listdir(d)) if os.path.isdir(d) else None
                    for d in self._dirs}

  def remove(self) -> None:
    if self._missing:
      if os.path.lexists(self._missing):
        _remove(self._missing)
      return
    for d in reversed(self._dirs):  # Children before parents.
      if not os.path.isdir(d) or os.path.islink(d):
        continue
      before = self._before[d]
      if before is None:
        _remove(d)
      elif d != self._root:
        for entry in sorted(set(os.listdir(d)) - before):
          _remove(os.path.join(d, entry))


def _download_and_prepare(dataset, name: str) -> None:
  """`dataset.download_and_prepare()`, with the progress bars held until a
  server answers and the data dir as it was if it fails."""
  leftovers = _Leftovers(os.fspath(dataset.data_dir_root), name)
  try:
    with _progress_held_until_answered() as release:
      dataset.download_and_prepare()
      release()
  except BaseException:  # Ctrl-C too: TFDS cannot resume a download.
    leftovers.remove()
    raise


def _why_downloaded(data_dir: Optional[str], name: str, where: str) -> str:
  """What sent `name` to the download: the data dir given, as it was before
  the attempt (which may create it), and what it lacked."""
  if not data_dir:
    return f'data.data_dir is empty: {name} is not prepared in {where}'
  if not os.path.lexists(data_dir):
    return f'data.data_dir={data_dir} does not exist'
  return f'data.data_dir={data_dir} holds no prepared {name}'


def _download_error(e: Exception, name: str, where: str, why: str
                    ) -> DataError:
  """The cause of a failed download-and-prepare, in one line, after `why`
  the download was tried."""
  for cause in _causes(e):
    if isinstance(cause, _Unreachable):
      return DataError(
          f'{why}, and the download of {name} failed: cannot reach '
          f'{cause.url} ({_one_line(cause.error)[:200]}). No network? Point '
          '--config.data.data_dir at a prepared copy and set '
          '--config.data.download=false')
    if isinstance(cause, ModuleNotFoundError):
      return DataError(
          f'{why}, and preparing {name} needs the Python module '
          f'{cause.name!r}, which is not installed; run `pip install -r '
          'requirements.txt` (or point --config.data.data_dir at a prepared '
          'copy)')
    if type(cause).__name__ in ('ConnectionError', 'Timeout', 'ReadTimeout',
                                'ConnectTimeout', 'DownloadError'):
      return DataError(
          f'{why}, and the download of {name} failed '
          f'({_one_line(cause)[:200]}). No network? Point '
          '--config.data.data_dir at a prepared copy and set '
          '--config.data.download=false')
  return DataError(f'{why}, and {name} could not be downloaded and prepared '
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
                    f'({_one_line(e)[:300]})') from None
  finally:
    absl_log.removeFilter(quiet)
  if prepared:
    return dataset
  if not data_config.download:
    raise _not_prepared(name, where)
  why = _why_downloaded(data_dir, name, where)  # Before it makes the dir.
  try:
    _download_and_prepare(dataset, name)
  except Exception as e:  # pylint: disable=broad-except
    raise _download_error(e, name, where, why) from None
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
