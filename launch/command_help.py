"""`--help` of every entry point: the command's usage, its own flags, and each
field of its config as `--config.FIELD=DEFAULT` with one line of its doc in
the settings' schema (haiku_mp/vit/settings/).

absl's own `--help` lists the main module's flags alone (not the config's
fields) and exits 1; `--helpfull` stays absl's. This runs before the flags
are parsed: it needs no required flag, and nothing is compiled or read but
the config file.
"""

import os
import re
import shlex
import shutil
import sys
import textwrap
from typing import Any, NoReturn, Optional

from absl import flags
import ml_collections
from ml_collections.config_flags.config_flags import is_config_flag

from haiku_mp.vit import settings
from haiku_mp.vit.settings import fields as settings_fields

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_CONFIG = os.path.join(_ROOT, 'configs', 'base.py')
_SCHEMA = 'haiku_mp/vit/settings/'

# absl's help flags: `--help`, its alias `--helpshort` and its short `-?`.
_HELP_NAMES = ('help', 'helpshort', '?')
_TRUE = ('', 'true', 't', '1')
# What absl's `mark_flag_as_required` validator says.
_REQUIRED = 'must have a value other than None'
_ELLIPSIS = '...'


def wanted(argv: list[str]) -> bool:
  """Whether `argv` asks for `--help` (or `--helpshort`, `-?`)."""
  for arg in argv[1:]:
    if arg == '--':
      break
    if arg.startswith('-'):
      name, _, value = arg.lstrip('-').partition('=')
      if name in _HELP_NAMES and value.lower() in _TRUE:
        return True
  return False


def show(argv: list[str]) -> NoReturn:
  """Prints the help on stdout and exits 0."""
  text = render(argv, shutil.get_terminal_size((100, 24)).columns)
  try:
    sys.stdout.write(text)
    sys.stdout.flush()
  except BrokenPipeError:  # `--help | head`: what was read is enough.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
  sys.exit(0)


def render(argv: list[str], width: int = 100) -> str:
  """The help of the running command (`__main__`), given its `argv`."""
  width = max(width, 60)
  own = [f for f in flags.FLAGS.get_key_flags_for_module(sys.argv[0])
         if '.' not in f.name]  # Not ml_collections' per-field flags.
  lines = [_usage(), '', 'Flags:']
  lines += [_flag_line(f, width) for f in own]
  for flag in own:
    if is_config_flag(flag):
      lines += [''] + _config_lines(flag, argv, width)
  lines += ['', '--helpfull: the whole description and every flag, those of '
            'the libraries too.']
  return '\n'.join(lines) + '\n'


def _usage() -> str:
  """The module docstring up to its first `python -m` line's paragraph."""
  doc = (sys.modules['__main__'].__doc__ or '').strip()
  paragraphs = re.split(r'\n\s*\n', doc)
  for i, paragraph in enumerate(paragraphs):
    if 'python -m ' in paragraph:
      return '\n\n'.join(paragraphs[:i + 1])
  return paragraphs[0] if paragraphs else ''


def _display_path(path: str) -> str:
  return os.path.relpath(path) if os.path.isabs(path) else path


def _flag_value(flag: flags.Flag) -> Optional[str]:
  """The flag's default as typed on a command line; None: it has none."""
  if is_config_flag(flag):  # Its default is the file's config; this, its path.
    path = str(flag.default_as_str or '').strip("'")
    return _display_path(path) if flag.default is not None and path else None
  default = flag.default
  if default is None:
    return None
  if isinstance(default, bool):
    value = 'true' if default else 'false'
  elif isinstance(default, (list, tuple)):
    value = ','.join(map(str, default))
  else:
    value = str(default)
  return shlex.quote(value)


def _required(flag: flags.Flag) -> bool:
  return any(_REQUIRED in str(getattr(v, 'message', ''))
             for v in flag.validators)


def _flag_line(flag: flags.Flag, width: int) -> str:
  value = _flag_value(flag)
  name = f'--{flag.name}' + ('' if value is None else f'={value}')
  help_text = ' '.join(str(flag.help or '').split())
  if _required(flag):
    help_text += ' (required)'
  return textwrap.fill(f'{name}  {help_text}', width, initial_indent='  ',
                       subsequent_indent='      ', break_long_words=False,
                       break_on_hyphens=False)


