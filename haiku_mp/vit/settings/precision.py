"""Precision: jmp policies, matmul forms, the training state's layout and
the low-bit matmuls (haiku_mp/model/policies.py, fp8.py, fp4.py)."""

from haiku_mp import errors
from haiku_mp.advisor import gpus
from haiku_mp.model import fp4 as fp4_lib
from haiku_mp.update import optimizer as optimizer_lib
from haiku_mp.update import param_updates
from haiku_mp.vit.settings import fields
from haiku_mp.vit.settings.fields import group
from haiku_mp.vit.settings.fields import setting

# The low-bit formats: fp8, or one of the 4-bit ones.
FP8_FORMAT = 'fp8'
FORMATS = (FP8_FORMAT,) + fp4_lib.FORMATS
# `modules`' value that lets the speed model choose the Linears.
AUTO = 'auto'


def chooses_modules(low_bit) -> bool:
  """Whether `precision.low_bit` (its settings, or a config's ConfigDict)
  lets the speed model choose the Linears (`modules='auto'`)."""
  return low_bit.modules.strip() == AUTO


@fields.frozen
class LowBitSettings:
  """Low-bit matmuls: which Linears, their format (fp8, or 4 bits) and
  scaling."""

  modules: str = setting(
      '',
      "'TARGET;...': class names or path globs (a glob selects the "
      "Linears inside a module too, e.g. '*/encoder_block_*'); 'auto': "
      'the Linears predicted to gain on `gpu` (docs/speed.md); \'\': off.')
  gpu: str = setting(
      '',
      "With modules='auto': the GPU whose predicted times choose the "
      f"Linears, one of {gpus.NAMES}; '': torchao's shape rule (for a GPU "
      'the speed model does not know).',
      check=fields.one_of(('',) + gpus.NAMES))
  scaling: str = setting(
      'current',
      "'current' (each tensor's amax this step), 'delayed' (the max of "
      "its last history_length amaxes) or 'mx' (MXFP8 blocks of 32).")
  history_length: int = setting(16, 'delayed: amaxes kept per tensor (>= 1).')
  margin: float = setting(0.0, 'Scales leave amax * 2**margin in range (>= 0).')
  format: str = setting(
      'fp8',
      "'fp8' (E4M3 forward, E5M2 gradients; haiku_mp/model/fp8.py), or 4 "
      "bits, emulated (haiku_mp/model/fp4.py): 'nvfp4' (E2M1 in blocks of "
      "16 with E4M3 scales) or 'mxfp4' (blocks of 32, E8M0 scales); 4 bits "
      "take scaling 'current'.", check=fields.one_of(FORMATS))
  two_d_weights: bool = setting(
      True,
      '4 bits: weights in 2-D tiles (16x16 / 32x32) shared by the forward '
      "and the input gradient's GEMM.")
  hadamard: bool = setting(
      True,
      "4 bits: a random 16x16 Hadamard transform on the weight gradient's "
      'GEMM inputs, along the tokens.')
  stochastic_gradients: bool = setting(
      True,
      '4 bits: output gradients rounded stochastically (unbiased, but for '
      'values an NVFP4 block saturates at 6).')
  keep_fp8: str = setting(
      '',
      "4 bits: 'TARGET;...' among `modules` whose Linears keep fp8 (E4M3 "
      "/ E5M2, current scaling), as the advisor suggests; '': none.")

  def check_rules(self, path: str) -> None:
    """A GPU chooses the Linears only where the speed model may."""
    if self.gpu and not chooses_modules(self):
      raise errors.ConfigError(
          f'{path}gpu={self.gpu} chooses the low-bit Linears only with '
          f"{path}modules='auto' (now {self.modules!r}); set modules=auto, "
          "or gpu=''")


@fields.frozen
class PrecisionSettings:
  """Dtypes of params, activations, matmuls and optimizer state."""

  policy: str = setting(
      'params=float32,compute=float32,output=float32',
      'jmp policy of the model class; its compute dtype is the '
      "activations'.")
  overrides: str = setting(
      '',
      "'TARGET:POLICY;...': TARGET is a module class name or a path glob.")
  float32_layer_norm: bool = setting(
      True,
      'LayerNorm in float32 under any policy.')
  matmul_precision: str = setting(
      '',
      "A jax.default_matmul_precision name for every matmul ('highest', "
      "'tensorfloat32', ...); '' keeps JAX's default.")
  residual_stream: str = setting(
      'compute',
      "'compute': the residual stream in the compute dtype; 'float32': "
      "kept in float32 (Megatron's fp32 residual), the branches still in "
      'compute.')
  dot_form: str = setting(
      'auto',
      "How matmuls with half operands run: 'auto' (the fastest form "
      "measured for the backend and, on a CPU, its bf16 instructions), "
      "'native' (half x half -> float32 sums, "
      "rounded once), 'upcast' (operands converted to float32 first) or "
      "'plain' (Haiku's and JAX's own half x half -> half). Float32 "
      'matmuls are never changed.')
  dot_platform: str = setting(
      '',
      "The backend whose kernels 'auto' and the weight gradients' layout "
      "are chosen for: '' the one JAX runs on, or 'cpu' / 'gpu' / 'tpu' "
      "to trace the program another backend would run (a GPU's, read on a "
      'CPU).')
  param_update: str = setting(
      'master',
      "The training state's layout (docs/precision.md): how params take "
      "an update. 'master': float32 params, or half params rounded from a "
      'float32 master copy the optimizer keeps. Without that copy '
      "(bfloat16 params), each step's float32 result rounded into them: "
      "'nearest', 'stochastic' (unbiased, drawn from the run's key) or "
      "'kahan' (to nearest, plus a bfloat16 buffer of what rounding "
      'dropped).', check=fields.one_of(param_updates.PARAM_UPDATES))
  mu_dtype: str = setting(
      'float32',
      "Adam's first moment: 'float32', 'bfloat16' (rounded "
      "stochastically) or 'float8_blocks' (8-bit E4M3 codes and a float32 "
      'scale per block, rounded stochastically; '
      'haiku_mp/update/block_moments.py).',
      check=fields.one_of(optimizer_lib.MOMENT_DTYPES))
  nu_dtype: str = setting('float32', "Adam's second moment: the same choices.",
                          check=fields.one_of(optimizer_lib.MOMENT_DTYPES))
  moment_block_size: int = setting(
      256,
      "'float8_blocks' moments: values per scale, along each param's last "
      "axis (torchao's 256: 0.016 bytes of scale per value).",
      check=fields.POSITIVE)
  low_bit: LowBitSettings = group(
      LowBitSettings,
      'Low-bit matmuls (docs/fp8.md) in the Linear layers of these modules: '
      'fp8 with float32 sums, or 4 bits, emulated.')


__all__ = ['LowBitSettings', 'PrecisionSettings']
