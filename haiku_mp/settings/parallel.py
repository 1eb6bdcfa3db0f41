"""How a run spreads over devices (haiku_mp/parallel/)."""

from haiku_mp.settings import fields
from haiku_mp.settings.fields import setting


@fields.frozen
class ParallelSettings:
  """The strategy, the ('batch', 'model') mesh and sharding rules."""

  strategy: str = setting('single', "'single' | 'pmap' | 'pjit'")
  mesh_shape: tuple[int, ...] = setting(
      (-1, 1),
      '(batch, model); -1: the remaining devices.',
      takes='two positive integers (batch, model) like (4,2); one may be -1 '
      '(the remaining devices)')
  sharding_rules: str = setting(
      '',
      "'REGEX=SPEC;...' over 'module/path/param', e.g. "
      "'.*/head/w=None,model'; tried before the built-in rules "
      '(haiku_mp/parallel/sharding.py).')


__all__ = ['ParallelSettings']
