"""The measure of a setting's path (tests/setting_path.py) on planted reads."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest

from tests import layers_test
from tests import setting_path


class SettingPathTest(absltest.TestCase):

  def test_files_have_their_floors(self):
    floors = {parts: level for level, group in enumerate(layers_test.FLOORS)
              for parts in group}
    self.assertEqual(setting_path.floor_of('haiku_mp/vit/train/loop.py'),
                     floors['vit/train'])
    self.assertEqual(setting_path.floor_of('haiku_mp/lab/timing.py'),
                     floors['lab'])
    self.assertEqual(setting_path.floor_of('haiku_mp/lab/studies/sweep.py'),
                     floors['lab/studies'])
    self.assertEqual(setting_path.floor_of('launch/train.py'),
                     len(layers_test.FLOORS) - 1)

  def test_a_move_up_is_a_return(self):
    """From the settings (the application's ground floor) up to the model,
    up to the trainer, down to the model again, up to the lab: four moves,
    three of them up (a read again in the same file is no move)."""
    reads = ['haiku_mp/vit/settings/fields.py', 'haiku_mp/vit/model/vit.py',
             'haiku_mp/vit/model/vit.py', 'haiku_mp/vit/train/loop.py',
             'haiku_mp/vit/model/vit.py', 'haiku_mp/lab/timing.py']
    self.assertEqual(setting_path.path_figures(reads), dict(
        files=['haiku_mp/vit/settings/fields.py', 'haiku_mp/vit/model/vit.py',
               'haiku_mp/vit/train/loop.py', 'haiku_mp/lab/timing.py'],
        reads=4, returns_up=3))


if __name__ == '__main__':
  absltest.main()
