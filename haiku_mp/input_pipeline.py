"""CIFAR-10 batches: TFDS (with augmentation) or synthetic (no TensorFlow).

Training batches are deterministic functions of (seed, step): the epoch order
comes from a seeded shuffle and each example's augmentation from stateless
random ops seeded by its position in the stream, so a run restarted at step N
sees exactly the batches an uninterrupted run would. Evaluation covers every
example of a split exactly once: the last batch is padded and its padding has
`mask == 0`. Each process reads only its own shard of every split.

TensorFlow is imported only by the TFDS source.
"""

import dataclasses
import math
import os
import re
import sys
import tempfile
from typing import Iterator, Optional

from absl import logging
import jax
import ml_collections
import numpy as np

from haiku_mp import errors

Batch = dict[str, np.ndarray]


class DataError(errors.ConfigError):
  """Missing or unusable data; names the setting to change."""


@dataclasses.dataclass(frozen=True)
class Shard:
  """Which part of every split this process reads."""
  index: int = 0
  count: int = 1

  @classmethod
  def current(cls) -> 'Shard':
    return cls(jax.process_index(), jax.process_count())


def local_batch_size(global_batch_size: int, shard: Shard) -> int:
  if global_batch_size <= 0:
    raise DataError(f'batch_size={global_batch_size} must be positive')
  if global_batch_size % shard.count:
    raise DataError(f'batch_size={global_batch_size} is not divisible by the '
                    f'number of processes ({shard.count})')
  return global_batch_size // shard.count


def pad_batch(batch: Batch, batch_size: int) -> Batch:
  """Pads the leading axis to `batch_size` and adds `mask` (1 real, 0 pad)."""
  n = len(batch['label'])
  padded = {k: np.concatenate([v, np.zeros((batch_size - n,) + v.shape[1:],
                                            v.dtype)])
            for k, v in batch.items()}
  padded['mask'] = (np.arange(batch_size) < n).astype(np.float32)
  return padded


# ---------------------------------------------------------------- synthetic --


def synthetic_train(config: ml_collections.ConfigDict, shard: Shard,
                    start_step: int = 0) -> Iterator[Batch]:
  """Random normalized images and labels, endlessly.

  Each step's global batch depends only on (seed, step); a process takes its
  slice, so any number of processes trains on the same data.
  """
  local = local_batch_size(config.batch_size, shard)
  rows = slice(shard.index * local, (shard.index + 1) * local)
  size = config.model.image_size
  step = start_step
  while True:
    rng = np.random.default_rng([config.seed, step])
    images = rng.standard_normal((config.batch_size, size, size, 3), np.float32)
    labels = rng.integers(0, config.model.num_classes, config.batch_size,
                          dtype=np.int32)
    yield dict(image=images[rows], label=labels[rows])
    step += 1


def synthetic_eval(config: ml_collections.ConfigDict, split: str,
                   shard: Shard) -> Iterator[Batch]:
  """A fixed random set per split; this process's even slice of it."""
  num = config.data.synthetic_eval_examples
  rng = np.random.default_rng([config.seed, len(split)])
  size = config.model.image_size
  images = rng.standard_normal((num, size, size, 3), np.float32)
  labels = rng.integers(0, config.model.num_classes, num, dtype=np.int32)
  examples = _even_slice(num, shard)
  images = images[examples.start:examples.stop]
  labels = labels[examples.start:examples.stop]
  batch_size = local_batch_size(config.eval_batch_size, shard)
  batches = (dict(image=images[i:i + batch_size], label=labels[i:i + batch_size])
             for i in range(0, len(labels), batch_size))
  return _pad_to_equal_count(batches, num, batch_size, shard)


def _pad_to_equal_count(batches: Iterator[Batch],
                        num_examples: Optional[int],
                        batch_size: int, shard: Shard) -> Iterator[Batch]:
  """Pads every batch, then adds empty ones: each process yields as many.

  Processes evaluate in lockstep (their batches meet in one collective), so the
  one with fewer examples must still take part in every step.
  """
  last, yielded = None, 0
  for last in batches:
    yielded += 1
    yield pad_batch(last, batch_size)
  if num_examples is None:  # One process: nobody to keep in step with.
    return
  target = math.ceil(math.ceil(num_examples / shard.count) / batch_size)
  if last is None:
    raise DataError(f'an evaluation split of {num_examples} examples has none '
                    f'for process {shard.index} of {shard.count}')
  for _ in range(target - yielded):
    yield pad_batch({k: v[:0] for k, v in last.items()}, batch_size)


