"""The precision of a run's communication: `parallel.gather_dtype` and
`parallel.reduce_dtype` turned into each parameter's `Layout` and the step's
`DataParallel` (haiku_mp/update/data_parallel.py)."""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from haiku_mp.update import data_parallel
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.settings import parallel as parallel_settings

GATHER_DTYPES = parallel_settings.GATHER_DTYPES
REDUCE_DTYPES = parallel_settings.REDUCE_DTYPES


class Communication(NamedTuple):
  """What a run's settings say about its collectives."""
  gather_dtype: str  # One of GATHER_DTYPES.
  reduce_dtype: str  # One of REDUCE_DTYPES.
  compute_dtype: Any  # The policy's compute dtype, which 'compute' means.
  # Module paths of the Linears that run in fp8, for 'fp8' gathers.
  fp8_modules: frozenset[str] = frozenset()

  def reduce(self) -> Any:
    """The dtype gradients are reduced in."""
    return jnp.float32 if self.reduce_dtype == 'float32' else (
        jnp.dtype(self.compute_dtype))

  def wire(self, module: str, value: Any) -> Optional[str]:
    """The dtype one split parameter (of `module`) is gathered in: None
    (as stored) for vectors, whose modules may keep them float32
    (LayerNorm's scale), and for 'float32'."""
    if self.gather_dtype == 'float32' or len(value.shape) < 2:
      return None
    if (self.gather_dtype == data_parallel.FP8_WIRE and
        module in self.fp8_modules):
      return data_parallel.FP8_WIRE
    return jnp.dtype(self.compute_dtype).name

  def data_parallel(self, dims: Any = None,
                    params: Any = None) -> data_parallel.DataParallel:
    """The step's DataParallel over `batch`: params split along `dims` (a
    tree like `params`, the trained ones, of a dimension or None), or none
    split."""
    layouts = None
    if dims is not None:
      layouts = jax.tree_util.tree_map_with_path(
          lambda path, value, dim: data_parallel.Layout(
              dim, None if dim is None else self.wire(
                  sharding.param_name(path[:-1]), value)),
          params, dims)
    return data_parallel.DataParallel(sharding.BATCH, self.reduce(), layouts)

  def describe(self, gathers: bool) -> str:
    """One line for the run's start."""
    reduce = jnp.dtype(self.reduce()).name
    if not gathers:
      return (f'Communication: gradients reduced in {reduce}; no parameter '
              'is gathered (each replica holds them whole)')
    compute = jnp.dtype(self.compute_dtype).name
    gather = {'float32': 'as stored', 'compute': compute,
              data_parallel.FP8_WIRE: "fp8 E4M3 for the fp8 Linears' "
                                      f'kernels, {compute} for the rest',
              }[self.gather_dtype]
    return (f'Communication: matrices all-gathered {gather} (vectors as '
            f'stored), gradients reduce-scattered in {reduce}')
