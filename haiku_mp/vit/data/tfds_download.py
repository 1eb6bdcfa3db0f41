"""A TFDS download and preparation: stopped at the first connection that
cannot be made, what TFDS prints held until a server answers, the data dir
as it was if it fails, and why it failed in one line.
"""

import contextlib
import logging as python_logging
import os
import shutil
import sys
import threading
from typing import Callable, Iterator, Optional

from absl import logging

from haiku_mp import errors

DataError = errors.DataError


def one_line(e: BaseException) -> str:
  """An exception as one line: its type and message, whitespace joined."""
  return ' '.join(f'{type(e).__name__}: {e}'.split())


def _causes(e: BaseException) -> Iterator[BaseException]:
  while e is not None:
    yield e
    e = e.__cause__ or e.__context__


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


def _download_error(e: Exception, name: str, where: str, why: str
                    ) -> DataError:
  """The cause of a failed download-and-prepare, in one line, after `why`
  the download was tried."""
  for cause in _causes(e):
    if isinstance(cause, _Unreachable):
      return DataError(
          f'{why}, and the download of {name} failed: cannot reach '
          f'{cause.url} ({one_line(cause.error)[:200]}). No network? Point '
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
          f'({one_line(cause)[:200]}). No network? Point '
          '--config.data.data_dir at a prepared copy and set '
          '--config.data.download=false')
  return DataError(f'{why}, and {name} could not be downloaded and prepared '
                   f'into {where} ({one_line(e)[:300]})')


def download_and_prepare(dataset, name: str, where: str, why: str) -> None:
  """`dataset.download_and_prepare()` of the TFDS builder of `name` (its
  data dir: `where`), with the progress bars held until a server answers and
  the data dir as it was if it fails; a failure is one `DataError` that says
  `why` the download was tried, then why it failed."""
  leftovers = _Leftovers(os.fspath(dataset.data_dir_root), name)
  try:
    try:
      with _progress_held_until_answered() as release:
        dataset.download_and_prepare()
        release()
    except BaseException:  # Ctrl-C too: TFDS cannot resume a download.
      leftovers.remove()
      raise
  except Exception as e:  # pylint: disable=broad-except
    raise _download_error(e, name, where, why) from None
