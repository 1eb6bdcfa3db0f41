"""Mixed-precision policies per Haiku module class and per module path.

A `Precision` maps modules to jmp policies. Its rules are resolved for every
module call, in this order:

1. a path override: the first `overrides` target that is an fnmatch glob
   matching the module's full path (e.g. ``*/head``);
2. a class override: an `overrides` target equal to the module's class name
   (e.g. ``Linear``, ``Attention``);
3. a class default: the main policy on the model's class, and a float32 policy
   on ``LayerNorm`` (statistics in float32, output cast back to the compute
   dtype so that the next matmul runs in half precision);
4. otherwise the module inherits the policy of the module that called it.

The semantics are those of `hk.mixed_precision`: a module with a policy casts its
floating inputs to the compute dtype and its outputs to the output dtype;
parameters are created in the param dtype of the innermost policy in force and
cast to its compute dtype when read. `hk.mixed_precision` keys policies on the
exact class, keeps one thread-local policy stack, and its parameter getter runs
outermost, so a per-instance policy cannot be layered on top of it (dm-haiku
issue #680). haiku_mp therefore applies class and path rules in one method
interceptor of its own (`interception.apply`), entered inside the transformed
function: nothing leaks into other models or threads once the function
returns.
`policies_test.py` checks that, for class-only rules, the traced program is the
one `hk.mixed_precision` produces.

Every place a dtype is decided in a step:

- `interception.apply`: params, module inputs and outputs (the policies);
- `half_dot`: every matmul takes compute-dtype operands and sums in float32,
  forward and backward, rounded once to the compute dtype (`dot_form` picks
  the form per backend);
- `vit.Attention`: logits and softmax in float32 (at least), their backward
  matmuls back in the operands' dtype;
- `vit.EncoderBlock`: each branch cast to the residual stream's dtype before
  the add; `vit.VisionTransformer`: cls token and position embedding cast to
  the activations', the stream in float32 under `residual_stream=float32`;
- `train_step`: the loss in float32 from whatever the logits are; gradients
  cast to float32 (at least) before unscaling and the finite check;
- `optimizer.float32_master`: a float32 master copy when params are half;
- `loss_scaling`: the scale itself is always float32 (jmp #47).
"""

import dataclasses
import fnmatch
from typing import Mapping, Optional, Union

import jax
import jax.numpy as jnp
import jmp

from haiku_mp import errors
from haiku_mp.errors import literal
from haiku_mp.errors import quoted
from haiku_mp.model import half_dot
from haiku_mp.model import low_bit as low_bit_lib
from haiku_mp.model import matmuls as matmuls_lib
from haiku_mp.model.policy_strings import as_policy
from haiku_mp.model.policy_strings import PolicyLike
from haiku_mp.model.precision_error import PrecisionError
from haiku_mp.model.targets import Target
from haiku_mp.model.targets import target_name
from haiku_mp.model.targets import unmatched

LAYER_NORM_CLASS = 'LayerNorm'
BATCH_NORM_CLASS = 'BatchNorm'


@dataclasses.dataclass(frozen=True)
class Rule:
  """One policy rule: `target` is a class name or a glob over module paths."""
  target: str
  policy: jmp.Policy
  source: str  # 'override' or 'default', shown by launch.tabulate.


def parse_overrides(overrides: Union[str, Mapping[Target, PolicyLike]]
                    ) -> tuple[Rule, ...]:
  """Override rules from ``'TARGET:POLICY;TARGET:POLICY'`` (the configs'
  form) or a mapping {target: policy}, targets as classes or strings."""
  if isinstance(overrides, Mapping):
    items = [(target_name(t, '$overrides'), p)
             for t, p in overrides.items()]
  else:
    items = []
    for item in (overrides or '').split(';'):
      item = item.strip()
      if not item:
        continue
      target, sep, policy_text = item.rpartition(':')
      if not sep or not target.strip():
        raise PrecisionError(
            f'$overrides: malformed entry {quoted(item)}; expected '
            "'TARGET:POLICY', e.g. '*/head:float32' or "
            "'Attention:p=f32,c=f32,o=bf16'")
      items.append((target.strip(), policy_text))
  rules = []
  for target, policy in items:
    if any(r.target == target for r in rules):
      raise PrecisionError(
          f'$overrides: target {quoted(target)} given twice')
    rules.append(Rule(target, as_policy(
        policy, f'$overrides[{quoted(target)}]'), 'override'))
  return tuple(rules)


