"""CIFAR-10 splits as uint8 arrays in memory, and the batches read from them.

Every source (`data.source`) gives each split setting (train/val/test) as
uint8 images and int32 labels held in host memory: `tfds` reads them once
through TFDS (the only place TensorFlow is imported), `arrays` from a `.npz`
written by `python -m launch.data export`, `synthetic` draws random pixels.
Training batches are indices drawn by `sampling` from (seed, step), so a run
restarted at step N reads exactly what an uninterrupted run would, with
nothing to replay; augmentation and normalization happen on the device, in the
compiled step (`augment.train_inputs`), so only uint8 pixels cross to it.
Evaluation covers every example of a split exactly once: the last batch is
padded and its padding has `mask == 0`. Each process reads its own part of
every batch and of every evaluation split.
"""

import dataclasses
import itertools
import math
import re
from typing import Iterator, NamedTuple, Optional

import jax
import numpy as np

from haiku_mp import errors
from haiku_mp.vit.data import npz_source
from haiku_mp.vit.data import sampling
from haiku_mp.vit.data import tfds_source
from haiku_mp.vit.settings import DataSettings
from haiku_mp.vit.settings import ModelSettings

Batch = dict[str, np.ndarray]

DataError = errors.DataError

SPLIT_SETTINGS = ('train_split', 'val_split', 'test_split')


@dataclasses.dataclass(frozen=True)
class Shard:
  """Which part of every batch and split this process reads."""
  index: int = 0
  count: int = 1

  @classmethod
  def current(cls) -> 'Shard':
    return cls(jax.process_index(), jax.process_count())


class Split(NamedTuple):
  """One split in memory: uint8 images [N, H, W, 3], int32 labels [N]."""
  images: np.ndarray
  labels: np.ndarray


class Splits(NamedTuple):
  """The three splits a run reads, as its config's split settings name them."""
  train: Split
  val: Split
  test: Split


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


def random_batch(model_config: ModelSettings, batch_size: int,
                 seed, dtype=np.float32) -> Batch:
  """Normal random model inputs (already normalized) and uniform labels, a
  function of `seed` alone (an int or a list of ints): every measurement's
  batch."""
  rng = np.random.default_rng(seed)
  size = model_config.image_size
  return dict(
      image=rng.standard_normal((batch_size, size, size, 3), dtype),
      label=rng.integers(0, model_config.num_classes, batch_size,
                         dtype=np.int32))


# ------------------------------------------------------------ split strings --

# 'train', 'train[:45000]', 'train[45000:]', 'train[-10%:]': TFDS's slicing
# syntax, the part the arrays source understands. Parsed here because the
# arrays source must work where TFDS is not installed (the GPU machines).
_SPLIT = re.compile(r'^(\w+)(?:\[(-?\d+%?)?:(-?\d+%?)?\])?$')


def _bound(text, size: int):
  if text is None:
    return None
  if text.endswith('%'):  # TFDS rounds percent boundaries to the closest.
    return round(int(text[:-1]) * size / 100)
  return int(text)


def split_slice(setting: str, spec: str, sizes: dict[str, int]
                ) -> tuple[str, range]:
  """(base split, example range) of a split string over splits of `sizes`."""
  match = _SPLIT.match(spec.replace(' ', ''))
  if not match:
    raise DataError(f'data.{setting}={spec!r} is not a split such as '
                    "'train', 'train[:45000]' or 'train[90%:]'")
  name, start, stop = match.groups()
  if name not in sizes:
    raise DataError(f'data.{setting}={spec!r}: no split {name!r} (there are '
                    f'{", ".join(sorted(sizes))})')
  size = sizes[name]
  examples = range(size)[slice(_bound(start, size), _bound(stop, size))]
  if not examples:
    raise DataError(f'data.{setting}={spec!r} selects no example of the '
                    f'{size} in {name!r}')
  return name, examples


# ------------------------------------------------------------------ sources --


def _synthetic_split(data: DataSettings,
                     model: ModelSettings, seed: int,
                     setting: str) -> Split:
  """Random pixels and labels, a function of (seed, setting) alone."""
  num = (data.synthetic_train_examples if setting == 'train_split'
         else data.synthetic_eval_examples)
  rng = np.random.default_rng([seed, SPLIT_SETTINGS.index(setting)])
  size = model.image_size
  return Split(rng.integers(0, 256, (num, size, size, 3), np.uint8),
               rng.integers(0, model.num_classes, num, np.int32))


def _arrays_splits(data_config: DataSettings) -> Splits:
  arrays = npz_source.load(data_config.arrays_path)
  sizes = {s: len(arrays[f'{s}_label']) for s in npz_source.SPLITS}
  splits = []
  for setting in SPLIT_SETTINGS:
    name, examples = split_slice(setting, getattr(data_config, setting), sizes)
    rows = slice(examples.start, examples.stop, examples.step)
    splits.append(Split(arrays[f'{name}_image'][rows],
                        arrays[f'{name}_label'][rows].astype(np.int32)))
  return Splits(*splits)


def _tfds_splits(data_config: DataSettings) -> Splits:
  builder = tfds_source.builder(data_config)
  splits = []
  for setting in SPLIT_SETTINGS:
    try:
      images, labels = tfds_source.read_split(
          builder, getattr(data_config, setting))
    except ValueError as e:
      raise DataError(f'data.{setting}={getattr(data_config, setting)!r}: '
                      f'{str(e).splitlines()[0]}') from None
    splits.append(Split(images, labels.astype(np.int32)))
  return Splits(*splits)


