"""Shared test helpers: tiny configs and a jaxpr walker."""

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.extend import core as jex_core
from tensorboard.backend.event_processing import plugin_event_accumulator
from tensorboard.util import tensor_util

from configs import base
from haiku_mp.advisor import numerics
from haiku_mp.lab.studies import fp8_gemms
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.data import pipeline
from haiku_mp.vit.settings import fields
import tests
from tests import forked_commands
from tests import signal_at_step

MATMUL_PRIMITIVES = ('dot_general', 'conv_general_dilated')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A one-layer ViT for command-line runs: a few seconds to compile on 2 cores.
TINY_MODEL_FLAGS = ('--config.model.num_layers=1',
                    '--config.model.embed_dim=16',
                    '--config.model.mlp_dim=16', '--config.model.num_heads=2')


# The environment a command starts from: the test process's as this module
# was imported, not as libraries a test imported since left it (importing
# TensorFlow writes seven variables into it): every command of a process
# then sees the same environment, whichever tests ran before it.
_START_ENV = dict(os.environ)


class _ForkedCommands:
  """One `tests.forked_commands` launcher per test process, started on first
  use with the process's start environment, and ended (its stdin closed)
  with that process."""

  def __init__(self):
    self._launcher = None
    self._env = _START_ENV

  def serves(self, module: str, env: dict[str, str]) -> bool:
    """Whether the launcher runs `module` under `env` as a fresh process
    would: a project command whose environment is the launcher's but for
    the variables no preloaded library reads as it is imported."""
    return ((module.startswith(forked_commands.RUNNABLE_PREFIX) or
             module in forked_commands.RUNNABLE_WRAPPERS) and
            _read_on_import(env) == _read_on_import(self._env))

  def run(self, commands: list[tuple[str, list[str], dict[str, str]]],
          timeout: float) -> list[subprocess.CompletedProcess]:
    """Runs the (module, args, env) `commands` at the same time; their
    results once all have ended."""
    if self._launcher is None:
      self._launcher = subprocess.Popen(
          [sys.executable, '-m', 'tests.forked_commands'], cwd=ROOT,
          env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          text=True)
      atexit.register(self._launcher.stdin.close)
    self._launcher.stdin.write(json.dumps(dict(
        commands=[dict(module=module, args=list(args), env=env, cwd=ROOT)
                  for module, args, env in commands],
        timeout=timeout)) + '\n')
    self._launcher.stdin.flush()
    results = []
    for (module, args, _), reply in zip(
        commands, json.loads(self._launcher.stdout.readline())):
      command = [sys.executable, '-m', module, *args]
      if reply['timed_out']:
        raise subprocess.TimeoutExpired(command, timeout, reply['stdout'],
                                        reply['stderr'])
      results.append(subprocess.CompletedProcess(
          command, reply['returncode'], reply['stdout'], reply['stderr']))
    return results


# XLA reads XLA_FLAGS when JAX creates a backend, after the fork; pytest sets
# PYTEST_CURRENT_TEST for each test; `tests.signal_at_step` and
# `tests.fake_cifar10` read theirs as they run; help text is wrapped to
# COLUMNS as it is printed.
_SET_AFTER_IMPORT = ('XLA_FLAGS', 'PYTEST_CURRENT_TEST', signal_at_step.ENV,
                     signal_at_step.MODULE_ENV, 'FAKE_CIFAR10_URL', 'COLUMNS')


def long_running(cls):
  """Marks a test class whose tests take 10 s or more together: the
  suite starts it first (conftest.py), so that it never starts last and
  keeps one core busy alone."""
  cls.LONG_RUNNING = True
  return cls


def _read_on_import(env) -> dict[str, str]:
  return {k: v for k, v in env.items() if k not in _SET_AFTER_IMPORT}


_FORKED = _ForkedCommands()


