"""The model as pure functions: a ViT forward pass under a precision policy."""

import contextlib
import dataclasses
import math
import re
from typing import Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp

from haiku_mp import errors
from haiku_mp.advisor import placement
from haiku_mp.model import fp4 as fp4_lib
from haiku_mp.model import fp8 as fp8_lib
from haiku_mp.model import interception
from haiku_mp.model import low_bit as low_bit_lib
from haiku_mp.model import policies
from haiku_mp.vit.model import vit
from haiku_mp.vit.settings import LowBitSettings
from haiku_mp.vit.settings import ModelSettings
from haiku_mp.vit.settings import precision as precision_settings
from haiku_mp.vit.settings import Settings

# The settings a precision's library arguments come from: `make_precision`'s
# are `precision.` and the argument's name; those of the low-bit parts
# (`Fp8`, `Fp4` and its `check_dims`, `LowBit`, `from_parts`) these.
_LOW_BIT_PATHS = {
    name: 'precision.low_bit.' + name.rpartition('.')[2] for name in (
        'scaling', 'history_length', 'margin', 'format', 'modules',
        'keep_fp8', 'fp8.scaling', 'fp4.format')}


@contextlib.contextmanager
def _named_as_settings():
  """The library's errors about what the settings passed it (`ArgumentError`
  in its own words) with the settings' paths."""
  try:
    yield
  except errors.ArgumentError as error:
    raise error.named(_LOW_BIT_PATHS, prefix='precision.') from None


def precision_from_config(settings: Settings,
                          low_bit_modules: Optional[str] = None
                          ) -> policies.Precision:
  """The `Precision` that `settings.precision` describes for the ViT, its
  low-bit Linears `low_bit_modules` where given (`modules='auto'` without
  them: none; `checked_precision` chooses them)."""
  low_bit = settings.precision.low_bit
  modules = low_bit.modules
  if low_bit_modules is not None:
    modules = low_bit_modules
  elif precision_settings.chooses_modules(low_bit):
    modules = ''
  with _named_as_settings():
    # fp8's scaling is built (and checked) whether or not a Linear runs it.
    fp8 = fp8_lib.Fp8(low_bit.scaling, low_bit.history_length, low_bit.margin)
    return policies.make_precision(
        settings.precision.policy, settings.precision.overrides,
        model_class=vit.MODEL_CLASS,
        float32_layer_norm=settings.precision.float32_layer_norm,
        matmul_precision=settings.precision.matmul_precision,
        residual_stream=settings.precision.residual_stream,
        dot_form=settings.precision.dot_form,
        dot_platform=settings.precision.dot_platform,
        low_bit=low_bit_lib.from_parts(modules, fp8, make_fp4(low_bit),
                                       low_bit.keep_fp8))


_BLOCK_INDEX = re.compile(r'_\d+(?=/|$)')  # 'encoder_block_3' -> 'encoder_block_*'.


def merge_block_indices(path: str) -> str:
  """'vit/encoder_block_3/mlp_block/fc1' -> 'vit/encoder_block_*/mlp_block/fc1':
  the modules of every block as one, for lines and tables."""
  return _BLOCK_INDEX.sub('_*', path)


def low_bit_format(low_bit: LowBitSettings) -> str:
  """The speed model's format (`placement.low_bit_format`) of
  `precision.low_bit`: fp8 at its scaling, or its 4-bit format."""
  return placement.low_bit_format(
      low_bit.scaling, '' if low_bit.format == precision_settings.FP8_FORMAT
      else low_bit.format)


def make_fp4(low_bit: LowBitSettings) -> Optional[fp4_lib.Fp4]:
  """The 4-bit format `precision.low_bit.format` names, with the recipe's
  parts; None for fp8 itself."""
  if low_bit.format == precision_settings.FP8_FORMAT:
    return None
  return fp4_lib.Fp4(low_bit.format, low_bit.two_d_weights, low_bit.hadamard,
                     low_bit.stochastic_gradients)


def make_forward(model_config: ModelSettings,
                 precision: policies.Precision,
                 observer: Optional[interception.Observer] = None,
                 remat: str = 'none') -> hk.Transformed:
  """`forward(images, is_training) -> logits` transformed, with `precision`
  applied and `remat` (`remat.CHOICES`, checked where each block is
  wrapped) per encoder block."""
  # The ViT takes every field of the model settings.
  kwargs = {f.name: getattr(model_config, f.name)
            for f in dataclasses.fields(ModelSettings)}
  kwargs['float32_residual'] = precision.float32_residual
  kwargs['matmuls'] = precision.matmuls
  kwargs['remat'] = remat

  def forward(images: jax.Array, is_training: bool) -> jax.Array:
    with interception.apply(precision, observer):
      return vit.VisionTransformer(**kwargs)(images, is_training)

  return hk.transform(forward)


def dummy_images(model_config: ModelSettings,
                 batch_size: int = 1) -> jax.Array:
  size = model_config.image_size
  return jnp.zeros((batch_size, size, size, 3), jnp.float32)


def trace_modules(model_config: ModelSettings,
                  precision: policies.Precision,
                  batch_size: int = 1
                  ) -> tuple[list[interception.ModuleCall], hk.Params]:
  """Every module call of one forward pass and the params' shapes and dtypes.

  Traced abstractly with `jax.eval_shape`: no FLOPs, no memory for params.
  """
  calls = []
  forward = make_forward(model_config, precision, calls.append)
  images = dummy_images(model_config, batch_size)
  params = jax.eval_shape(
      lambda: forward.init(jax.random.key(0), images, True))
  return calls, params


