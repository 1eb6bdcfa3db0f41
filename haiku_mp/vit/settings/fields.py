"""The schema's machinery: a documented field, and the parse of a config's
values into frozen settings with the field's type.

Written here rather than taken from ml_collections: its ConfigDict infers a
field's type from its first value and keeps no documentation, and its
`config_dict.create`/`FieldReference` give neither a frozen typed object nor
a one-line error naming the setting.
"""

import dataclasses
import typing
from typing import Any, Callable, Iterator, Mapping, Optional, TypeVar

import ml_collections

from haiku_mp import errors

T = TypeVar('T')


# A field's own check: None for a value it takes, else what the value must
# be ('must be >= 0', or ': expected ...'), said after `name=value`.
Check = Callable[[Any], Optional[str]]


class _AfterName(str):
  """A problem said after the setting's name alone (`name: unknown value
  ...`): the message `errors.check_choice` gives, which names the value
  itself."""


def setting(default: Any, doc: str, takes: str = '',
            check: Optional[Check] = None) -> Any:
  """A field with its default and the one doc `--help` shows for it;
  `takes`, what a value of another type is told it should be (else its
  type's name); `check`, the rule its values keep, declared with it and
  run once, when a config is parsed. The rules between fields a settings
  class declares in its `check_rules(self, path)`, run after its fields'
  own checks."""
  return dataclasses.field(default=default, metadata={
      'doc': doc, 'takes': takes, 'check': check})


def POSITIVE(value) -> Optional[str]:  # pylint: disable=invalid-name
  """The check of a setting that counts something (steps, examples,
  sizes)."""
  return None if value > 0 else 'must be positive'


def rule(ok: Callable[[Any], bool], valid: str) -> Check:
  """The check `value must be {valid}` where `ok(value)` is false."""
  return lambda value: None if ok(value) else f'must be {valid}'


def at_least(low: float) -> Check:
  return lambda value: None if value >= low else f'must be >= {low:g}'


def between(low: float, high: float) -> Check:
  return lambda value: (None if low <= value <= high
                        else f'must be in [{low:g}, {high:g}]')


def worded(ok: Callable[[Any], bool], words: Callable[[Any], str]) -> Check:
  """The check whose message after the setting's name is `words(value)`,
  whole, where `ok(value)` is false: for messages that show the value
  themselves (`: must be > 1, got 1.0`, `=2.0 must be in (0, 1)`)."""
  return lambda value: None if ok(value) else _AfterName(words(value))


def one_of(choices: tuple[str, ...]) -> Check:
  """The check of a setting that names one of `choices`, worded as
  `errors.check_choice` words it."""
  return lambda value: None if value in choices else _AfterName(
      f': unknown value {value!r}; expected one of {tuple(choices)}')


def group(kind: type, doc: str = '') -> Any:
  """A field holding a group of settings (its own frozen dataclass)."""
  return dataclasses.field(default_factory=kind, metadata={'doc': doc})


def doc_of(field: dataclasses.Field) -> str:
  return field.metadata.get('doc', '')


def takes(kind: type, name: str) -> str:
  """What the field `name` of `kind` takes, as its errors say it."""
  return {f.name: f for f in dataclasses.fields(kind)}[name].metadata.get(
      'takes', '')


def shown(value: Any) -> str:
  """A value as a message shows it: floats short, strings quoted, and a word
  the command line made a tuple of (`4x2` -> ('4x2',)) as the word typed."""
  if isinstance(value, float):
    return f'{value:g}'
  if isinstance(value, str):
    return repr(value)
  if (isinstance(value, (tuple, list)) and len(value) == 1 and
      isinstance(value[0], str)):
    return repr(value[0])
  return str(tuple(value) if isinstance(value, list) else value)


def _hints(kind: type) -> dict[str, Any]:
  """Each field's type, resolved (a field's `type` may be a string)."""
  return typing.get_type_hints(kind)


def parse(kind: type[T], values: Mapping[str, Any] | None,
          path: str = '', /) -> T:
  """`values` (a ConfigDict, a dict from config.json, ...) as a `kind`.

  Each field takes its value converted to the field's type: an int where a
  float is asked, a list where a tuple is; a field `values` lacks keeps its
  default (a config written before the field existed still parses). A value
  of another type, a name the schema does not hold, a value its field's
  check refuses, or settings a group's `check_rules` refuses, raises a
  ConfigError naming the setting.
  """
  values = {} if values is None else values
  hints = _hints(kind)
  fields = {f.name: f for f in dataclasses.fields(kind)}
  unknown = sorted(set(values.keys()) - set(fields))
  if unknown:
    raise errors.ConfigError(
        f'{path}{unknown[0]}: no such setting (the settings of '
        f'{path.rstrip(".") or "the config"}: {", ".join(sorted(fields))})')

  def group(group_kind, group_values, inner_path, name):
    del name  # Its path names it.
    return parse(group_kind, group_values, inner_path)

  given = {name: _value(field, hints[name], values[name], path, group)
           for name, field in fields.items() if name in values}
  return _kept(kind(**given), path)


