"""Training strategies by name: `single` device, `pmap` data parallel
(replicated.py), `pjit` mesh, `fsdp` (pjit with the parameters and optimizer
state split over `batch`; sharded.py), each a `strategy.Strategy`.
"""

from typing import Optional, Sequence

from jax.sharding import Mesh

from haiku_mp import errors
from haiku_mp.vit.parallel import replicated
from haiku_mp.vit.parallel import sharded
from haiku_mp.vit.parallel import strategy as strategy_lib


STRATEGIES = {cls.name: cls for cls in (replicated.Single, replicated.Pmap,
                                        sharded.Pjit, sharded.Fsdp)}


def make_strategy(name: str, mesh: Optional[Mesh],
                  parts: strategy_lib.StepParts,
                  rules: Sequence[tuple[str, str]] = ()
                  ) -> strategy_lib.Strategy:
  """The strategy `name` (`parallel.strategy`, checked when parsed) on
  `mesh` (None for `single`); `rules` place the parameters of a strategy
  that shards them."""
  if name != 'single' and mesh is None:
    raise errors.ConfigError(f'parallel.strategy={name} needs a device mesh')
  return STRATEGIES[name](mesh, parts, rules)