def _even_slice(num: int, shard: Shard) -> range:
  """The examples of `range(num)` that shard `shard` reads (as TFDS splits)."""
  bounds = [round(num * i / shard.count) for i in range(shard.count + 1)]
  return range(bounds[shard.index], bounds[shard.index + 1])


# --------------------------------------------------------------------- TFDS --


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


def _tf():
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


def _check_reachable(urls, name: str, timeout: float) -> None:
  """Fails in seconds when a download server is unreachable.

  TFDS retries a refused connection ten times with backoff (over three
  minutes) before it gives up; one request without retries tells at once.
  """
  import requests  # pylint: disable=g-import-not-at-top
  for url in urls:
    try:
      requests.head(url, timeout=timeout, allow_redirects=True)
    except requests.RequestException as e:
      raise DataError(
          f'data.data_dir: cannot reach {url} to download {name} '
          f'({_one_line(e)[:200]}). No network? Point --config.data.data_dir '
          'at a prepared copy and set --config.data.download=false') from None


def _download_error(e: Exception, name: str, where: str) -> DataError:
  """The cause of a failed download-and-prepare, in one line."""
  for cause in _causes(e):
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


def _builder(data_config: ml_collections.ConfigDict):
  _tf()  # Before TFDS imports it.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  name = data_config.name
  data_dir = data_config.data_dir or None
  where = data_dir or 'the TFDS default data dir (TFDS_DATA_DIR)'
  if data_dir and os.path.exists(data_dir) and not os.path.isdir(data_dir):
    raise DataError(f'data.data_dir={data_dir} is a file, not a directory')
  try:
    builder = tfds.builder(name, data_dir=data_dir)
    prepared = builder.is_prepared()
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(f'data.data_dir: {name} in {where} cannot be read '
                    f'({_one_line(e)[:300]})') from None
  if prepared:
    return builder
  if data_dir and os.path.isdir(data_dir):
    _check_not_foreign(data_dir, name)
  if not data_config.download:
    raise DataError(
        f'data.data_dir: {name} is not prepared in {where}, and '
        'data.download is False. Point --config.data.data_dir at a prepared '
        'copy, or allow the download.')
  if not data_config.connect_timeout_sec > 0:
    raise DataError(f'data.connect_timeout_sec={data_config.connect_timeout_sec}'
                    ' must be positive')
  try:
    # TFDS's registry of the dataset's downloads (reading it needs
    # importlib_resources, as preparing does).
    _check_reachable(builder.url_infos or {}, name,
                     data_config.connect_timeout_sec)
    builder.download_and_prepare()
  except DataError:
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise _download_error(e, name, where) from None
  return builder


def _process_split(split: str, shard: Shard) -> str:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  return tfds.even_splits(split, n=shard.count)[shard.index]


SOURCES = ('tfds', 'synthetic')


def _source(data_config: ml_collections.ConfigDict) -> str:
  if data_config.source not in SOURCES:
    raise DataError(f'data.source: unknown source {data_config.source!r}; '
                    f'expected one of {SOURCES}')
  return data_config.source


SPLIT_SETTINGS = ('train_split', 'val_split', 'test_split')


def check_available(data_config: ml_collections.ConfigDict) -> None:
  """Raises `DataError` now, before a run writes anything, if data is missing
  or a split setting names examples the dataset does not have."""
  if _source(data_config) != 'tfds':
    return
  builder = _builder(data_config)
  for setting in SPLIT_SETTINGS:
    split = data_config[setting]
    try:
      builder.info.splits[split]  # pylint: disable=pointless-statement
    except KeyError:  # No metadata to check against (tfds.testing.mock_data).
      pass
    except ValueError as e:
      raise DataError(f'data.{setting}={split!r}: '
                      f'{str(e).splitlines()[0]}') from None


def num_train_examples(data_config: ml_collections.ConfigDict) -> int:
  """Examples in the training split (all processes), for epochs and ETAs."""
  if _source(data_config) == 'synthetic':
    return data_config.synthetic_train_examples
  builder = _builder(data_config)
  return builder.info.splits[data_config.train_split].num_examples


def _standardize(image, data_config: ml_collections.ConfigDict):
  """float32 [0, 1] image -> per-channel standardized with the config's stats."""
  tf = _tf()
  return ((image - tf.constant(data_config.mean, tf.float32)) /
          tf.constant(data_config.std, tf.float32))


