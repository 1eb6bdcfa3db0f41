"""Module targets, as the rules and the low-bit Linears name them: a module
class, a class name or a glob over module paths; `parse_targets` reads a
list of them, and `unmatched` is the error for one that matches no module,
with the nearest names the model has."""

import difflib
from typing import Sequence, Union

from haiku_mp.errors import literal
from haiku_mp.errors import quoted
from haiku_mp.model.precision_error import PrecisionError

# What a module target may be: a class name or path glob, or the class.
Target = Union[str, type]
_GLOB_CHARS = frozenset('*?[')
# How alike a class or path end must be to a target to be offered for it
# (difflib's ratio).
_NEAREST_CUTOFF = 0.6


def target_name(target: Target, setting: str) -> str:
  """A target as the rules match it: a module class by its name; one that
  is neither is an error naming `setting` (a `PrecisionError` template,
  `$overrides`)."""
  if isinstance(target, type):
    return target.__name__
  if not isinstance(target, str) or not target.strip():
    raise PrecisionError(f'{setting}: a target must be a module class, a '
                         f'class name or a path glob, not {quoted(target)}')
  return target.strip()


def parse_targets(targets: Union[str, Sequence[Target]],
                  setting: str = '$targets') -> tuple[str, ...]:
  """``'TARGET;...'``, or a sequence of classes and strings, as the rules'
  targets; a bad one named as `setting`'s (as `target_name` names it)."""
  if isinstance(targets, str) or targets is None:
    return tuple(t.strip() for t in (targets or '').split(';') if t.strip())
  return tuple(target_name(t, setting) for t in targets)


def _nearest(target: str, modules: set[tuple[str, str]]) -> list[str]:
  """The module classes and path ends closest in spelling to `target`, as
  targets (a path end as a glob, '*/linear_1')."""
  key = target.rsplit('/', 1)[-1].strip('*?')
  classes = {c for c, _ in modules}
  ends = {p.rsplit('/', 1)[-1] for _, p in modules} - classes
  close = difflib.get_close_matches(key, sorted(classes | ends), n=3,
                                    cutoff=_NEAREST_CUTOFF)
  return [c if c in classes else f'*/{c}' for c in close]


def unmatched(setting: str, target: str, modules: set[tuple[str, str]],
              why: str = '') -> PrecisionError:
  """The error for a `setting` target (a `PrecisionError` template:
  `$overrides`) that matches no module: one line naming it, the targets
  nearest to it and the model's classes; `why` is a template too."""
  paths = {p for _, p in modules}
  hint = ''
  if (not _GLOB_CHARS & set(target)
      and any(p.rsplit('/', 1)[-1] == target for p in paths)):
    hint = f" (for a module path ending in it, write '*/{literal(target)}')"
  nearest = _nearest(target, modules)
  near = f' Nearest: {literal(", ".join(nearest))}.' if nearest else ''
  classes = literal(', '.join(sorted({c for c, _ in modules})))
  return PrecisionError(
      f'{setting}: target {quoted(target)} matches no module class or module '
      f'path{hint}{why}.{near} Classes: {classes}')
