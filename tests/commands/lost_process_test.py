"""What `launch.lost_process` reads: the runtime's last words and the
checkpoints on disk (the runs themselves: parallel_test.LostProcessTest)."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from launch import lost_process

_FATAL = (b'F1202 04:52:57.513906    3205 client.h:80] Terminating process '
          b'because the JAX distributed service detected fatal errors. This '
          b'most likely indicates that another task died; ... absl::Status: ')


class LostProcessesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('one_without_heartbeats', _FATAL + b'UNAVAILABLE: The following tasks '
       b'are unhealthy (stopped sending heartbeats):\n1\nThe tasks have '
       b'crashed.', [1]),
      ('two_without_heartbeats', _FATAL + b'UNAVAILABLE: The following tasks '
       b'are unhealthy (stopped sending heartbeats):\n3\n1\nThe tasks', [1, 3]),
      ('the_service_unreachable', _FATAL + b'UNAVAILABLE: Failed to send RPC '
       b'to coordination service. Either the leader task was preempted', [0]),
      ('the_service_frozen', _FATAL + b'DEADLINE_EXCEEDED: Deadline '
       b'Exceeded\n\nRPC: /xla.coordination.CoordinationService/Heartbeat',
       [0]),
      ('none_named', _FATAL + b'INTERNAL: something new', []))
  def test_the_lost_processes_named(self, text, lost):
    self.assertEqual(lost_process.lost_processes(text), lost)

  def test_a_warning_of_the_runtime_names_none(self):
    self.assertIsNone(lost_process.lost_processes(
        b'W1202 04:43:26.407464 2612 preemption_sync_manager.cc:147] Failed '
        b'to retrieve preemption notice from coordination service'))


class NewestCheckpointTest(absltest.TestCase):

  def test_a_save_cut_short_is_not_a_checkpoint(self):
    directory = self.enter_context(tempfile.TemporaryDirectory())
    self.assertIsNone(lost_process.newest_checkpoint(directory))
    os.makedirs(f'{directory}/10')
    os.makedirs(f'{directory}/20.orbax-checkpoint-tmp-1764650000000000')
    self.assertEqual(lost_process.newest_checkpoint(directory), 10)

  def test_no_directory(self):
    with tempfile.TemporaryDirectory() as tmp:
      self.assertIsNone(lost_process.newest_checkpoint(f'{tmp}/checkpoints'))


class RestartCommandTest(absltest.TestCase):

  def test_the_command_as_typed(self):
    self.assertEqual(
        lost_process.restart_command(
            ['launch/train.py', '--config=configs/vit_fp16.py',
             '--workdir=runs/a b', '--process_id=1']),
        "python -m launch.train --config=configs/vit_fp16.py "
        "'--workdir=runs/a b' --process_id=1")


if __name__ == '__main__':
  absltest.main()