def _command_env(env, devices=None) -> dict[str, str]:
  """The start environment changed by `env` (None: unset), with `devices`
  virtual CPU devices if given."""
  env = {k: v for k, v in dict(_START_ENV, **(env or {})).items()
         if v is not None}
  if devices is not None:
    env['XLA_FLAGS'] = tests.xla_flags(devices)
  return env


def forks(module: str, env=None, devices=None) -> bool:
  """Whether `run_module` forks `module` from the launcher (see
  `tests.forked_commands`) rather than starting a fresh interpreter."""
  return _FORKED.serves(module, _command_env(env, devices))


def run_module(module: str, *args: str, devices=None, env=None, check=False,
               timeout: float = 600) -> subprocess.CompletedProcess:
  """`python -m module *args` in the repository root, output captured as
  text; `devices` sets the number of virtual CPU devices it sees; `env`
  changes the environment (None: unset). A project command is forked from a
  process with its libraries imported (see `tests.forked_commands`),
  anything else started afresh."""
  env = _command_env(env, devices)
  if _FORKED.serves(module, env):
    [result] = _FORKED.run([(module, args, env)], timeout)
  else:
    result = subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT,
                            env=env, text=True, capture_output=True,
                            timeout=timeout)
  if check:
    result.check_returncode()
  return result


def run_modules_together(commands, timeout: float = 240
                         ) -> list[subprocess.CompletedProcess]:
  """The (module, args, env overrides) `commands` run at the same time (the
  processes of one multi-process run), each as `run_module` runs one; their
  results once all have ended. A command still running `timeout` seconds
  after the start is killed: `subprocess.TimeoutExpired`."""
  commands = [(module, list(args), _command_env(env))
              for module, args, env in commands]
  if all(_FORKED.serves(module, env) for module, _, env in commands):
    return _FORKED.run(commands, timeout)
  # Output to files, not pipes: a process blocked on a full pipe while its
  # peer waits for it in a collective would hang them both.
  with contextlib.ExitStack() as stack:
    outputs = [[stack.enter_context(tempfile.TemporaryFile('w+'))
                for _ in range(2)] for _ in commands]
    procs = [stack.enter_context(subprocess.Popen(
        [sys.executable, '-m', module, *args], cwd=ROOT, env=env, text=True,
        stdout=out, stderr=err))
             for (module, args, env), (out, err) in zip(commands, outputs)]
    deadline = time.monotonic() + timeout
    try:
      for proc in procs:
        proc.wait(timeout=max(deadline - time.monotonic(), 0))
    finally:
      for proc in procs:
        proc.kill()
    results = []
    for proc, files in zip(procs, outputs):
      for f in files:
        f.seek(0)
      out, err = (f.read() for f in files)
      results.append(subprocess.CompletedProcess(proc.args, proc.returncode,
                                                 out, err))
  return results


def start_module(module: str, args, env, output) -> subprocess.Popen:
  """`python -m module *args` started afresh in a session of its own (so
  that a test can signal the command and what it started), stdout and
  stderr to the file `output`: for a test that must see a command end, or
  not, while another runs on."""
  return subprocess.Popen([sys.executable, '-m', module, *args], cwd=ROOT,
                          env=_command_env(env), text=True, stdout=output,
                          stderr=subprocess.STDOUT, start_new_session=True)


def advisor_settings(advisor) -> settings_lib.AdvisorSettings:
  """`config.advisor` parsed as every command parses it."""
  return fields.parse(settings_lib.AdvisorSettings, advisor, 'advisor.')


def tiny_run_config(policy: str = 'params=float32,compute=float32,output=float32',
                    loss_scale: str = 'none', steps: int = 6,
                    eval_batch_size: int = 16, train_examples: int = 64,
                    eval_examples: int = 20):
  """`tiny_config` as a whole run on synthetic data: a few steps of 8
  images, logged every 2 and evaluated every 3."""
  config = tiny_config(policy, loss_scale=loss_scale)
  config.batch_size = 8
  config.eval_batch_size = eval_batch_size
  config.num_train_steps = steps
  config.log_every_steps = 2
  config.eval_every_steps = 3
  config.data.source = 'synthetic'
  config.data.synthetic_eval_examples = eval_examples
  config.data.synthetic_train_examples = train_examples
  return config