def load(data_config: DataSettings,
         model_config: ModelSettings, seed: int,
         batch_size: int) -> Splits:
  """The train, val and test splits of `data_config`, in memory, checked
  against the model's image size and classes and the run's `batch_size`
  (synthetic splits are drawn from `seed`)."""
  source = data_config.source
  if source == 'synthetic':
    splits = Splits(*(_synthetic_split(data_config, model_config, seed, s)
                      for s in SPLIT_SETTINGS))
  elif source == 'arrays':
    splits = _arrays_splits(data_config)
  else:
    splits = _tfds_splits(data_config)
  size = model_config.image_size
  if splits.train.images.shape[1:3] != (size, size):
    raise DataError(
        f'model.image_size={size}, but data.source={source} has '
        f'{"x".join(map(str, splits.train.images.shape[1:3]))} images')
  largest = max((int(split.labels.max()) for split in splits
                 if split.labels.size), default=-1)
  if largest >= model_config.num_classes:
    raise DataError(
        f'model.num_classes={model_config.num_classes}, but '
        f'data.source={source} has labels up to {largest}')
  if batch_size > len(splits.train.labels):
    raise DataError(f'batch_size={batch_size} is larger than the '
                    f'{len(splits.train.labels)} examples of '
                    f'data.train_split={data_config.train_split!r}')
  return splits


def check_available(data_config: DataSettings) -> Optional[int]:
  """The train split's size (all processes: epochs, ETAs, DP-SGD's
  sampling), from the dataset's metadata read once (None where it has none:
  tfds.testing.mock_data); raises `DataError` now, before a run writes or
  loads anything, if data is missing or a split setting names examples the
  dataset does not have. The settings were checked when parsed."""
  source = data_config.source
  if source == 'synthetic':
    return data_config.synthetic_train_examples
  if source == 'arrays':
    sizes = npz_source.split_sizes(data_config.arrays_path)
    examples = {
        setting: split_slice(setting, getattr(data_config, setting), sizes)[1]
        for setting in SPLIT_SETTINGS}
    return len(examples['train_split'])
  builder = tfds_source.builder(data_config)
  for setting in SPLIT_SETTINGS:
    split = getattr(data_config, setting)
    try:
      builder.info.splits[split]  # pylint: disable=pointless-statement
    except KeyError:  # No metadata to check against (tfds.testing.mock_data).
      pass
    except ValueError as e:
      raise DataError(f'data.{setting}={split!r}: '
                      f'{str(e).splitlines()[0]}') from None
  try:
    return builder.info.splits[data_config.train_split].num_examples
  except KeyError:
    return None


# ------------------------------------------------------------------ batches --


def train_batches(seed: int, batch_size: int, split: Split, shard: Shard,
                  start_step: int = 0) -> Iterator[Batch]:
  """This process's uint8 training batches of the global `batch_size` from
  step `start_step` on."""
  local_batch_size(batch_size, shard)
  for step in itertools.count(start_step):
    rows = sampling.batch_indices(seed, step, batch_size,
                                  len(split.labels), shard.index, shard.count)
    yield dict(image=split.images[rows], label=split.labels[rows])


def private_train_batches(seed: int, split: Split, shard: Shard,
                          settings: sampling.PoissonSampling,
                          total_steps: int, start_step: int = 0
                          ) -> Iterator[Batch]:
  """This process's uint8 DP-SGD batches from step `start_step` on: its part
  of each padded Poisson sample (`sampling.poisson_batches`), `mask` 1 for a
  sampled example; padding rows are zero images, never a real example."""
  for indices in sampling.poisson_batches(seed, settings, total_steps,
                                           start_step):
    local = len(indices) // shard.count
    rows = indices[shard.index * local:(shard.index + 1) * local]
    sampled = rows >= 0
    rows = np.where(sampled, rows, 0)
    images, labels = split.images[rows], split.labels[rows]
    images[~sampled], labels[~sampled] = 0, 0
    yield dict(image=images, label=labels, mask=sampled.astype(np.float32))


def _even_slice(num: int, shard: Shard) -> range:
  """The examples of `range(num)` that shard `shard` reads (as TFDS splits)."""
  bounds = [round(num * i / shard.count) for i in range(shard.count + 1)]
  return range(bounds[shard.index], bounds[shard.index + 1])


def eval_batches(eval_batch_size: int, split: Split,
                 shard: Shard) -> Iterator[Batch]:
  """This process's padded uint8 batches covering its part of `split` once.

  Processes evaluate in lockstep (their batches meet in one collective), so
  every one yields as many batches: the one with fewer examples ends with an
  all-padding batch.
  """
  num = len(split.labels)
  batch_size = local_batch_size(eval_batch_size, shard)
  examples = _even_slice(num, shard)
  if not examples:
    raise DataError(f'an evaluation split of {num} examples has none for '
                    f'process {shard.index} of {shard.count}')
  count = math.ceil(math.ceil(num / shard.count) / batch_size)
  for i in range(count):
    start = min(examples.start + i * batch_size, examples.stop)
    stop = min(start + batch_size, examples.stop)
    yield pad_batch(dict(image=split.images[start:stop],
                         label=split.labels[start:stop]), batch_size)
