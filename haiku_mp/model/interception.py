"""A `Precision` applied to the Haiku modules called inside a context: one
method interceptor of haiku_mp's own (`apply`) that casts each module's
params, inputs and outputs by the policy in force (`policies`) and runs its
matmuls as the precision says (`matmul_modules.intercepted`)."""

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import jmp

from haiku_mp.errors import literal
from haiku_mp.errors import quoted
from haiku_mp.model import matmul_modules
from haiku_mp.model import meta_params
from haiku_mp.model import policies
from haiku_mp.model.precision_error import PrecisionError
from haiku_mp.model import recording

_META = frozenset(meta_params.META_NAMES)


@dataclasses.dataclass(frozen=True)
class ModuleCall:
  """What `apply` saw of one module method call (for tables and tests)."""
  path: str
  class_name: str
  method: str
  rule: Optional[policies.Rule]
  policy: Optional[jmp.Policy]  # the policy in force: own rule or inherited.
  args: Any
  output: Any


Observer = Callable[[ModuleCall], None]


@contextlib.contextmanager
def apply(precision: policies.Precision, observer: Optional[Observer] = None):
  """Applies `precision` to the Haiku modules called inside the context.

  Use inside a function passed to `hk.transform`. `observer`, if given, is
  called once per module method call with the cast inputs and outputs.
  Every `hk.Linear` and `hk.Conv2D` called inside, stock or haiku_mp's, runs
  its matmul as `precision.matmuls` says (`matmul_modules.intercepted`;
  a convolution other than a patch embedding runs Haiku's own, as does a
  subclass that overrides `__call__`: `describe` names them). Haiku state
  is kept in float32 whatever the policy's param dtype, unless an override
  sets the module's.

  Example:
    with haiku_mp.apply_precision(precision):
      logits = hk.nets.MLP([64, 10])(images.reshape(len(images), -1))
  """
  recording.applied(precision)
  stack: list[jmp.Policy] = []
  matmuls = precision.matmuls
  # What the first forward pass called, for `Precision.check`: (class,
  # path) of every module, and the calls that ran under no policy.
  modules: set[tuple[str, str]] = set()
  outside: list[tuple[str, str]] = []

  # The dtype Haiku state is kept in, per policy on `stack`: float32 (a
  # moving average in half precision loses its small steps, the VQ-VAE's
  # codebook counts their epsilon), or an override's param dtype where one
  # applies (`Precision.overrides`).
  state_dtypes: list = []

  def param_creator(next_creator, shape, dtype, init, context):
    # Params in the policy's param dtype; fp8 amax histories stay float32
    # whatever the policy (`meta_params.META_NAMES`).
    if jnp.issubdtype(dtype, jnp.floating) and context.name not in _META:
      dtype = stack[-1].param_dtype
    return next_creator(shape, dtype, init)

  def state_creator(next_creator, shape, dtype, init, context):
    del context
    if jnp.issubdtype(dtype, jnp.floating):
      dtype = state_dtypes[-1]
    return next_creator(shape, dtype, init)

  def setter(next_setter, value, context):
    # State keeps the dtype it was created in (`state_creator`): a module
    # that computes in half precision sets it from half values.
    del context
    if jnp.issubdtype(jnp.result_type(value), jnp.floating):
      value = jnp.asarray(value).astype(state_dtypes[-1])
    return next_setter(value)

  def getter(next_getter, value, context):
    if context.name in _META:
      return next_getter(value)
    return next_getter(stack[-1].cast_to_compute(value))

  def interceptor(next_f, args, kwargs, context: hk.MethodContext):
    if context.method_name == '__init__':  # The module has no path yet.
      return next_f(*args, **kwargs)
    module = context.module
    class_name = type(module).__name__
    rule = precision.rule_for(class_name, module.module_name)
    modules.add((class_name, module.module_name))
    if rule is None and not stack:
      outside.append((class_name, module.module_name))
    if rule is None and stack and isinstance(module, _MATMUL_MODULES):
      # The input a module with a rule of its own would take: one made
      # inside the model after its policy cast it (integer images divided
      # by 255; the float32 output of a module kept in float32) would else
      # fail a convolution on mixed dtypes, or run a dot in float32.
      args, kwargs = stack[-1].cast_to_compute((args, kwargs))
    with contextlib.ExitStack() as ctx:
      if rule is not None:
        if not stack:
          ctx.enter_context(hk.custom_creator(param_creator))
          ctx.enter_context(hk.custom_creator(state_creator, params=False,
                                              state=True))
          ctx.enter_context(hk.custom_getter(getter, state=True))
          ctx.enter_context(hk.custom_setter(setter))
        stack.append(rule.policy)
        ctx.callback(stack.pop)
        state_dtypes.append(
            rule.policy.param_dtype
            if any(rule is o for o in precision.overrides) else jnp.float32)
        ctx.callback(state_dtypes.pop)
        args, kwargs = rule.policy.cast_to_compute((args, kwargs))
      out = matmul_modules.intercepted(matmuls, next_f, args, kwargs, context)
      if rule is not None:
        out = rule.policy.cast_to_output(out)
      if observer is not None:
        observer(ModuleCall(module.module_name, class_name,
                            context.method_name, rule,
                            stack[-1] if stack else None, (args, kwargs), out))
      return out

  with contextlib.ExitStack() as ctx:
    if precision.matmul_precision is not None:
      ctx.enter_context(jax.default_matmul_precision(precision.matmul_precision))
    ctx.enter_context(hk.intercept_methods(interceptor))
    yield
  if not precision._checked:  # pylint: disable=protected-access
    _check_first_pass(precision, modules, outside)
    precision._checked.append(True)  # pylint: disable=protected-access


# Modules whose Haiku call takes its input in its params' dtype: a
# convolution refuses a mix of dtypes, a dot promotes it to float32.
_MATMUL_MODULES = (hk.Linear, hk.ConvND, hk.ConvNDTranspose,
                   hk.DepthwiseConv1D, hk.DepthwiseConv2D,
                   hk.DepthwiseConv3D)


def _check_first_pass(precision: policies.Precision, modules: set[tuple[str, str]],
                      outside: list[tuple[str, str]]) -> None:
  """`precision.check` of what one forward pass called, and no module
  called outside `model_class` (it would run under no policy)."""
  if not modules:
    return  # Nothing called under `apply`: nothing to check against.
  precision.check(modules)
  if outside and precision.model_class:
    class_name, path = outside[0]
    raise PrecisionError(
        f'$model_class: module {quoted(path)} ({literal(class_name)}) is '
        f'called outside {quoted(precision.model_class)} and would run under '
        'no policy; make $model_class the outermost module, or give it its '
        f"own rule in $overrides (e.g. '{literal(path)}:p=f32,c=bf16,o=f32')")