def tiny_config(policy: str = 'params=float32,compute=float32,output=float32',
                overrides: str = '', loss_scale: str = 'none', **model):
  """The base config with a ViT small enough for a test on two CPU cores."""
  config = base.get_config()
  config.precision.policy = policy
  config.precision.overrides = overrides
  config.loss_scale.kind = loss_scale
  config.model.update(dict(image_size=8, patch_size=4, embed_dim=16,
                           mlp_dim=32, num_heads=2, num_layers=1,
                           dropout_rate=0.1))
  config.model.update(model)
  return config


def with_settings(config, settings):
  """`config` with `settings` ({'a.b': value}) set in place; returned."""
  for path, value in settings.items():
    *parents, name = path.split('.')
    node = config
    for parent in parents:
      node = node[parent]
    node[name] = value
  return config


def random_batch(config, batch_size: int = 8, seed: int = 0):
  """The library's seeded random batch (drawn in float64, the draws the
  tests' thresholds were set on), as float32 device arrays."""
  batch = pipeline.random_batch(config.model, batch_size, seed,
                                      np.float64)
  return dict(image=jnp.asarray(batch['image'], jnp.float32),
              label=jnp.asarray(batch['label']))


def _sub_jaxprs(value) -> Iterator[jex_core.Jaxpr]:
  if isinstance(value, jex_core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jex_core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _sub_jaxprs(v)


def iter_eqns(jaxpr: jex_core.Jaxpr) -> Iterator[jex_core.JaxprEqn]:
  """All equations of a jaxpr, recursing into pjit, custom_vjp, cond, ..."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        yield from iter_eqns(sub)


def eqns_of(fn, *args, primitives=MATMUL_PRIMITIVES):
  """The equations of `fn(*args)` whose primitive is in `primitives`."""
  closed = jax.make_jaxpr(fn)(*args)
  return [e for e in iter_eqns(closed.jaxpr) if e.primitive.name in primitives]


def operand_dtypes(eqn) -> tuple[str, ...]:
  return tuple(jnp.dtype(v.aval.dtype).name for v in eqn.invars)


def compiled_dot_operand_dtypes(hlo_text: str) -> list[tuple[str, str]]:
  """The operand element types of every dot in a compiled (optimized) HLO
  module's text, e.g. ('bf16', 'bf16'): the dtypes the backend's matmul
  kernel really receives, after XLA's own conversions."""
  return [tuple(m['operands']) for m in fp8_gemms.hlo_matmuls(hlo_text)
          if m['opcode'] == 'dot']


REAL_DATA_ENV = 'HAIKU_MP_TFDS_DATA_DIR'


def real_data_dir():
  """The prepared CIFAR-10 TFDS dir named by $HAIKU_MP_TFDS_DATA_DIR, or None."""
  path = os.environ.get(REAL_DATA_ENV, '')
  if path and os.path.isdir(os.path.join(path, 'cifar10')):
    return path
  return None


def skip_without_real_data(test_case):
  if real_data_dir() is None:
    test_case.skipTest(
        f'real CIFAR-10 not found: set {REAL_DATA_ENV} to a TFDS data dir '
        'holding a prepared cifar10 (.ci/run does when one is beside the '
        'checkout)')


def tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float | str]]]:
  """Every scalar point as TensorBoard's UI loads it: {tag: [(step, value)]}.

  Through the accumulator TensorBoard's own data loading uses, orphaned-data
  purging included.
  """
  accumulator = plugin_event_accumulator.EventAccumulator(
      logdir, size_guidance={plugin_event_accumulator.TENSORS: 0})
  accumulator.Reload()
  return {tag: [(e.step, _comparable(tensor_util.make_ndarray(e.tensor_proto)))
                for e in accumulator.Tensors(tag)]
          for tag in accumulator.Tags()[plugin_event_accumulator.TENSORS]}