@dataclasses.dataclass(frozen=True)
class Precision:
  """Which jmp policy each module of a model runs under, and how its matmuls
  run (`matmuls`); `make_precision` builds one.

  Example:
    precision = haiku_mp.make_precision(BF16, model_class=hk.nets.MLP)
    precision.rule_for('Linear', 'mlp/~/linear_0')  # None: inherits MLP's.
  """
  policy: jmp.Policy
  defaults: Mapping[str, Rule]
  overrides: tuple[Rule, ...] = ()
  # A `jax.default_matmul_precision` name for every matmul; None: JAX's default.
  matmul_precision: Optional[str] = None
  float32_residual: bool = False  # Residual stream in float32 (see vit.py).
  dot_form: str = 'auto'  # How half matmuls run (see half_dot.py).
  dot_platform: str = ''  # The backend they are traced for; '': JAX's.
  # The Linears on low-bit matmuls and their format; None: none.
  low_bit: Optional[low_bit_lib.LowBit] = None
  amax_axis: Optional[str] = None  # See `under_pmap`.
  # The model's outermost module class: every module runs inside it.
  model_class: str = ''
  # Whether a forward pass under `apply` has checked the targets (`check`):
  # once, at the end of the first, as a trace of the whole model.
  _checked: list[bool] = dataclasses.field(
      default_factory=list, init=False, compare=False, repr=False)

  @property
  def matmuls(self) -> matmuls_lib.Matmuls:
    return matmuls_lib.Matmuls(self.dot_form, self.matmul_precision,
                               self.dot_platform, self.low_bit,
                               self.amax_axis)

  def under_pmap(self, axis_name: str) -> 'Precision':
    """This precision for a forward pass traced inside `pmap` over
    `axis_name`: fp8 amaxes are reduced over its replicas, so that each
    scales as one device would (a forward outside pmap, as `init`, cannot
    name the axis)."""
    if self.low_bit is None:
      return self
    return dataclasses.replace(self, amax_axis=axis_name)

  def runs_low_bit(self, class_name: str, path: str) -> bool:
    return self.matmuls.runs_low_bit(class_name, path)

  def runs_fp4(self, class_name: str, path: str) -> bool:
    return self.matmuls.runs_fp4(class_name, path)

  def check_low_bit(self, modules: set[tuple[str, str]]) -> None:
    """Raises unless every low-bit target selects at least one Linear among
    the `(class, path)` modules, and every `keep_fp8` target one of those."""
    if self.low_bit is None:
      return
    for t in self.low_bit.modules:
      selected = [(c, p) for c, p in modules if low_bit_lib.selects((t,), c, p)]
      if not selected:
        raise unmatched('$low_bit.modules', t, modules)
      if not any(c == low_bit_lib.LOW_BIT_CLASS for c, _ in selected):
        raise PrecisionError(
            f'$low_bit.modules: target {quoted(t)} selects no '
            f'{low_bit_lib.LOW_BIT_CLASS} '
            f'({literal(", ".join(sorted({c for c, _ in selected})))}): only '
            f'{low_bit_lib.LOW_BIT_CLASS} layers run fp8 matmuls (the patch '
            "embedding's convolution and attention's batched dots cannot)")
    for t in self.low_bit.keep_fp8:
      if not any(low_bit_lib.selects((t,), c, p) and self.runs_low_bit(c, p)
                 for c, p in modules):
        raise PrecisionError(
            f'$low_bit.keep_fp8: target {quoted(t)} selects no '
            f'{low_bit_lib.LOW_BIT_CLASS} that $low_bit.modules runs in 4 bits')

  def rule_for(self, class_name: str, path: str) -> Optional[Rule]:
    """The module's own rule, or None when it inherits its caller's policy."""
    for rule in self.overrides:
      if fnmatch.fnmatchcase(path, rule.target):
        return rule
    for rule in self.overrides:
      if rule.target == class_name:
        return rule
    return self.defaults.get(class_name)

  @property
  def param_dtypes(self) -> set[str]:
    """The names of the dtypes the rules store params in."""
    rules = (*self.defaults.values(), *self.overrides)
    return {jnp.dtype(r.policy.param_dtype).name for r in rules}

  @property
  def half_params(self) -> bool:
    """Whether any rule stores params in a dtype narrower than float32."""
    return any(jnp.finfo(d).bits < 32 for d in self.param_dtypes)

  def check_overrides(self, modules: set[tuple[str, str]]) -> None:
    """Raises unless every override matched one of `(class, path)` modules."""
    classes = {c for c, _ in modules}
    paths = {p for _, p in modules}
    for rule in self.overrides:
      t = rule.target
      if t not in classes and not any(fnmatch.fnmatchcase(p, t)
                                      for p in paths):
        raise unmatched('$overrides', t, modules)

  def check(self, modules: set[tuple[str, str]]) -> None:
    """Raises one line naming the first target that matches none of the
    `(class name, path)` modules: `model_class`, an override, a low-bit
    target. `apply` runs it at the end of its first forward pass;
    call it yourself to check a precision against another model's modules.

    Example:
      precision.check({('MLP', 'mlp'), ('Linear', 'mlp/~/linear_0')})
    """
    if self.model_class and self.model_class not in {c for c, _ in modules}:
      raise unmatched('$model_class', self.model_class, modules,
                      ' (its policy would reach no module: the model would '
                      'run in float32)')
    self.check_overrides(modules)
    self.check_low_bit(modules)


