"""The `step_compile` study: medians and ratios to the plain step of the same
model, its plot, and the transformer's steps that trace (no compile here:
the study's compiles are its measurement, minutes long)."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import itertools
import tempfile
from unittest import mock

from absl.testing import absltest
import jax

from haiku_mp.lab.studies import step_compile
from haiku_mp.update import train_state


class StepCompileTest(absltest.TestCase):

  def test_medians_and_ratios_to_the_plain_step(self):
    # Compile seconds per call, in the order the study makes them: per
    # model, `repeats` rounds of every variant.
    seconds = itertools.cycle([2.0, 5.0, 6.0, 4.0, 3.0, 8.0, 3.0, 4.0, 7.0])
    fake = lambda name, variant: dict(compile_cpu_s=next(seconds),
                                      lower_cpu_s=0.5)
    with mock.patch.object(step_compile, 'compile_seconds', fake):
      result = step_compile.run(models=('lm',), repeats=3)
    rows = {r['variant']: r for r in result['rows']}
    self.assertEqual(rows['plain']['compile_cpu_s'], 3.0)  # Of 2, 4, 3.
    self.assertEqual(rows['make_train_step']['compile_cpu_s'], 4.0)
    self.assertEqual(rows['make_train_step_dynamic']['compile_cpu_s'], 7.0)
    self.assertAlmostEqual(rows['make_train_step']['compile_vs_plain'],
                           4.0 / 3.0)
    with tempfile.TemporaryDirectory() as out:
      paths = step_compile.plot(result, out)
      self.assertTrue(all(os.path.getsize(p) > 0 for p in paths))

  def test_the_steps_trace(self):
    # The transformer's, traced from its arguments' shapes.
    for variant in step_compile.VARIANTS:
      step, args = step_compile._step_and_args('lm', variant)  # pylint: disable=protected-access
      out = jax.eval_shape(step, *args)
      if variant != 'plain':
        self.assertIsInstance(out[0], train_state.TrainState)


if __name__ == '__main__':
  absltest.main()
