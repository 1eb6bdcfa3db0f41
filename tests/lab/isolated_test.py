"""A variant timed in a process of its own (`isolated.time_step`, the lab's
`--isolate`): its config crosses as JSON and compiles the same program."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest

from haiku_mp.lab import isolated
from haiku_mp.vit import settings as settings_lib
from tests import helpers


class IsolatedTest(absltest.TestCase):

  def test_a_variant_in_its_own_process_compiles_the_same_program(self):
    config = helpers.tiny_config(
        'params=float32,compute=bfloat16,output=float32')
    # Tuples, which JSON carries as lists: the train step's crop reads one.
    config.parallel.mesh_shape = (1, 1)
    config.data.crop_area = (0.8, 1.0)
    here = isolated.time_step(settings_lib.parse(config), 1, 0, isolate=False)
    there = isolated.time_step(settings_lib.parse(config), 1, 0, isolate=True)
    self.assertEqual(there['program_sha256'], here['program_sha256'])
    self.assertEqual(there['policy'], config.precision.policy)
    self.assertEqual(there['batch_size'], config.batch_size)


if __name__ == '__main__':
  absltest.main()
