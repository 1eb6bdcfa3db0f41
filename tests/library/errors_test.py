"""The library's errors: an argument named in the library's words, or in an
application's setting paths."""

from absl.testing import absltest

from haiku_mp import errors


class _ScaleError(errors.ArgumentError):
  pass


class ArgumentErrorTest(absltest.TestCase):

  def test_names_the_library_arguments_as_raised(self):
    error = _ScaleError('$minimum: must be in (0, $initial], got -1')
    self.assertEqual(str(error), 'minimum: must be in (0, initial], got -1')
    self.assertEqual(error.arguments, ('minimum', 'initial'))
    self.assertIsInstance(error, errors.ConfigError)

  def test_named_gives_setting_paths_and_keeps_the_class(self):
    error = _ScaleError('$minimum: must be in (0, $initial], got -1')
    renamed = error.named({'initial': 'scale.start'}, prefix='loss_scale.')
    self.assertIsInstance(renamed, _ScaleError)
    self.assertEqual(str(renamed),
                     'loss_scale.minimum: must be in (0, scale.start], got -1')
    # Renamed once, its words are the application's: a second naming keeps them.
    self.assertEqual(str(renamed.named(prefix='other.')), str(renamed))

  def test_a_dotted_argument_is_one_name(self):
    error = _ScaleError('$low_bit.modules: no module matches. Try again.')
    self.assertEqual(error.arguments, ('low_bit.modules',))
    self.assertEqual(str(error.named(prefix='precision.')),
                     'precision.low_bit.modules: no module matches. Try again.')


if __name__ == '__main__':
  absltest.main()
