"""A CIFAR-10 download server on 127.0.0.1, for tests of the real download path.

`archive()` makes a `cifar-10-binary.tar.gz` in CIFAR-10's binary format (one
label byte and 3,072 pixel bytes per image, channel-major) from random images;
`serve()` serves it. Run as a module, `python -m tests.fake_cifar10
launch.train ...` is that command with TFDS's cifar10 builder pointed at
`$FAKE_CIFAR10_URL`. Only the URL changes: the download, extraction and
preparation are TFDS's own.
`$BLOCK_MODULES` (comma-separated) makes those modules unimportable, as if not
installed.
"""

import contextlib
import http.server
import io
import os
import runpy
import socket
import subprocess
import sys
import tarfile
import threading
from typing import Iterator

import numpy as np

from tests import helpers

URL_ENV = 'FAKE_CIFAR10_URL'
BLOCK_ENV = 'BLOCK_MODULES'
LABELS = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog',
          'horse', 'ship', 'truck')
PREFIX = 'cifar-10-batches-bin/'
TRAIN_FLAGS = (
    '--config.num_train_steps=3', '--config.log_every_steps=1',
    '--config.eval_every_steps=3', '--config.batch_size=16',
    '--config.eval_batch_size=50', '--config.model.num_layers=1',
    '--config.model.embed_dim=16', '--config.model.mlp_dim=16',
    '--config.model.num_heads=2',
    # archive() has 250 training images: 200 train, 50 val.
    '--config.data.train_split=train[:200]',
    '--config.data.val_split=train[200:]')


def _records(rng: np.random.Generator, count: int) -> bytes:
  labels = rng.integers(0, len(LABELS), (count, 1), dtype=np.uint8)
  pixels = rng.integers(0, 256, (count, 3 * 32 * 32), dtype=np.uint8)
  return np.concatenate([labels, pixels], axis=1).tobytes()


def archive(train_per_file: int = 50, num_test: int = 50, seed: int = 0
            ) -> bytes:
  """The tar.gz: five training files, one test file and the label names."""
  rng = np.random.default_rng(seed)
  files = {f'data_batch_{i}.bin': _records(rng, train_per_file)
           for i in range(1, 6)}
  files['test_batch.bin'] = _records(rng, num_test)
  files['batches.meta.txt'] = ('\n'.join(LABELS) + '\n').encode()
  out = io.BytesIO()
  with tarfile.open(fileobj=out, mode='w:gz') as tar:
    for name, data in files.items():
      info = tarfile.TarInfo(PREFIX + name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return out.getvalue()


@contextlib.contextmanager
def serve(data: bytes) -> Iterator[tuple[str, list[str]]]:
  """(URL, requested paths) of a server that answers every GET with `data`."""
  requests = []

  class Handler(http.server.BaseHTTPRequestHandler):

    def do_HEAD(self):  # pylint: disable=invalid-name
      requests.append(f'HEAD {self.path}')
      self.send_response(200)
      self.send_header('Content-Length', str(len(data)))
      self.end_headers()

    def do_GET(self):  # pylint: disable=invalid-name
      requests.append(f'GET {self.path}')
      self.send_response(200)
      self.send_header('Content-Length', str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def log_message(self, *args):
      del args

  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield (f'http://127.0.0.1:{server.server_address[1]}/'
           'cifar-10-binary.tar.gz', requests)
  finally:
    server.shutdown()
    server.server_close()
    thread.join()


def run(url: str, module: str, *args: str, block: str = '',
        env=None) -> subprocess.CompletedProcess:
  """`python -m module *args` (`helpers.run_module`, one device) with TFDS's
  cifar10 builder downloading `url`; `block`: modules it cannot import."""
  env = dict(env or {}, **{URL_ENV: url})
  if block:  # Not in a process that has them imported: a fresh one.
    env[BLOCK_ENV] = block
  return helpers.run_module('tests.fake_cifar10', module, *args, devices=1,
                            env=env, timeout=600)


def train(url: str, workdir: str, *flags: str, block: str = ''
          ) -> subprocess.CompletedProcess:
  """`launch.train` (tiny model, 3 steps) on the CIFAR-10 served at `url`."""
  return run(url, 'launch.train', '--config=configs/vit_fp16.py',
             f'--workdir={workdir}', *TRAIN_FLAGS, *flags, block=block)


@contextlib.contextmanager
def refusing_url() -> Iterator[str]:
  """A URL on 127.0.0.1 whose port refuses connections while in use: bound,
  never listening, so no other process can take the port meanwhile."""
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    yield f'http://127.0.0.1:{sock.getsockname()[1]}/cifar-10-binary.tar.gz'


def _point_cifar10_at(url: str) -> None:
  """TFDS's cifar10 builder downloads `url`."""
  from tensorflow_datasets.image_classification import cifar  # pylint: disable=g-import-not-at-top
  info = cifar.Cifar10._cifar_info.fget  # pylint: disable=protected-access
  cifar.Cifar10._cifar_info = property(  # pylint: disable=protected-access
      lambda self: info(self)._replace(url=url))


if __name__ == '__main__':
  for blocked in filter(None, os.environ.get(BLOCK_ENV, '').split(',')):
    sys.modules[blocked] = None  # `import blocked` now raises ImportError.
  _point_cifar10_at(os.environ[URL_ENV])
  sys.argv = sys.argv[1:]
  runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
