"""The host stays a few programs ahead of the devices, and a run never hangs:
the bound, the stall watchdog, and runs under the stress that stalled them."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import subprocess
import tempfile
import threading

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from haiku_mp.vit.train import in_flight
import tests
from tests import helpers

# XLA:CPU's limits on a collective not every device reached, cut from 20 s
# (warning) and 40 s (abort) so that a stalled run fails in seconds.
_SHORT_RENDEZVOUS = ('--xla_cpu_collective_call_warn_stuck_timeout_seconds=2 '
                     '--xla_cpu_collective_call_terminate_timeout_seconds=4')


class _Stalled:
  """A device result that is not ready until `release` is set: what
  `jax.block_until_ready` waits for in a program that never finishes."""

  def __init__(self, release: threading.Event):
    self._release = release

  def block_until_ready(self):
    self._release.wait()
    return self


class InFlightTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 3)
  def test_at_most_limit_unfinished_and_the_oldest_comes_back_ready(self,
                                                                    limit):
    step = jax.jit(lambda x: x @ x / 64.0)
    x = jnp.ones((64, 64))
    returned = []
    with in_flight.InFlight(limit) as queue:
      for i in range(6):
        x = step(x)
        finished = queue.push(i, x)
        self.assertLessEqual(len(queue), limit)
        if finished is not None:
          label, out = finished
          self.assertTrue(out.is_ready())
          returned.append(label)
      self.assertEqual(returned, list(range(6 - limit)))
      drained = queue.drain()
    self.assertEqual([label for label, _ in drained],
                     list(range(6 - limit, 6)))
    self.assertTrue(all(out.is_ready() for _, out in drained))
    self.assertEmpty(queue)

  def test_a_wait_that_outlasts_the_limit_is_reported_once_with_its_label(
      self):
    release = threading.Event()
    stalls = []

    def on_stall(label, seconds):
      stalls.append((label, seconds))
      release.set()

    ones = jnp.ones(3).block_until_ready()
    with in_flight.InFlight(1, stall_sec=0.2, on_stall=on_stall) as queue:
      queue.push('step 1', _Stalled(release))
      label, out = queue.push('step 2', ones)
      self.assertEqual(label, 'step 1')
      self.assertIsInstance(out, _Stalled)
      # Later waits, quick ones, report nothing.
      self.assertEqual(queue.drain()[0][0], 'step 2')
    self.assertLen(stalls, 1)
    self.assertEqual(stalls[0][0], 'step 1')
    self.assertGreater(stalls[0][1], 0.2)

  def test_time_the_process_spent_suspended_is_no_stall(self):
    """SIGSTOP / Ctrl-Z, or a paused machine, for longer than the limit: the
    watchdog's own looks are that far apart, so the gap is not the devices'."""
    release, entered = threading.Event(), threading.Event()
    now, reads = [0.0], []
    stalls = []

    def clock():  # Each look moves time a little; one moves it 600 s.
      reads.append(now[0])
      if entered.is_set() and not release.is_set():
        entered_reads = len(reads) - reads_at_entry[0]
        now[0] += 600.0 if entered_reads == 2 else 0.01
        if entered_reads == 6:
          release.set()
      return now[0]

    reads_at_entry = [0]

    class _Suspended(_Stalled):

      def block_until_ready(self):
        reads_at_entry[0] = len(reads)
        entered.set()
        return super().block_until_ready()

    with in_flight.InFlight(1, stall_sec=0.2, clock=clock,
                            on_stall=lambda *a: (stalls.append(a),
                                                 release.set())) as queue:
      queue.push('step 1', _Suspended(release))
      label, _ = queue.push('step 2', jnp.ones(3).block_until_ready())
    self.assertEqual(label, 'step 1')
    self.assertEmpty(stalls)
    self.assertGreater(now[0], 600.0)  # The jump happened inside the wait.

  def test_the_stall_line_is_one_line_and_ends_the_process(self):
    proc = subprocess.run(
        [sys.executable, '-c',
         'from haiku_mp.vit.train import in_flight; '
         "in_flight.exit_on_stall('Run it again.')('step 7', 301.4); "
         "print('still here')"],
        cwd=helpers.ROOT, capture_output=True, text=True, check=False)
    self.assertEqual(proc.returncode, in_flight.EXIT_STALLED)
    self.assertEqual(proc.stdout, '')
    self.assertEqual(
        proc.stderr.splitlines(),
        ['error: step 7 has not finished after 301s: the devices stalled (a '
         'collective that not every device reached, or a lost process of the '
         'run). Run it again.'])

  def test_xla_leaves_stalls_to_the_watchdog_unless_told_otherwise(self):
    flags = in_flight.xla_flags('--xla_force_host_platform_device_count=8',
                                stall_sec=300)
    self.assertEqual(flags.split(), [
        '--xla_force_host_platform_device_count=8',
        '--xla_cpu_collective_call_warn_stuck_timeout_seconds=-1',
        '--xla_cpu_collective_call_terminate_timeout_seconds=-1'])
    self.assertEqual(in_flight.xla_flags(_SHORT_RENDEZVOUS, 300).split(),
                     _SHORT_RENDEZVOUS.split())
    self.assertEqual(in_flight.xla_flags('', 0), '')

  def test_a_limit_below_one_is_refused(self):
    with self.assertRaisesRegex(ValueError, 'limit=0 must be at least 1'):
      in_flight.InFlight(0)


# Pins itself to one CPU, then becomes `python -m ARGS...`: the command sees
# one CPU from its start, as its runtime sizes its threads (a pin set after
# the start made the stall rare), and the test process, whose JAX threads
# make a fork unsafe, only spawns.
_ON_ONE_CPU = ('import os, sys; '
               'os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); '
               'os.execv(sys.executable, [sys.executable, "-m", *sys.argv[1:]])')


def _run_on_one_cpu(args, env) -> tuple[int, str]:
  """(status, stderr) of `python -m *args` on one CPU."""
  proc = subprocess.run([sys.executable, '-c', _ON_ONE_CPU, *args],
                        cwd=helpers.ROOT, env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True, timeout=300,
                        check=False)
  return proc.returncode, proc.stderr


@helpers.long_running
@absltest.skipUnless(hasattr(os, 'sched_setaffinity'),
                     'pins a process to one CPU: Linux only')
class NoStallTest(absltest.TestCase):
  """XLA:CPU launches a program of several devices on a pool of max(cores,
  devices) threads; a launch that waits for room in a full device queue (32
  programs) holds one of them, and the running program's collective then
  waits for a participant that finds no thread. A host far ahead of its
  devices on a loaded machine made that likely; on one core, all but
  certain: before the loop kept steps_in_flight steps in flight, each of
  these runs aborted (8 of 8 tries, in seconds with the limits above; at
  batch 16, which halves the runs' time, 3 of 3 tries with the limit
  lifted)."""

  def test_runs_of_eight_devices_on_one_core_finish(self):
    env = dict(os.environ, XLA_FLAGS=f'{tests.xla_flags(8)} '
               f'{_SHORT_RENDEZVOUS}')
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    for i, strategy in enumerate(('pmap', 'pjit')):
      status, stderr = _run_on_one_cpu(
          ['launch.train', '--config=configs/vit_cpu.py:fp32',
           f'--workdir={tmp}/{i}',
           f'--config.parallel.strategy={strategy}',
           '--config.num_train_steps=100', '--config.log_every_steps=100',
           '--config.eval_every_steps=100', '--config.batch_size=16',
           '--config.eval_batch_size=16', '--config.data.source=synthetic',
           '--config.data.synthetic_train_examples=640',
           '--config.data.synthetic_eval_examples=64',
           *helpers.TINY_MODEL_FLAGS], env)
      self.assertEqual(status, 0, f'{strategy}: {stderr[-2000:]}')
      self.assertNotIn('may be stuck', stderr)
      self.assertIn('test at step 100', stderr)


if __name__ == '__main__':
  absltest.main()
