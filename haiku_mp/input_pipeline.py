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
from typing import Iterator, Optional

import jax
import ml_collections
import numpy as np

from haiku_mp import errors
from haiku_mp import tfds_builder

Batch = dict[str, np.ndarray]


DataError = errors.DataError


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


def random_batch(model_config: ml_collections.ConfigDict, batch_size: int,
                 seed, dtype=np.float32) -> Batch:
  """Normal random images and uniform labels, a function of `seed` alone
  (an int or a list of ints): synthetic data, and every measurement's batch."""
  rng = np.random.default_rng(seed)
  size = model_config.image_size
  return dict(
      image=rng.standard_normal((batch_size, size, size, 3), dtype),
      label=rng.integers(0, model_config.num_classes, batch_size,
                         dtype=np.int32))


def synthetic_train(config: ml_collections.ConfigDict, shard: Shard,
                    start_step: int = 0) -> Iterator[Batch]:
  """Random normalized images and labels, endlessly.

  Each step's global batch depends only on (seed, step); a process takes its
  slice, so any number of processes trains on the same data.
  """
  local = local_batch_size(config.batch_size, shard)
  rows = slice(shard.index * local, (shard.index + 1) * local)
  step = start_step
  while True:
    batch = random_batch(config.model, config.batch_size, [config.seed, step])
    yield {k: v[rows] for k, v in batch.items()}
    step += 1


def synthetic_eval(config: ml_collections.ConfigDict, split: str,
                   shard: Shard) -> Iterator[Batch]:
  """A fixed random set per split; this process's even slice of it."""
  num = config.data.synthetic_eval_examples
  data = random_batch(config.model, num, [config.seed, len(split)])
  images, labels = data['image'], data['label']
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
  builder = tfds_builder.builder(data_config)
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
  builder = tfds_builder.builder(data_config)
  return builder.info.splits[data_config.train_split].num_examples


def _standardize(image, data_config: ml_collections.ConfigDict):
  """float32 [0, 1] image -> per-channel standardized with the config's stats."""
  tf = tfds_builder.tensorflow()
  return ((image - tf.constant(data_config.mean, tf.float32)) /
          tf.constant(data_config.std, tf.float32))


def _to_unit_float(image):
  tf = tfds_builder.tensorflow()
  return tf.cast(image, tf.float32) / 255.0


def crop_window(image_shape, seed, data_config: ml_collections.ConfigDict):
  """(begin, size) of a random crop with the config's area and aspect ranges."""
  tf = tfds_builder.tensorflow()
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
  tf = tfds_builder.tensorflow()
  crop_seed, flip_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, 2))
  begin, size = crop_window(tf.shape(image), crop_seed, data_config)
  cropped = tf.slice(image, begin, size)
  image = tf.image.resize(cropped, tf.shape(image)[:2], method='bilinear')
  return tf.image.stateless_random_flip_left_right(image, flip_seed)


def _options():
  """tf.data options of every pipeline here: no autotuning.

  Autotuning runs a model thread that re-optimizes with a period that doubles
  up to a minute; destroying an iterator waits for that thread, and it was seen
  (gdb: `Model::OptimizeLoop` in a timed wait, the main thread in
  `RootDataset::Iterator::~Iterator`) to hold a finished run for 20 to 40 s
  after its summary. `AUTOTUNE` parallelism then means one call per core.
  """
  tf = tfds_builder.tensorflow()
  options = tf.data.Options()
  options.autotune.enabled = False
  return options


def train_dataset(config: ml_collections.ConfigDict, shard: Shard,
                  start_step: int = 0):
  """The tf.data pipeline of `tfds_train`."""
  tf = tfds_builder.tensorflow()
  data = config.data
  builder = tfds_builder.builder(data)
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
  return ds.prefetch(data.prefetch_batches).with_options(_options())


def tfds_train(config: ml_collections.ConfigDict, shard: Shard,
               start_step: int = 0) -> Iterator[Batch]:
  """Augmented, shuffled, normalized training batches, endlessly."""
  return iter(train_dataset(config, shard, start_step).as_numpy_iterator())


def eval_dataset(config: ml_collections.ConfigDict, split: str, shard: Shard):
  """The tf.data pipeline of `tfds_eval`, before the padding."""
  tf = tfds_builder.tensorflow()
  data = config.data
  builder = tfds_builder.builder(data)
  ds = builder.as_dataset(split=_process_split(split, shard),
                          shuffle_files=False)
  ds = ds.map(lambda x: dict(
      image=_standardize(_to_unit_float(x['image']), data),
      label=tf.cast(x['label'], tf.int32)), num_parallel_calls=tf.data.AUTOTUNE)
  batch_size = local_batch_size(config.eval_batch_size, shard)
  ds = ds.batch(batch_size).prefetch(data.prefetch_batches)
  return ds.with_options(_options())


def tfds_eval(config: ml_collections.ConfigDict, split: str,
              shard: Shard) -> Iterator[Batch]:
  """Normalized batches covering this shard of `split` once, last one padded."""
  return _pad_to_equal_count(
      eval_dataset(config, split, shard).as_numpy_iterator(),
      _split_size(tfds_builder.builder(config.data), split, shard),
      local_batch_size(config.eval_batch_size, shard), shard)


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
