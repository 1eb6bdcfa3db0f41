"""How a run spreads over devices (haiku_mp/vit/parallel/)."""

from haiku_mp import errors
from haiku_mp.update import data_parallel
from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import setting

# The strategies' names (the classes of haiku_mp/vit/parallel/replicated.py
# and sharded.py carry them).
STRATEGIES = ('single', 'pmap', 'pjit', 'fsdp')
# What parameters are all-gathered in and gradients reduced in
# (haiku_mp/vit/parallel/wire_dtypes.py).
GATHER_DTYPES = ('float32', 'compute', data_parallel.FP8_WIRE)
REDUCE_DTYPES = ('float32', 'compute')
# The bounds of heartbeat_timeout_sec. Below 5 s a busy host or a network
# hiccup would end healthy runs (JAX sends heartbeats from a thread of its
# runtime, never held up by Python); past 10 minutes every other host of a
# many-host run idles that long before a lost one is named.
MIN_HEARTBEAT_SEC, MAX_HEARTBEAT_SEC = 5, 600


_MESH_SHAPE = ('two positive integers (batch, model) like (4,2); one may be '
               '-1 (the remaining devices)')


@fields.frozen
class ParallelSettings:
  """The strategy, the ('batch', 'model') mesh, sharding rules and the
  precision of communication."""

  strategy: str = setting(
      'single', "'single' | 'pmap' | 'pjit' | 'fsdp' (pjit with the "
      "params and optimizer state split over 'batch' too)",
      check=fields.one_of(STRATEGIES))
  mesh_shape: tuple[int, ...] = setting(
      (-1, 1),
      '(batch, model); -1: the remaining devices.',
      takes=_MESH_SHAPE,
      check=lambda shape: None if (
          len(shape) == 2 and all(d > 0 or d == -1 for d in shape)
          and shape.count(-1) < 2) else f': expected {_MESH_SHAPE}')
  sharding_rules: str = setting(
      '',
      "'REGEX=SPEC;...' over 'module/path/param', e.g. "
      "'.*/head/w=None,model'; tried before the built-in rules "
      '(haiku_mp/vit/parallel/sharding.py).')
  gather_dtype: str = setting(
      'compute',
      "'float32' | 'compute' | 'fp8': the dtype parameters split over "
      "'batch' (fsdp) are all-gathered in; 'float32' keeps their stored "
      "dtype, 'fp8' is E4M3 for the fp8 Linears' kernels (compute for the "
      'rest); vectors (biases, norms) travel as stored.',
      check=fields.one_of(GATHER_DTYPES))
  reduce_dtype: str = setting(
      'float32',
      "'float32' | 'compute': the dtype gradients are reduced in over "
      "'batch' (all-reduce, or reduce-scatter under fsdp); float16 goes "
      'through the loss scale.', check=fields.one_of(REDUCE_DTYPES))
  heartbeat_timeout_sec: int = setting(
      30,
      'Many processes: one that sends JAX\'s coordination service no '
      'heartbeat this long (killed, stopped, its host lost) is lost, and '
      'every other ends with one line naming it, the last step and the '
      'newest checkpoint (docs/parallelism.md).',
      check=fields.rule(
          lambda s: MIN_HEARTBEAT_SEC <= s <= MAX_HEARTBEAT_SEC,
          f'an integer number of seconds in [{MIN_HEARTBEAT_SEC}, '
          f'{MAX_HEARTBEAT_SEC}]'))

  def check_rules(self, path: str) -> None:
    """Parameters gathered in fp8 only where they are gathered (fsdp)."""
    if (self.gather_dtype == data_parallel.FP8_WIRE and
        self.strategy != 'fsdp'):
      raise errors.ConfigError(
          f'{path}gather_dtype={self.gather_dtype}: {path}strategy='
          f'{self.strategy} gathers no parameters (every device holds them '
          "whole); only fsdp splits them over 'batch'")


__all__ = ['ParallelSettings', 'STRATEGIES', 'GATHER_DTYPES', 'REDUCE_DTYPES']
