"""Which examples a train step reads: a pure function of (seed, step).

Each epoch is a permutation of the training set drawn from (seed, epoch);
step s reads the s-th batch of that sequence (batches never straddle epochs:
the last `num_examples % batch_size` of each permutation are left out of that
epoch), and a process reads its own contiguous part of the global batch. A run
resumed at any step reads what an uninterrupted run would have, with nothing
to replay.

DP-SGD reads Poisson samples instead (`poisson_batches`): each example in
each step with a fixed probability, padded to a fixed shape. Those are a
function of (seed, step) too, drawn as one stream from the seed.
"""

import functools
import itertools
from typing import Iterator, Optional, Protocol

import numpy as np


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
  return num_examples // batch_size


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, num_examples: int) -> np.ndarray:
  """The order of the training set in `epoch` (read-only: drawn once per
  epoch, not once per step)."""
  order = np.random.default_rng([seed, epoch]).permutation(num_examples)
  order.setflags(write=False)
  return order


def batch_indices(seed: int, step: int, batch_size: int, num_examples: int,
                  shard_index: int = 0, shard_count: int = 1) -> np.ndarray:
  """The indices of the examples this process reads at `step` (its part of
  the global batch of `batch_size`)."""
  per_epoch = steps_per_epoch(num_examples, batch_size)
  if per_epoch == 0:
    raise ValueError(f'batch_size={batch_size} is larger than the '
                     f'{num_examples} training examples')
  epoch, position = divmod(step, per_epoch)
  start = position * batch_size
  batch = epoch_permutation(seed, epoch, num_examples)[start:start + batch_size]
  local = batch_size // shard_count
  return batch[shard_index * local:(shard_index + 1) * local]


class PoissonSampling(Protocol):
  """What Poisson sampling reads of a private run's settings (`DpSgd`)."""
  sampling_probability: float
  num_examples: int
  padded_batch_size: int
  microbatch_size: Optional[int]


# Keeps the Poisson draws apart from every other stream drawn from the seed.
_POISSON_STREAM = 1


def poisson_batches(seed: int, settings: PoissonSampling, total_steps: int,
                    start_step: int = 0) -> Iterator[np.ndarray]:
  """The global batches' example indices from `start_step` on: each example
  in each step independently with probability `batch_size / num_examples`
  (JAX Privacy's `CyclicPoissonSampling`, no truncation), padded by `pad`: a
  step that samples more than the padded size takes a larger shape and drops
  no example.

  One stream of draws from `seed`: a resumed run replays the draws of the
  steps before `start_step` (microseconds each) and reads what an
  uninterrupted run would.
  """
  from jax_privacy import batch_selection  # pylint: disable=g-import-not-at-top
  sampler = batch_selection.CyclicPoissonSampling(
      sampling_prob=settings.sampling_probability, iterations=total_steps)
  draws = sampler.batch_iterator(
      settings.num_examples, rng=np.random.default_rng([seed, _POISSON_STREAM]))
  for indices in itertools.islice(draws, start_step, None):
    yield pad(indices.astype(np.int64), settings)


def pad(indices: np.ndarray, settings: PoissonSampling) -> np.ndarray:
  """`indices` padded with -1 to a multiple of `padded_batch_size`, the
  padding placed where whole microbatches of it are skipped (JAX Privacy's
  `split_and_pad_global_batch`)."""
  from jax_privacy import batch_selection  # pylint: disable=g-import-not-at-top
  return np.concatenate(batch_selection.split_and_pad_global_batch(
      indices, settings.padded_batch_size, settings.microbatch_size))