RESIDUAL_STREAMS = ('compute', 'float32')


def _check_matmul_precision(name: str) -> Optional[str]:
  if not name:
    return None
  try:
    with jax.default_matmul_precision(name):
      pass
  except ValueError:
    raise PrecisionError(
        f'$matmul_precision: unknown value {quoted(name)}; expected one of '
        "'default', 'high', 'highest', 'bfloat16', 'tensorfloat32', 'float32' "
        "(or a jax dot algorithm name such as 'BF16_BF16_F32'), or '' for "
        "JAX's default") from None
  return name


def make_precision(policy: PolicyLike,
                   overrides: Union[str, Mapping[Target, PolicyLike]] = '',
                   *, model_class: Target,
                   float32_layer_norm: bool = True,
                   float32_batch_norm: bool = True, matmul_precision: str = '',
                   residual_stream: str = 'compute',
                   dot_form: str = 'auto', dot_platform: str = '',
                   low_bit: Optional[low_bit_lib.LowBit] = None
                   ) -> Precision:
  """Builds a `Precision` from jmp policies and module classes, or from the
  configs' strings.

  Example:
    precision = haiku_mp.make_precision(
        jmp.get_policy('p=f32,c=bf16,o=f32'), model_class=hk.nets.MLP)

  Args:
    policy: the main jmp policy (a `jmp.Policy` or its string), applied to
      the model class `model_class`.
    overrides: ``'TARGET:POLICY;...'``, or {target: policy}: class or path
      overrides (a target: a module class, its name, or a path glob).
    model_class: the model's top module class (or its name).
    float32_layer_norm: keep LayerNorm in float32 (output in compute dtype).
    float32_batch_norm: keep BatchNorm in float32, its moving statistics
      included (output in compute dtype), as Haiku's ImageNet example does.
    matmul_precision: a `jax.default_matmul_precision` name, '' for the default.
    residual_stream: 'compute' (the compute dtype) or 'float32'.
    dot_form: how matmuls with half operands run (`half_dot.FORMS`).
    dot_platform: the backend whose forms they take (`half_dot.PLATFORMS`;
      '' the one JAX runs on).
    low_bit: the Linear layers on low-bit matmuls, and their format
      (`LowBit`: fp8, or 4 bits); None for none.
  """
  main = as_policy(policy, '$policy')
  model_class = target_name(model_class, '$model_class')
  errors.check_choice('$residual_stream', residual_stream,
                      RESIDUAL_STREAMS, PrecisionError)
  defaults = {model_class: Rule(model_class, main, 'default')}
  # Normalization in float32: its statistics (and BatchNorm's moving
  # averages, its state) in float32, its output in the compute dtype so that
  # the next matmul runs in half precision.
  normalized = jmp.Policy(param_dtype=jnp.float32, compute_dtype=jnp.float32,
                          output_dtype=main.compute_dtype)
  for keep, class_name in ((float32_layer_norm, LAYER_NORM_CLASS),
                           (float32_batch_norm, BATCH_NORM_CLASS)):
    if keep:
      defaults[class_name] = Rule(class_name, normalized, 'default')
  if low_bit is not None and not low_bit.modules:
    if low_bit.keep_fp8:
      raise _keeps_fp8_without_4_bits()
    low_bit = None  # No Linear runs low-bit matmuls.
  if low_bit is not None and jnp.dtype(main.compute_dtype) == jnp.float16:
    raise PrecisionError(
        '$low_bit.modules: fp8 matmuls need a bfloat16 or float32 '
        'compute dtype, not float16 (the float16 loss scale on top of fp8 '
        "scales is not supported); use a 'compute=bfloat16' policy")
  if low_bit is not None and low_bit.keep_fp8 and low_bit.fp4 is None:
    raise _keeps_fp8_without_4_bits()
  return Precision(main, defaults, parse_overrides(overrides),
                   _check_matmul_precision(matmul_precision),
                   residual_stream == 'float32', half_dot.check_form(dot_form),
                   half_dot.check_platform(dot_platform), low_bit,
                   model_class=model_class)


def _keeps_fp8_without_4_bits() -> PrecisionError:
  return PrecisionError(
      '$low_bit.keep_fp8: keeps fp8 among 4-bit Linears; set '
      "$low_bit.format to 'nvfp4' or 'mxfp4' and $low_bit.modules")
