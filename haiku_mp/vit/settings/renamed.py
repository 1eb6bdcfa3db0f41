"""Settings under an old name (0.1's) still read, each with a one-line note
of the new one: on the command line, in a config file, and in the
config.json of a run written before the rename (so that it resumes).

The ConfigDict that config files and flags change holds each old group as a
copy of the new one's defaults (a locked ConfigDict takes no other name);
the parse moves what was changed there to the new name.
"""

from typing import Any, Callable, Mapping

from haiku_mp import errors

# Old group path -> the new one.
GROUPS = {'precision.fp8': 'precision.low_bit'}


def _at(tree: Mapping[str, Any], path: str) -> Any:
  for name in path.split('.'):
    if not isinstance(tree, Mapping) or name not in tree:
      return None
    tree = tree[name]
  return tree


def add_old_names(config: dict[str, Any]) -> dict[str, Any]:
  """`config` (the defaults' plain dict) with each old group beside the new
  one, holding the same defaults."""
  for old, new in GROUPS.items():
    parent, _, name = old.rpartition('.')
    _at(config, parent)[name] = dict(_at(config, new))
  return config


def to_new_names(values: Mapping[str, Any], defaults: Mapping[str, Any],
                 note: Callable[[str], None]) -> dict[str, Any]:
  """`values` (a config's tree) as plain dicts with each old group's changed
  fields moved to the new group; `note` is told each moved name once. A
  field set under both names, to different values, is a ConfigError."""
  tree = _plain(values)
  for old, new in GROUPS.items():
    parent, _, name = old.rpartition('.')
    holder = _at(tree, parent)
    if not isinstance(holder, dict) or name not in holder:
      continue
    given = holder.pop(name)
    default = _at(defaults, new)
    target = _at(tree, new)
    if target is None:
      new_parent, _, new_name = new.rpartition('.')
      target = _at(tree, new_parent).setdefault(new_name, {})
    for field, value in given.items():
      if field in default and value == default[field]:
        continue  # Left at its default: nothing to move.
      if field in target and target[field] not in (default.get(field), value):
        raise errors.ConfigError(
            f'{old}.{field}={value!r} and {new}.{field}={target[field]!r}: '
            f'{old} is the old name of {new}; set {new}.{field} only')
      target[field] = value
      if field in default:  # A name the group never had fails the parse.
        note(f'{old}.{field} is now {new}.{field} (the old name still works)')
  return tree


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
  """A ConfigDict or mapping as nested plain dicts."""
  return {k: _plain(v) if hasattr(v, 'items') else v
          for k, v in values.items()}
