"""Per-example keys, the same for an example under every strategy.

Augmentation and DP-SGD's per-example dropout both draw one key per example
of the global batch; both split it here, so that single, `pmap` and `pjit`
see the same key for the same example.
"""

from typing import Optional

import jax


def example_keys(key: jax.Array, local_batch: int,
                 axis_name: Optional[str] = None) -> jax.Array:
  """This device's keys of one per example of the global batch, split from
  `key`: under `pmap` (`axis_name`) replica r takes the r-th block, so every
  strategy draws the same augmentation for the same example."""
  if axis_name is None:
    return jax.random.split(key, local_batch)
  replicas = jax.lax.psum(1, axis_name)
  keys = jax.random.split(key, local_batch * replicas)
  return jax.lax.dynamic_slice_in_dim(
      keys, jax.lax.axis_index(axis_name) * local_batch, local_batch)