def checked_precision(settings: Settings,
                      precision: Optional[policies.Precision] = None,
                      batch_devices: int = 1
                      ) -> tuple[policies.Precision,
                                 list[interception.ModuleCall],
                                 list[placement.Choice]]:
  """The Precision `settings` describe (`precision`, where already built), the
  module calls of one (abstract) forward pass, whose end checks every
  override and low-bit target against them (`interception.apply`, once per
  Precision), and with `precision.low_bit.modules='auto'` each Linear's
  choice (`low_bit_choices`; else none), the Precision then the one that
  runs them (checked at its own first forward pass: the run's initial
  state, as `build` makes it). A Linear's tokens are those of one device of
  the `batch_devices` the batch is split over: each runs the GEMMs of its
  own examples."""
  precision = precision or precision_from_config(settings)
  with _named_as_settings():  # Its end checks the targets.
    calls, _ = trace_modules(settings.model, precision)
  choices = []
  if precision_settings.chooses_modules(settings.precision.low_bit):
    choices = low_bit_choices(settings, calls,
                              settings.batch_size // batch_devices)
    # The calls stay those traced: which Linears run low-bit changes no
    # module's inputs or outputs, only the GEMMs inside.
    precision = precision_from_config(settings, ';'.join(
        c.linear.path for c in choices if c.low_bit))
  if precision.low_bit is not None and precision.low_bit.fp4 is not None:
    with _named_as_settings():
      _check_fp4_tokens(precision, calls,
                        settings.batch_size // batch_devices)
  return precision, calls, choices


def linear_shapes(calls: list[interception.ModuleCall],
                  batch_size: int) -> list[placement.LinearShape]:
  """Every Linear of a forward pass traced at batch 1, as its GEMMs see it
  at `batch_size`."""
  found = []
  for c in calls:
    if (c.class_name == low_bit_lib.LOW_BIT_CLASS
        and c.method == '__call__'):
      x = c.args[0][0]
      found.append(placement.LinearShape(
          c.path, math.prod(x.shape[:-1]) * batch_size, x.shape[-1],
          c.output.shape[-1], jnp.dtype(x.dtype).itemsize))
  return found


def low_bit_choices(settings: Settings, calls: list[interception.ModuleCall],
                    batch_size: int) -> list[placement.Choice]:
  """Which Linears `precision.low_bit.modules='auto'` runs in its format:
  those predicted faster in it on `precision.low_bit.gpu`, at the
  `batch_size` one device runs (docs/speed.md)."""
  low_bit = settings.precision.low_bit
  return placement.choose(linear_shapes(calls, batch_size),
                          low_bit_format(low_bit), low_bit.gpu)


def choice_lines(low_bit: LowBitSettings,
                 choices: Sequence[placement.Choice],
                 compute_dtype) -> list[str]:
  """For a run's start, with `precision.low_bit.modules='auto'`: the
  choice for each Linear and why, Linears of one shape and choice in
  encoder blocks merged into one line; none without choices."""
  if not choices:
    return []
  fmt = low_bit_format(low_bit)
  chosen = sum(c.low_bit for c in choices)
  where = (f'predicted on the {low_bit.gpu}' if low_bit.gpu else
           f'{placement.TORCHAO_RULE}, no precision.low_bit.gpu named')
  lines = [f'Low-bit matmuls where they pay (precision.low_bit.modules='
           f"auto, {fmt}, {where}): {chosen} of {len(choices)} Linears"]
  merged: dict[tuple, list[placement.Choice]] = {}
  for c in choices:
    key = (merge_block_indices(c.linear.path), c.linear.m, c.linear.k,
           c.linear.n, c.low_bit)
    merged.setdefault(key, []).append(c)
  compute = jnp.dtype(compute_dtype).name
  for (path, *_, low), group in merged.items():
    if len(group) > 1:
      path = f'{path} (x{len(group)})'
    else:
      path = group[0].linear.path
    runs = fmt if low else f'stays {compute}'
    lines.append(f'  {path}: {runs}; {group[0].why(fmt)}')
  if not chosen:
    lines.append(f'  No Linear pays: the run has no low-bit matmul '
                 f'(everything in {compute})')
  return lines


def _check_fp4_tokens(precision: policies.Precision,
                      calls: list[interception.ModuleCall],
                      batch_size: int) -> None:
  """Each 4-bit Linear's tokens per step on a device (its input rows at
  batch 1, traced, times the device's batch) a whole number of blocks."""
  for c in calls:
    if c.method == '__call__' and precision.runs_fp4(c.class_name, c.path):
      x = c.args[0][0]
      rows = math.prod(x.shape[:-1]) * batch_size
      w_out = c.output.shape[-1]
      fp4_lib.check_dims(precision.low_bit.fp4, c.path, rows, x.shape[-1],
                         w_out)


def checked_forward(settings: Settings
                    ) -> tuple[hk.Transformed, policies.Precision]:
  """The forward function for `settings` and its Precision, the overrides
  checked (the model alone; a whole run is `experiment.build`)."""
  precision, _, _ = checked_precision(settings)
  return (make_forward(settings.model, precision, remat=settings.remat),
          precision)