# The config's fields and their docs, from the settings' schema.


def field_docs() -> dict[tuple[str, ...], str]:
  """Every field and group of the schema, in its order, with its doc."""
  return {path: doc for path, doc, _ in
          settings_fields.documented(settings.Settings)}


# A sentence's or clause's end (not "e.g. " or "i.e. ").
_SENTENCE_END = re.compile(r'(?<!e\.g)(?<!i\.e)([.;]) ')


def one_line(text: str, width: int) -> str:
  """`text` in `width` characters: cut after a sentence, or at a word (then
  '...')."""
  if len(text) <= width:
    return text
  cut = text[:width - len(_ELLIPSIS) + 1]
  ends = [m for m in _SENTENCE_END.finditer(cut) if m.start() >= width // 2]
  if ends and ends[-1].group(1) == '.':
    return cut[:ends[-1].start() + 1]
  if ends:
    return cut[:ends[-1].start()] + _ELLIPSIS
  words = cut[:cut.rfind(' ')].split(' ')
  if words[-1] in ('e.g.', 'i.e.'):
    words.pop()
  return ' '.join(words).rstrip(',;:( ') + _ELLIPSIS


def _config_value(value: Any) -> str:
  if isinstance(value, bool):
    value = 'true' if value else 'false'
  return shlex.quote(str(value))


def _fields_of(config: ml_collections.ConfigDict, order: dict, path=()):
  """(path, value) of every field of the schema, its settings before its
  groups (each group, a ConfigDict, then its own), in the schema's order;
  the old names of renamed groups, which a config holds beside the new
  ones, are left out."""
  keys = sorted((k for k in config.keys() if path + (k,) in order),
                key=lambda k: (isinstance(config[k], ml_collections.ConfigDict),
                               order[path + (k,)]))
  for key in keys:
    value = config[key]
    yield path + (key,), value
    if isinstance(value, ml_collections.ConfigDict):
      yield from _fields_of(value, order, path + (key,))


def _given_config(flag: flags.Flag, argv: list[str]) -> Optional[str]:
  """The flag's value on the command line (the last one), or None."""
  given, args = None, argv[1:]
  for i, arg in enumerate(args):
    if arg == '--':
      break
    name, equals, value = arg.lstrip('-').partition('=')
    if arg.startswith('-') and name == flag.name:
      if equals:
        given = value
      elif i + 1 < len(args):
        given = args[i + 1]
  return given


def _load(flag: flags.Flag, argv: list[str]):
  """(the config, its heading, a note if the one asked for did not load)."""
  base = _display_path(BASE_CONFIG)
  path = _given_config(flag, argv) or _flag_value(flag)
  if not path:
    return (flag.parser.parse(BASE_CONFIG),
            f'Fields of the config, as in {base}', '')
  try:
    if not os.path.exists(path.split(':', 1)[0]):
      raise FileNotFoundError('no such file')
    config = flag.parser.parse(path)
    config.keys()  # A load that failed raises here.
    return config, f'Fields of --{flag.name}={path}', ''
  except Exception as e:  # pylint: disable=broad-except
    while e.__cause__ or e.__context__:  # ml_collections wraps the first.
      e = e.__cause__ or e.__context__
    reason = ' '.join(str(e).split())[:200]
    return (flag.parser.parse(BASE_CONFIG),
            f'Fields of the config, as in {base}',
            f'(--{flag.name}={path} cannot be loaded: {reason})')


def _config_lines(flag: flags.Flag, argv: list[str], width: int) -> list[str]:
  config, heading, note = _load(flag, argv)
  docs = field_docs()
  order = {p: i for i, p in enumerate(docs)}
  lines = [f'{heading} (set one with --{flag.name}.FIELD=VALUE; whole '
           f'docs in {_SCHEMA}):']
  if note:
    lines.append(f'  {note}')
  for field, value in _fields_of(config, order):
    doc = docs.get(field, '')
    if isinstance(value, ml_collections.ConfigDict):
      head, space = f'  {flag.name}.{".".join(field)}:', ' '
      lines += ['', head]
    else:
      head = f'  --{flag.name}.{".".join(field)}={_config_value(value)}'
      space = '  '
      lines.append(head)
    if doc:
      lines[-1] += space + one_line(doc, max(width - len(head) - len(space),
                                              30))
  return lines
