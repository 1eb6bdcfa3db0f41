"""A batch field by which a run's processes agree to stop, without a host
sync of their own (`train.interruption.Interruption`): the trainer's, not the
library step's."""

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

# One flag per example (or batch shard): its process's request when the batch
# was made.
STOP_REQUEST = 'stop_request'


def with_stop_request(train_step: Callable, axis_name: Optional[str] = None
                      ) -> Callable:
  """`train_step` taking batches that may carry `STOP_REQUEST`: the field is
  left out of the step's batch, and the `stop_requested` metric says whether
  any example of the global batch asks, the same on every process (and
  replica of `axis_name`)."""

  @functools.wraps(train_step)  # Its name: the profile's op names start so.
  def step(state, batch):
    batch = dict(batch)
    request = batch.pop(STOP_REQUEST, None)
    state, metrics = train_step(state, batch)
    if request is not None:
      requested = jnp.any(request).astype(jnp.int32)
      if axis_name is not None:
        requested = jax.lax.pmax(requested, axis_name)
      metrics = dict(metrics, stop_requested=requested > 0)
    return state, metrics

  return step