def replace(settings: T, path: str = '', /, **changes: Any) -> T:
  """`dataclasses.replace` of settings, checked as `parse` checks: each
  changed value converted to its field's type and its field's rule kept,
  or a ConfigError naming the setting. A group changes with a dict of its
  fields: `replace(s, batch_size=8, data=dict(source='synthetic'))`."""
  kind = type(settings)
  fields = {f.name: f for f in dataclasses.fields(kind)}
  unknown = sorted(set(changes) - set(fields))
  if unknown:
    raise errors.ConfigError(f'{path}{unknown[0]}: no such setting')
  hints = _hints(kind)

  def group(kind, values, inner_path, name):
    del kind  # The group's own kind is that of the settings it replaces.
    return replace(getattr(settings, name), inner_path, **values)

  return _kept(dataclasses.replace(settings, **{
      name: _value(fields[name], hints[name], value, path, group)
      for name, value in changes.items()}), path)


def _kept(settings: T, path: str) -> T:
  """`settings` once the rules between its fields hold: a settings class
  declares them in `check_rules(self, path)`, which raises a ConfigError
  naming the settings under `path` (each field's own check has passed)."""
  check_rules = getattr(settings, 'check_rules', None)
  if check_rules is not None:
    check_rules(path)
  return settings


def _value(field: dataclasses.Field, hint: Any, value: Any, path: str,
           group: Callable[[Any, Any, str, str], Any]) -> Any:
  """A field's `value` converted to its type and checked (a group's by
  `group(kind, values, path, name)`), or a ConfigError naming the
  setting."""
  name = field.name
  if dataclasses.is_dataclass(hint):
    return group(hint, value, f'{path}{name}.', name)
  try:
    typed = _typed(value, hint, f'{path}{name}')
  except errors.ConfigError:
    if not field.metadata.get('takes'):
      raise
    raise errors.ConfigError(
        f'{path}{name}={shown(value)}: expected '
        f'{field.metadata["takes"]}') from None
  check = field.metadata.get('check')
  problem = check and check(typed)
  if isinstance(problem, _AfterName):
    raise errors.ConfigError(f'{path}{name}{problem}')
  if problem:  # 'must be ...' follows the value; ': expected ...' too.
    separator = '' if problem.startswith(':') else ' '
    raise errors.ConfigError(
        f'{path}{name}={shown(typed)}{separator}{problem}')
  return typed


def _typed(value: Any, hint: Any, name: str) -> Any:
  """`value` as the type `hint` names, or a ConfigError."""
  if typing.get_origin(hint) is tuple:
    (item, _) = typing.get_args(hint)
    if isinstance(value, (tuple, list)):
      return tuple(_typed(v, item, f'{name}[{i}]') for i, v in enumerate(value))
  elif hint is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif hint is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    if isinstance(value, float) and value.is_integer():
      return int(value)
  elif isinstance(value, hint):
    return value
  raise errors.ConfigError(
      f'{name}={value!r} must be {_described(hint)}')


_DESCRIBED = {bool: ('true or false', 'booleans'),
              int: ('an integer', 'integers'), float: ('a number', 'numbers'),
              str: ('a string', 'strings')}


def _described(hint: Any) -> str:
  if typing.get_origin(hint) is tuple:
    return f'a tuple of {_DESCRIBED[typing.get_args(hint)[0]][1]}'
  return _DESCRIBED[hint][0]


def to_dict(settings: Any) -> dict[str, Any]:
  """The settings as nested plain dicts (tuples kept), in schema order."""
  values = {f.name: getattr(settings, f.name)
            for f in dataclasses.fields(settings)}
  return {name: to_dict(value) if dataclasses.is_dataclass(value) else value
          for name, value in values.items()}


def to_config_dict(settings: Any) -> ml_collections.ConfigDict:
  """A locked ConfigDict of the settings: what config files change."""
  config = ml_collections.ConfigDict(to_dict(settings))
  config.lock()
  return config


def documented(kind: type, path: tuple[str, ...] = ()
               ) -> Iterator[tuple[tuple[str, ...], str, bool]]:
  """(path, doc, is a group) of every field of `kind`, depth first, in
  schema order."""
  hints = _hints(kind)
  for field in dataclasses.fields(kind):
    inner = hints[field.name]
    nested = dataclasses.is_dataclass(inner)
    yield path + (field.name,), doc_of(field), nested
    if nested:
      yield from documented(inner, path + (field.name,))


def frozen(kind: type[T]) -> type[T]:
  """A settings class: a frozen, keyword-only dataclass."""
  return dataclasses.dataclass(frozen=True, kw_only=True)(kind)


__all__ = ['setting', 'group', 'parse', 'replace', 'to_dict', 'to_config_dict',
           'documented', 'frozen', 'takes', 'shown']
