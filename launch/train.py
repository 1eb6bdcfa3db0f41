"""Trains the configured ViT on CIFAR-10 and evaluates it.

python -m launch.train --config=configs/vit_fp16.py --workdir=runs/fp16 \
    [--config.batch_size=256 ...]

Many hosts: start one process per host with the same flags plus
--coordinator_address=HOST:PORT --num_processes=N --process_id=I (or
--distributed on clusters where jax.distributed.initialize() finds them).
Each then trains in a child process of its own, so that a lost process ends
every other with one line (`lost_process.py`, exit status 75).
"""

import os
import re
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from haiku_mp.lab import hardware
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import in_flight
from haiku_mp.vit.train import loop
from launch import cli
from launch import lost_process

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for metrics, '
                               'TensorBoard files and the summary.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'HOST:PORT of process 0, for many processes.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None,
                                      'Number of processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process.')
_MODULES_TABLE = flags.DEFINE_bool(
    'modules_table', False, 'Log the whole module table at the start (every '
    'run also writes it to WORKDIR/modules.txt).')
_DISTRIBUTED = flags.DEFINE_bool(
    'distributed', False, 'Call jax.distributed.initialize() with no '
    'arguments (clusters that provide them, e.g. SLURM, Cloud TPU).')


# What a collective that lost its peer raises (gloo on CPUs, NCCL on GPUs).
_COLLECTIVE_FAILED = re.compile(
    r'Gloo \w+ failed|NCCL|Connection (reset|closed)')


def _many_processes() -> bool:
  return _COORDINATOR.value is not None or _DISTRIBUTED.value


def _initialize_distributed(heartbeat_sec: int) -> None:
  # CPU devices of different processes talk through gloo; GPUs ignore this.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if _DISTRIBUTED.value:
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_sec)
  else:
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                               _PROCESS_ID.value,
                               heartbeat_timeout_seconds=heartbeat_sec)


def _supervised(heartbeat_sec: int) -> lost_process.Reporter:
  """The trainer's side of `lost_process.supervised`: this process's
  parent waits for it, and says what a lost process leaves."""
  return lost_process.supervised(
      _WORKDIR.value, heartbeat_sec, lost_process.restart_command(sys.argv))


def _train(settings, reporter: lost_process.Reporter, heartbeat_sec: int):
  """Trains; a collective that fails (a peer's connection closed) waits
  for the runtime to name the lost process, which ends this one within the
  heartbeat timeout; an error it does not end is raised after that."""
  try:
    return loop.train_and_evaluate(
        settings, _WORKDIR.value, log_module_table=_MODULES_TABLE.value,
        on_built=_log_config, hooks=loop.Hooks(finished=reporter.finished))
  except Exception as e:  # pylint: disable=broad-except
    if _from_the_runtime(e):
      time.sleep(2 * heartbeat_sec)
    raise


def _from_the_runtime(error: BaseException) -> bool:
  """Whether `error` is, or was raised over, a failed collective: a JAX
  runtime error, or one that carries its message (a save's gather that
  failed is reported as the save's error, over a ValueError on one device
  per process)."""
  while error is not None:
    if (isinstance(error, jax.errors.JaxRuntimeError) or
        _COLLECTIVE_FAILED.search(str(error))):
      return True
    error = error.__cause__ or error.__context__
  return False


def _log_config() -> None:
  overrides = config_flags.get_override_values(flags.FLAGS['config'])
  logging.info('Config: %s%s',
               config_flags.get_config_filename(flags.FLAGS['config']),
               ''.join(f' --config.{k}={v}' for k, v in overrides.items()))
  logging.info('%s', hardware.host_line())


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  # Parsed once (each field checked), without JAX: XLA_FLAGS are read by
  # XLA when JAX first makes a backend, below.
  settings = settings_lib.parse(_CONFIG.value)
  os.environ['XLA_FLAGS'] = in_flight.xla_flags(
      os.environ.get('XLA_FLAGS', ''), settings.stall_timeout_sec)
  if _many_processes():
    heartbeat_sec = settings.parallel.heartbeat_timeout_sec
    reporter = _supervised(heartbeat_sec)  # Returns in the child only.
    _initialize_distributed(heartbeat_sec)
    reporter.started(jax.process_index(), jax.process_count())
    result = _train(settings, reporter, heartbeat_sec)
  else:
    result = loop.train_and_evaluate(
        settings, _WORKDIR.value, log_module_table=_MODULES_TABLE.value,
        on_built=_log_config)
  if result.get('signal') == 'SIGINT':  # Saved, but stopped by Ctrl-C.
    sys.exit(cli.EXIT_INTERRUPTED)


if __name__ == '__main__':
  flags.mark_flags_as_required(['config', 'workdir'])
  cli.run(main)
