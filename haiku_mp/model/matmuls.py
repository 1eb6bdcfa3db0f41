"""How a model's matmuls run: `Matmuls`, every matmul setting in one value.

The form half operands take and the `jax.default_matmul_precision` name in
force (`half_dot`), the backend the forms are chosen for, and which `Linear`
layers run low-bit matmuls (`low_bit`); `matmul_modules` runs them.
"""

import dataclasses
from typing import Optional

import jax

from haiku_mp.model import half_dot
from haiku_mp.model.low_bit import LOW_BIT_CLASS
from haiku_mp.model.low_bit import LowBit
from haiku_mp.model.low_bit import selects


@dataclasses.dataclass(frozen=True)
class Matmuls:
  """How a model's matmuls run: the form for half operands and the
  `jax.default_matmul_precision` name in force (None: JAX's default), which
  the backward pass, traced later and outside it, must use as well; and which
  `Linear` layers run low-bit matmuls, in what format (`low_bit`).
  A `Precision` makes them (`precision.matmuls`) for every Linear it applies to.

  Example:
    matmuls = haiku_mp.Matmuls('native')  # Half operands, float32 sums.
    y = matmuls.einsum('ni,io->no', x.astype(jnp.bfloat16),
                       w.astype(jnp.bfloat16))
  """
  form: str = 'auto'
  matmul_precision: Optional[str] = None
  # The backend the forms are chosen for; '': the one JAX runs on.
  platform: str = ''
  # The Linears on low-bit matmuls and their format; None: none.
  low_bit: Optional[LowBit] = None
  # The pmap axis over which fp8 amaxes are reduced (`Precision.under_pmap`).
  amax_axis: Optional[str] = None

  @property
  def backend(self) -> str:
    return self.platform or jax.default_backend()

  def runs_low_bit(self, class_name: str, path: str) -> bool:
    """Whether the Linear runs low-bit matmuls: fp8, or 4 bits where
    `runs_fp4` says so."""
    return (self.low_bit is not None and class_name == LOW_BIT_CLASS
            and selects(self.low_bit.modules, class_name, path))

  def runs_fp4(self, class_name: str, path: str) -> bool:
    """Whether the Linear's low-bit matmuls are 4-bit ones."""
    return (self.runs_low_bit(class_name, path)
            and self.low_bit.fp4 is not None
            and not selects(self.low_bit.keep_fp8, class_name, path))

  def einsum(self, spec: str, a: jax.Array, b: jax.Array,
             out_dtype=None) -> jax.Array:
    """`jnp.einsum(spec, a, b)` accumulated in float32 (at least), returned in
    `out_dtype` (default: the operands' dtype): `half_dot.einsum` in this
    form and matmul precision."""
    return half_dot.einsum(spec, a, b, self.form, self.matmul_precision,
                           self.backend, out_dtype)

