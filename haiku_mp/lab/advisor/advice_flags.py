"""The flags that paste an advice into `launch.train`'s config: the
advisor (the library) says what a model's loss scale and low-bit Linears
should be, these are the settings that make a ViT run so."""

from typing import Any

from haiku_mp.advisor import fp8_numerics
from haiku_mp.advisor import matmul_formats


def _flag_value(value: Any) -> str:
  """`value` as a command line gives it back exactly: a power of two
  2.0**25 as 33554432, not `:g`'s 3.35544e+07 (which pastes as 33554400)."""
  if isinstance(value, float):
    return str(int(value)) if value.is_integer() else repr(value)
  return str(value)


def loss_scale_flags(settings: dict[str, Any]) -> list[str]:
  """`--config.loss_scale.*` flags that set `settings` (a
  `verdicts.loss_scale`) exactly."""
  return [f'--config.loss_scale.{k}={_flag_value(v)}'
          for k, v in settings.items()]


def low_bit_flags(fmt: matmul_formats.MatmulFormat, choice: str
                  ) -> list[str]:
  """The flags beside `precision.low_bit.modules` that select `fmt`'s
  `choice`: fp8 at that scaling, or that 4-bit format, its Linears kept in
  fp8 at the scaling it falls back on."""
  if fmt.name == fp8_numerics.Fp8Matmuls.name:
    low_bit_format, scaling = 'fp8', choice
  else:
    low_bit_format, scaling = choice, fmt.fallback_choice
  return [f'--config.precision.low_bit.format={low_bit_format}',
          f'--config.precision.low_bit.scaling={scaling}']
