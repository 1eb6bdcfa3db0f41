"""The files a setting passes through, from the command line to its uses.

    python -m tests.setting_path data.crop_padding <launch.train flags>
    SETTING_PATH_MODULE=launch.benchmark python -m tests.setting_path ...

Runs `launch.train` (or the command SETTING_PATH_MODULE names) with every read of one setting recorded: a read of the
field on its group of the typed settings, or on a ConfigDict that holds the
group's fields. Prints one JSON line: `files`, the repository's files in
the order they first read it (launcher first); `reads`, how many times the
reading moved from one file to another; `returns_up`, how many of those
moves went up to a floor (tests/layers_test.FLOORS, the launchers on top)
the reading had already left on its way down. docs/design.md gives the
figures for `precision.policy`, `data.crop_padding` and
`parallel.mesh_shape`.
"""

import atexit
import dataclasses
import importlib
import json
import os
import runpy
import sys
import typing

import ml_collections

from tests import layers_test

# The command to run (default launch.train).
MODULE_ENV = 'SETTING_PATH_MODULE'
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _settings_classes() -> list[type]:
  """Every frozen settings dataclass: the run's and its groups'."""
  # haiku_mp/vit/settings; haiku_mp/settings in a tree from before the
  # wings, measured the same way.
  wings = os.path.isdir(os.path.join(_ROOT, 'haiku_mp', 'vit', 'settings'))
  settings = importlib.import_module(
      'haiku_mp.vit.settings' if wings else 'haiku_mp.settings')
  found, todo = [], [settings.Settings]
  while todo:
    kind = todo.pop()
    found.append(kind)
    todo.extend(h for h in typing.get_type_hints(kind).values()
                if dataclasses.is_dataclass(h))
  return found


def _caller(depth: int) -> str:
  """The repository file that read, `depth` frames up ('' when the reader
  is another library: absl applying a flag, say). ml_collections' frames
  and this file's are passed over (a ConfigDict's `__getattr__` reads
  through its `__getitem__`)."""
  frame = sys._getframe(depth)  # pylint: disable=protected-access
  inside = os.path.dirname(ml_collections.__file__)
  while frame is not None and (
      frame.f_code.co_filename.startswith(inside) or
      os.path.abspath(frame.f_code.co_filename) == os.path.abspath(__file__)):
    frame = frame.f_back
  path = os.path.abspath(frame.f_code.co_filename) if frame else ''
  if path.startswith(_ROOT + os.sep) and '.venv' not in path:
    return os.path.relpath(path, _ROOT)
  return ''


def record_reads(setting: str) -> list[str]:
  """Patches the settings classes and ConfigDict so that each read of
  `setting` appends its reader's file to the returned list."""
  *groups, field = setting.split('.')
  kind = _settings_classes()[0]
  for name in groups:
    kind = typing.get_type_hints(kind)[name]
  siblings = {f.name for f in dataclasses.fields(kind)} - {field}
  reads = []

  def note(depth: int) -> None:
    path = _caller(depth)
    if path:
      reads.append(path)

  plain = kind.__getattribute__

  def typed_read(self, name):
    if name == field:
      note(3)
    return plain(self, name)

  kind.__getattribute__ = typed_read

  def is_group(config) -> bool:
    keys = set(config.keys()) if hasattr(config, 'keys') else set()
    return field in keys and siblings <= keys

  for method in ('__getattr__', '__getitem__'):
    original = getattr(ml_collections.ConfigDict, method)

    def dict_read(self, name, original=original):
      if name == field and is_group(self):
        note(3)
      return original(self, name)

    setattr(ml_collections.ConfigDict, method, dict_read)
  return reads


def floor_of(path: str) -> int:
  """The floor (tests/layers_test.FLOORS) of a repository file."""
  top = len(layers_test.FLOORS) - 1
  if not path.startswith('haiku_mp/'):
    return top
  inside = path[len('haiku_mp/'):-len('.py')]
  best, floor = '', top
  for level, parts in enumerate(layers_test.FLOORS):
    for part in parts:
      if ((inside == part or inside.startswith(part + '/')) and
          len(part) > len(best)):
        best, floor = part, level
  return floor


def path_figures(reads: list[str]) -> dict:
  """The files in first-read order, the moves between files, and the moves
  up to a floor already left."""
  moves = [(a, b) for a, b in zip(reads, reads[1:]) if a != b]
  # The path starts on the top floor (the launcher): a move up returns to
  # a floor it has left.
  return dict(files=list(dict.fromkeys(reads)), reads=len(moves),
              returns_up=sum(floor_of(b) > floor_of(a) for a, b in moves))


if __name__ == '__main__':
  SETTING = sys.argv.pop(1)
  READS = record_reads(SETTING)
  # The commands leave through os._exit after the exit functions.
  atexit.register(lambda: print(
      json.dumps(dict(setting=SETTING, **path_figures(READS))), flush=True))
  runpy.run_module(os.environ.get(MODULE_ENV, 'launch.train'),
                   run_name='__main__', alter_sys=True)