def _to_unit_float(image):
  tf = _tf()
  return tf.cast(image, tf.float32) / 255.0


def crop_window(image_shape, seed, data_config: ml_collections.ConfigDict):
  """(begin, size) of a random crop with the config's area and aspect ranges."""
  tf = _tf()
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      image_shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
      seed=seed, min_object_covered=0.0,
      aspect_ratio_range=tuple(data_config.crop_aspect_ratio),
      area_range=tuple(data_config.crop_area),
      max_attempts=data_config.crop_max_attempts,
      use_image_if_no_bounding_boxes=True)
  return begin, size


def augment(image, seed, data_config: ml_collections.ConfigDict):
  """Random resized crop back to the image's size, then a random flip."""
  tf = _tf()
  crop_seed, flip_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, 2))
  begin, size = crop_window(tf.shape(image), crop_seed, data_config)
  cropped = tf.slice(image, begin, size)
  image = tf.image.resize(cropped, tf.shape(image)[:2], method='bilinear')
  return tf.image.stateless_random_flip_left_right(image, flip_seed)


def tfds_train(config: ml_collections.ConfigDict, shard: Shard,
               start_step: int = 0) -> Iterator[Batch]:
  """Augmented, shuffled, normalized training batches, endlessly."""
  tf = _tf()
  data = config.data
  builder = _builder(data)
  batch_size = local_batch_size(config.batch_size, shard)
  ds = builder.as_dataset(split=_process_split(data.train_split, shard),
                          shuffle_files=False)
  ds = ds.map(lambda x: (x['image'], x['label']),
              num_parallel_calls=tf.data.AUTOTUNE).cache()
  num = int(ds.cardinality())
  ds = ds.shuffle(num, seed=config.seed, reshuffle_each_iteration=True).repeat()
  ds = ds.enumerate()

  def preprocess(index, example):
    image, label = example
    image = _to_unit_float(image)
    if data.augment:
      seed = tf.stack([tf.cast(config.seed, tf.int64), index])
      image = augment(image, seed, data)
    return dict(image=_standardize(image, data), label=tf.cast(label, tf.int32))

  ds = ds.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE,
              deterministic=True)
  ds = ds.batch(batch_size, drop_remainder=True).skip(start_step)
  ds = ds.prefetch(data.prefetch_batches)
  return iter(ds.as_numpy_iterator())


def tfds_eval(config: ml_collections.ConfigDict, split: str,
              shard: Shard) -> Iterator[Batch]:
  """Normalized batches covering this shard of `split` once, last one padded."""
  tf = _tf()
  data = config.data
  builder = _builder(data)
  ds = builder.as_dataset(split=_process_split(split, shard),
                          shuffle_files=False)
  ds = ds.map(lambda x: dict(
      image=_standardize(_to_unit_float(x['image']), data),
      label=tf.cast(x['label'], tf.int32)), num_parallel_calls=tf.data.AUTOTUNE)
  batch_size = local_batch_size(config.eval_batch_size, shard)
  ds = ds.batch(batch_size).prefetch(data.prefetch_batches)
  return _pad_to_equal_count(ds.as_numpy_iterator(),
                             _split_size(builder, split, shard), batch_size,
                             shard)


def _split_size(builder, split: str, shard: Shard) -> Optional[int]:
  """Examples in `split` from the dataset's metadata, if it has them."""
  try:
    return builder.info.splits[split].num_examples
  except KeyError:  # No metadata (e.g. tfds.testing.mock_data).
    if shard.count > 1:
      raise DataError(f'data: no size known for split {split!r}; many '
                      'processes need it to evaluate in lockstep') from None
    return None


def train_batches(config: ml_collections.ConfigDict, shard: Shard,
                  start_step: int = 0) -> Iterator[Batch]:
  """This process's training batches from step `start_step` on."""
  if _source(config.data) == 'synthetic':
    return synthetic_train(config, shard, start_step)
  return tfds_train(config, shard, start_step)


def eval_batches(config: ml_collections.ConfigDict, split: str,
                 shard: Shard) -> Iterator[Batch]:
  """This process's padded evaluation batches of `split`."""
  if _source(config.data) == 'synthetic':
    return synthetic_eval(config, split, shard)
  return tfds_eval(config, split, shard)
