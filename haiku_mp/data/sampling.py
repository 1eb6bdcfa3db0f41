"""Which examples a train step reads: a pure function of (seed, step).

Each epoch is a permutation of the training set drawn from (seed, epoch);
step s reads the s-th batch of that sequence (batches never straddle epochs:
the last `num_examples % batch_size` of each permutation are left out of that
epoch), and a process reads its own contiguous part of the global batch. A run
resumed at any step reads what an uninterrupted run would have, with nothing
to replay.
"""

import functools

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
