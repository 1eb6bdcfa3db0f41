"""CIFAR-10 as uint8 NumPy arrays in one `.npz` file.

`train_image` uint8[N, 32, 32, 3], `train_label` int[N], `test_image`,
`test_label`: the whole dataset (150 MB) in a form NumPy reads alone, for
hosts without TensorFlow (the GPU machines) and for keeping every example in
memory. `export_from_tfds` writes it from the prepared TFDS copy, in that
copy's order; `load` checks it and names what is wrong in one line.
"""

import os
from typing import Callable
import zipfile

import numpy as np

from haiku_mp import errors
from haiku_mp.vit.settings import DataSettings

SPLITS = ('train', 'test')
KEYS = ('train_image', 'train_label', 'test_image', 'test_label')
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


def check(arrays: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
  """`arrays` if they are CIFAR-10 as above, else a one-line DataError."""
  missing = [k for k in KEYS if k not in arrays]
  if missing:
    raise errors.DataError(f'{where} has no {", ".join(missing)} '
                           f'(expected the arrays {", ".join(KEYS)})')
  for split in SPLITS:
    images, labels = arrays[f'{split}_image'], arrays[f'{split}_label']
    if images.dtype != np.uint8 or images.shape[1:] != IMAGE_SHAPE:
      raise errors.DataError(
          f'{where}: {split}_image is {images.dtype}{list(images.shape)}, '
          f'expected uint8[N, {", ".join(map(str, IMAGE_SHAPE))}]')
    if labels.shape != images.shape[:1] or not np.issubdtype(labels.dtype,
                                                             np.integer):
      raise errors.DataError(
          f'{where}: {split}_label is {labels.dtype}{list(labels.shape)}, '
          f'expected integers, one per image ({len(images)})')
    if labels.size and not 0 <= labels.min() <= labels.max() < NUM_CLASSES:
      raise errors.DataError(f'{where}: {split}_label has values outside '
                             f'0..{NUM_CLASSES - 1}')
  return arrays


# How a .npz (a zip archive) begins: a file's local header, or an empty
# archive's end record.
_ZIP_MAGICS = (b'PK\x03\x04', b'PK\x05\x06')
_WRITE_ONE = 'write one with `python -m launch.data export`'


def _check_is_npz(path: str) -> None:
  """A one-line DataError unless `path` begins as a .npz does: np.load
  takes anything else for a pickle, and says so in words of its own."""
  with open(path, 'rb') as f:
    head = f.read(len(_ZIP_MAGICS[0]))
  if head not in _ZIP_MAGICS:
    raise errors.DataError(
        f'data.arrays_path={path} is not a .npz (a zip of NumPy arrays): it '
        f'begins with {head!r}; {_WRITE_ONE}')


def _read(path: str, keys=None) -> dict[str, np.ndarray]:
  """The arrays `keys` (all by default) of the `.npz` at `path`, or a
  one-line DataError naming `data.arrays_path`."""
  if not path:
    raise errors.DataError('data.arrays_path is empty; the arrays source reads '
                           f'a .npz: {_WRITE_ONE}')
  try:
    _check_is_npz(path)
  except OSError as e:
    raise errors.DataError(f'data.arrays_path={path} cannot be read as .npz '
                           f'({e})') from None
  try:
    with np.load(path, allow_pickle=False) as npz:
      return {k: npz[k] for k in npz.files if keys is None or k in keys}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    raise errors.DataError(f'data.arrays_path={path} cannot be read as .npz '
                           f'({reason}): it is cut short or damaged; '
                           f'{_WRITE_ONE}') from None


def load(path: str) -> dict[str, np.ndarray]:
  """The checked arrays of the `.npz` at `path` (`data.arrays_path`)."""
  return check(_read(path), f'data.arrays_path={path}')


def split_sizes(path: str) -> dict[str, int]:
  """Examples per split of the `.npz` at `path`, reading only its labels."""
  labels = _read(path, [f'{s}_label' for s in SPLITS])
  missing = [s for s in SPLITS if f'{s}_label' not in labels]
  if missing:
    raise errors.DataError(f'data.arrays_path={path} has no '
                           f'{", ".join(s + "_label" for s in missing)} '
                           f'(expected the arrays {", ".join(KEYS)})')
  return {s: len(labels[f'{s}_label']) for s in SPLITS}


def save(path: str, arrays: dict[str, np.ndarray]) -> None:
  """Writes checked `arrays` to `path` atomically (a reader never sees half
  a file; a failed export leaves what was there)."""
  check(arrays, path)
  tmp = f'{path}.tmp-{os.getpid()}.npz'
  try:
    np.savez(tmp, **{k: arrays[k] for k in KEYS})
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def export_from_tfds(data_config: DataSettings, path: str,
                     log: Callable[[str], None] = print) -> dict[str, int]:
  """The TFDS copy `data_config` names (`train` and `test`, in its order) as
  a `.npz` at `path`; the example count per split."""
  from haiku_mp.vit.data import tfds_source  # pylint: disable=g-import-not-at-top
  builder = tfds_source.builder(data_config)
  arrays = {}
  for split in SPLITS:
    images, labels = tfds_source.read_split(builder, split)
    arrays[f'{split}_image'] = images
    arrays[f'{split}_label'] = labels.astype(np.int32)
    log(f'{split}: {len(labels)} examples')
  save(path, arrays)
  return {split: len(arrays[f'{split}_label']) for split in SPLITS}
