"""A jmp policy as the configs write it: `parse_policy` reads one, checked;
`with_dtypes` writes one with a dtype changed; `policy_str` shows one."""

from typing import Optional, Union

import jax.numpy as jnp
import jmp

from haiku_mp.errors import literal
from haiku_mp.errors import quoted
from haiku_mp.model.precision_error import PrecisionError

# A policy: a jmp policy string, or the jmp.Policy itself.
PolicyLike = Union[str, jmp.Policy]


def parse_policy(text: str, setting: str = '$policy') -> jmp.Policy:
  """Parses a jmp policy string (``params=float32,compute=bfloat16,...``),
  with an error that names `setting`: a `PrecisionError` template, by
  default the argument `$policy` (a caller's name for it stays as written
  where it has no `$`).

  Example:
    policy = haiku_mp.parse_policy('p=f32,c=bf16,o=f32')
    policy.compute_dtype  # bfloat16
  """
  if not isinstance(text, str) or not text.strip():
    raise PrecisionError(f'{setting}: empty policy string {quoted(text)}')
  try:
    return jmp.get_policy(text.strip())
  except (ValueError, KeyError) as e:
    raise PrecisionError(
        f'{setting}: invalid policy string {quoted(text)} ({literal(str(e))}); '
        "expected e.g. 'params=float32,compute=bfloat16,output=float32' or "
        "'p=f32,c=f16,o=f32'") from None


def as_policy(policy: PolicyLike, setting: str) -> jmp.Policy:
  """`policy` as a jmp.Policy: itself, or its string parsed as `setting`."""
  if isinstance(policy, jmp.Policy):
    return policy
  return parse_policy(policy, setting)


def with_dtypes(policy: PolicyLike, setting: str = '$policy',
                **dtypes: Optional[str]) -> str:
  """`policy` as a string, with the dtypes named (`params`, `compute`,
  `output`; None keeps one) changed: the one way to write a policy that
  differs from another in a dtype. Checked as `setting` (as
  `parse_policy` names it)."""
  unknown = set(dtypes) - {'params', 'compute', 'output'}
  if unknown:
    raise TypeError(f'with_dtypes: no dtype {sorted(unknown)}')
  policy = as_policy(policy, setting)
  names = dict(params=policy.param_dtype, compute=policy.compute_dtype,
               output=policy.output_dtype)
  names = {part: jnp.dtype(dtype).name for part, dtype in names.items()}
  names.update({part: d for part, d in dtypes.items() if d is not None})
  text = ','.join(f'{part}={d}' for part, d in names.items())
  parse_policy(text, setting)
  return text


def policy_str(policy: Optional[jmp.Policy]) -> str:
  """jmp's own description of a policy, e.g. ``p=f32,c=bf16,o=f32``, with
  float32 written as in policy strings (jmp writes it `full`)."""
  if policy is None:
    return 'none'
  return str(policy).replace('=full', '=f32')