def jsonl_scalars(workdir: str) -> dict[str, list[tuple[int, float | str]]]:
  """metrics.jsonl in the same form, rounded to float32 as TensorBoard keeps."""
  scalars = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for event in map(json.loads, f):
      for key, value in event.items():
        if key in ('step', 'split') or isinstance(value, (list, dict)):
          continue
        # Non-finite values are the strings 'inf', '-inf', 'nan'.
        scalars.setdefault(f'{event["split"]}/{key}', []).append(
            (event['step'], _comparable(np.float32(float(value)))))
  return scalars


def _comparable(value) -> float | str:
  """A float, or 'nan' (NaN != NaN would fail any comparison of lists)."""
  value = float(value)
  return 'nan' if np.isnan(value) else value


def numpy_stats(x, scale: float = 1.0) -> dict:
  """What `numerics.tensor_stats` measures, computed directly in NumPy with
  real float16 and bfloat16 casts (the reference the tests compare with)."""
  x = np.asarray(x, np.float32).ravel()
  finite = np.isfinite(x)
  v = np.where(finite, x, 0).astype(np.float64)
  nonzero = v != 0
  with np.errstate(over='ignore'):
    scaled = np.where(finite, x, 0).astype(np.float32) * np.float32(scale)
    f16 = scaled.astype(np.float16).astype(np.float64)
    bf16 = scaled.astype(ml_dtypes.bfloat16).astype(np.float64)
  in_range = np.isfinite(f16)
  norm = np.sqrt(np.sum(v * v))
  relative = lambda e: float(np.linalg.norm(e) / norm) if norm else 0.0
  _, exponent = np.frexp(np.abs(v[nonzero]))
  exponent = np.clip(exponent, numerics.LOWEST_EXPONENT,
                     numerics.HIGHEST_EXPONENT)
  return dict(
      count=x.size, zeros=int(np.sum(~nonzero & finite)),
      nonfinite=int(np.sum(~finite)), amax=float(np.abs(v).max(initial=0)),
      sum_squares=float(norm**2),
      f16_flush=int(np.sum(nonzero & (f16 == 0))),
      f16_subnormal=int(np.sum((f16 != 0) & (np.abs(f16) < 2.0**-14))),
      f16_overflow=int(np.sum(~in_range)),
      f16_relative_error=relative(np.where(in_range, f16 / scale - v, 0)),
      bf16_relative_error=relative(bf16 / scale - v),
      histogram=np.bincount(exponent - numerics.LOWEST_EXPONENT,
                            minlength=len(numerics.EXPONENTS)).tolist())


def assert_stats_equal(test_case, got: dict, want: dict, msg: str = '',
                       ulps: bool = False):
  """Counts and histogram exactly, sums to float32 summation error; with
  `ulps`, for tensors that two programs computed (their values may differ
  in the last bits): the largest magnitude to 1e-5, a few values allowed to
  cross a power of two or a float16 boundary."""
  slack = 2 + 1e-4 * want['count'] if ulps else 0
  for field in ('count', 'zeros', 'nonfinite', 'f16_flush', 'f16_subnormal',
                'f16_overflow'):
    test_case.assertLessEqual(abs(got[field] - want[field]), slack,
                              f'{msg} {field}: {got[field]} vs {want[field]}')
  test_case.assertLessEqual(
      np.abs(np.subtract(got['histogram'], want['histogram'])).sum(),
      2 * slack, f'{msg} histogram')
  test_case.assertAlmostEqual(got['amax'], want['amax'],
                              delta=(1e-5 if ulps else 0) * want['amax'],
                              msg=f'{msg} amax')
  test_case.assertAlmostEqual(got['sum_squares'], want['sum_squares'],
                              delta=1e-5 * want['sum_squares'], msg=msg)
  for field in ('f16_relative_error', 'bf16_relative_error'):
    test_case.assertAlmostEqual(
        got[field], want[field],
        delta=(1e-2 if ulps else 1e-3) * want[field] + 1e-9,
        msg=f'{msg} {field}')
