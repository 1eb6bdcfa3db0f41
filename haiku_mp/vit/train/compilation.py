"""Compilation: JAX's persistent cache, where `settings.compilation_cache_dir`
puts it, and the train step compiled ahead of its first call
(`CompiledSteps`).

A train step of the reference ViT takes 15-25 s to compile on a GPU; with the
cache, a restarted or resumed run, and every later run of the same program,
loads it instead. `auto` (the default) uses `$XDG_CACHE_HOME/haiku_mp/jax`
(`~/.cache/haiku_mp/jax`) on accelerators and no cache on the CPU, where
compiles take seconds and XLA:CPU can refuse its own entries on some CPUs
(logging an error for each: jax-ml/jax#38445). A directory uses it on every
backend; `''` turns the cache off. JAX_COMPILATION_CACHE_DIR, when set in the
environment, is what `auto` keeps.
"""

import contextlib
import os
import time
from typing import Iterator, Mapping, Optional

import jax
from jax.experimental.compilation_cache import compilation_cache as cache

from haiku_mp import errors
from haiku_mp.vit.train import console

AUTO = 'auto'
SETTING = 'compilation_cache_dir'
_ENV = 'JAX_COMPILATION_CACHE_DIR'
_HIT_EVENT = '/jax/compilation_cache/cache_hits'


def default_directory(environ: Mapping[str, str] = os.environ) -> str:
  home = environ.get('HOME') or os.path.expanduser('~')
  base = environ.get('XDG_CACHE_HOME') or os.path.join(home, '.cache')
  return os.path.join(base, 'haiku_mp', 'jax')


def directory(setting: str, backend: str,
              environ: Mapping[str, str] = os.environ) -> Optional[str]:
  """The directory `setting` puts the cache in on `backend` ('cpu', 'gpu',
  ...); None where haiku_mp sets none (off, or the environment's kept)."""
  if not setting:
    return None
  if setting == AUTO:
    if environ.get(_ENV) or backend == 'cpu':
      return None
    return default_directory(environ)
  return os.path.expanduser(setting)


def check(setting) -> None:
  """A ConfigError for a setting that cannot be a cache directory, before
  anything is compiled."""
  if not isinstance(setting, str):
    raise errors.ConfigError(f'{SETTING}={setting!r} must be a directory, '
                             f"'{AUTO}' or '' (off)")
  if setting in ('', AUTO):
    return
  errors.check_writable_directory(SETTING, os.path.expanduser(setting))


@contextlib.contextmanager
def used(setting: str) -> Iterator[Optional[str]]:
  """JAX's cache at `setting`'s directory inside the block, the caller's
  own again after it: a library changes no global of JAX's behind the
  caller's back. Enter before the block's first compile (`check` has
  passed, as `checks` does for every command); yields the
  directory JAX uses, if any."""
  path = directory(setting, jax.default_backend())
  with _jax_setting('jax_compilation_cache_dir', path):
    yield jax.config.jax_compilation_cache_dir or None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
  """No persistent cache inside the block: every compile a fresh one (what
  a study of compile times measures)."""
  with _jax_setting('jax_enable_compilation_cache', False):
    yield


@contextlib.contextmanager
def _jax_setting(name: str, value) -> Iterator[None]:
  """jax.config's `name` set to `value` (None: left as it is) inside the
  block. JAX opens its cache once, at the first compile, and keeps it
  open: `reset_cache` makes the next compile open it as now set."""
  before = getattr(jax.config, name)
  if value is None or value == before:
    yield
    return
  jax.config.update(name, value)
  cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update(name, before)
    cache.reset_cache()


@contextlib.contextmanager
def hits() -> Iterator[list[str]]:
  """A list that collects one entry per persistent-cache hit of the compiles
  inside the block (JAX reports them as monitoring events)."""
  found = []

  def listen(event: str, **kwargs) -> None:
    del kwargs
    if event == _HIT_EVENT:
      found.append(event)

  jax.monitoring.register_event_listener(listen)
  try:
    yield found
  finally:
    jax.monitoring.unregister_event_listener(listen)


# The train step compiled ahead of its first call, per batch shape, so that
# no logged rate includes compilation.

class CompiledSteps:
  """The train step compiled ahead of a step of each batch shape it meets, so
  that every logged rate, the first window's after a start or a resume
  included, excludes compilation. Ordinary training meets one shape; DP-SGD
  another in the rare step whose Poisson draw outgrows the padded batch."""

  def __init__(self, strategy):
    self._strategy = strategy
    self._compiled = {}

  def compile(self, state, batch):
    shapes = tuple(sorted((k, v.shape) for k, v in batch.items()))
    if shapes not in self._compiled and not self._strategy.compiles_ahead:
      console.info(
          'The train step compiles in its first call (%s over %d '
          'processes cannot be compiled ahead): the first log '
          "window's rate includes it.", self._strategy.name,
          jax.process_count())
      self._compiled[shapes] = self._strategy.train_step
    if shapes not in self._compiled:
      start = time.perf_counter()
      lowered = self._strategy.train_step.lower(state, batch)
      lowered_at = time.perf_counter()
      with hits() as cache_hits:
        self._compiled[shapes] = lowered.compile()
      end = time.perf_counter()
      # Tracing and lowering run every time; XLA's compile is what the
      # persistent compilation cache saves.
      console.info(
          'Compiled the train step for a batch of %d in %.1fs '
          '(tracing and lowering %.1fs, XLA %.1fs%s).', batch['label'].size,
          end - start, lowered_at - start, end - lowered_at,
          ', loaded from the compilation cache' if cache_hits else '')
    return self._compiled[shapes]

  def __call__(self, state, batch):
    return self.compile(state, batch)(state, batch)
