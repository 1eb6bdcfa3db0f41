"""Which Linear layers run low-bit matmuls, and in what format: the one value
`make_precision` takes for them (`low_bit=`) and a `Precision` and its
`Matmuls` hold, fp8 at a scaling or a 4-bit format."""

import dataclasses
import fnmatch
from typing import Any, Optional, Sequence, Union

from haiku_mp.model import fp4 as fp4_lib
from haiku_mp.model import fp8 as fp8_lib
from haiku_mp.model import targets as targets_lib
from haiku_mp.model.precision_error import PrecisionError

# A module target: a class name or path glob, or the class itself.
Targets = Union[str, Sequence[Any]]
# The only module whose matmul runs low-bit (fp8 or 4 bits).
LOW_BIT_CLASS = 'Linear'


def selects(targets: tuple[str, ...], class_name: str, path: str) -> bool:
  """Whether `targets` (class names or path globs) select a module: its class
  is one, or a glob matches its path or the path of a module around it."""
  if class_name in targets:
    return True
  parts = path.split('/')
  prefixes = ['/'.join(parts[:i]) for i in range(1, len(parts) + 1)]
  return any(fnmatch.fnmatchcase(p, t) for t in targets for p in prefixes)


@dataclasses.dataclass(frozen=True)
class LowBit:
  """The Linear layers of `modules` (``'TARGET;...'`` or a sequence of
  classes, class names and path globs) on low-bit matmuls in `format`: fp8
  scaled as an `Fp8` says, or 4 bits, emulated (an `Fp4`), with those that
  `keep_fp8` selects among them in fp8 at current scaling. Its targets are
  held in one form, a tuple of names (``LowBit([hk.Linear]).modules ==
  ('Linear',)``): the value a `Precision` and its `Matmuls` hold.

  Example:
    precision = haiku_mp.make_precision(
        BF16, model_class=hk.nets.MLP,
        low_bit=haiku_mp.LowBit('Linear', haiku_mp.Fp4('nvfp4')))
  """
  modules: Targets
  format: Union[fp8_lib.Fp8, fp4_lib.Fp4] = fp8_lib.Fp8()
  keep_fp8: Targets = ''

  def __post_init__(self):
    object.__setattr__(self, 'modules',
                       targets_lib.parse_targets(self.modules, '$modules'))
    object.__setattr__(self, 'keep_fp8',
                       targets_lib.parse_targets(self.keep_fp8, '$keep_fp8'))

  @property
  def fp8(self) -> fp8_lib.Fp8:
    """The fp8 matmuls' scaling: the format's, or current scaling for the
    Linears a 4-bit format keeps in fp8."""
    return self.format if isinstance(self.format, fp8_lib.Fp8) else (
        fp8_lib.Fp8())

  @property
  def fp4(self) -> Optional[fp4_lib.Fp4]:
    return self.format if isinstance(self.format, fp4_lib.Fp4) else None


def from_parts(modules: Targets = '', fp8: Optional[fp8_lib.Fp8] = None,
               fp4: Optional[fp4_lib.Fp4] = None,
               keep_fp8: Targets = '') -> Optional[LowBit]:
  """A `LowBit` from its parts as the configs give them: the modules, fp8's
  scaling, a 4-bit format (None: fp8) and the modules kept in fp8; None
  where neither modules nor kept ones are given.
  A 4-bit format with fp8's delayed or MX scaling is a PrecisionError
  naming both (`$fp8.scaling`, `$fp4.format`)."""
  if not _given(modules) and not _given(keep_fp8):
    return None
  if (_given(modules) and fp4 is not None and fp8 is not None
      and fp8.scaling != 'current'):
    raise PrecisionError(
        f'$fp8.scaling={fp8.scaling} with $fp4.format={fp4.format}: 4-bit '
        "formats scale per block themselves; leave $fp8.scaling at 'current'")
  return LowBit(modules, fp4 or fp8 or fp8_lib.Fp8(), keep_fp8)


def _given(targets: Targets) -> bool:
  if isinstance(targets, str):
    return bool(targets.strip())
  return bool(targets)
