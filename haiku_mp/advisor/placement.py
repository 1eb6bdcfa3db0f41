"""Low-bit matmuls only where they pay: each Linear's three GEMMs predicted
on a named GPU in bf16 and in the low-bit format (`speed.gain`, casts and
all), the Linear in the format where the format is faster.

For a GPU the model does not know, torchao's rule for tensorwise fp8 stands
in (`torchao_pays`): it was read off an H100 microbenchmark, and leaves a
Linear in bf16 when it is small in both its dimensions.
"""

import dataclasses
from typing import Optional, Sequence

from haiku_mp import errors
from haiku_mp.advisor import gpus
from haiku_mp.advisor import speed

TORCHAO_RULE = "torchao's shape rule"


@dataclasses.dataclass(frozen=True)
class LinearShape:
  """A Linear layer as its GEMMs see it: M tokens (per device and step), K
  inputs, N outputs, and the bytes of a value in its compute dtype.

  Example:
    fc1 = advisor.LinearShape('vit/encoder_block_0/mlp_block/fc1', 128 * 65,
                              384, 1536)
  """
  path: str
  m: int
  k: int
  n: int
  compute_bytes: float = 2.0


@dataclasses.dataclass(frozen=True)
class Choice:
  """Whether one Linear runs the low-bit format, and why."""
  linear: LinearShape
  low_bit: bool
  gain: Optional[float]  # bf16's time over the format's; None: the rule.
  rule: str  # The GPU predicted for, or `TORCHAO_RULE`.

  def why(self, fmt: str) -> str:
    shape = f'{self.linear.m}x{self.linear.k}x{self.linear.n}'
    if self.gain is None:
      verdict = 'passes' if self.low_bit else 'is too small for'
      return f'{shape}: {verdict} {TORCHAO_RULE} (no GPU named)'
    return (f'{shape}: {self.gain:.2f}x predicted in {fmt} on the '
            f'{self.rule}')


def torchao_pays(k: int, n: int) -> bool:
  """torchao's `_auto_filter_for_tensorwise` (torchao/float8/
  float8_linear_utils.py): a Linear converts unless `K <= 4096 and N <=
  1024`, where its code reads `K, N = weight.shape` of a torch Linear, that
  is (out_features, in_features); here K is the inputs and N the outputs,
  so a Linear stays unless N <= 4096 and K <= 1024. Both dimensions must be
  multiples of 16, as torchao requires too.

  Example:
    advisor.torchao_pays(1536, 384)  # True: more than 1024 inputs.
    advisor.torchao_pays(384, 1536)  # False: small both ways.
  """
  if k % 16 or n % 16:
    return False
  return not (n <= 4096 and k <= 1024)


def low_bit_format(scaling: str, four_bit: str = '') -> str:
  """The speed model's format (`speed.LOW_BIT_FORMATS`) for fp8 at
  `scaling` ('current', 'delayed', 'mx') or a 4-bit format."""
  if four_bit:
    return four_bit
  return {'current': 'fp8_current', 'delayed': 'fp8_delayed',
          'mx': 'mxfp8'}[scaling]


def choose(linears: Sequence[LinearShape], fmt: str, gpu_name: str = '',
           assumptions: gpus.Assumptions = gpus.Assumptions()
           ) -> list[Choice]:
  """Each Linear's choice for low-bit format `fmt` (`speed.LOW_BIT_FORMATS`)
  on GPU `gpu_name` ('' for none named: torchao's rule). A GPU without the
  format's tensor cores runs none of them in it.

  Example:
    choices = advisor.choose_low_bit(
        [advisor.LinearShape('mlp/~/linear_0', 65536, 4096, 16384)],
        'fp8_current', 'h100')
    paths = [c.linear.path for c in choices if c.low_bit]  # LowBit(paths)
  """
  errors.check_choice('fmt', fmt, tuple(speed.LOW_BIT_FORMATS))
  if not gpu_name:
    return [Choice(l, torchao_pays(l.k, l.n), None, TORCHAO_RULE)
            for l in linears]
  gpu = gpus.gpu(gpu_name)
  choices = []
  for l in linears:
    gained = speed.gain(l.m, l.k, l.n, fmt, gpu, assumptions,
                        l.compute_bytes)
    choices.append(Choice(l, gained is not None and gained > 1, gained,
                          gpu.name))
  return choices
