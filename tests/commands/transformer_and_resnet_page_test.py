"""docs/transformer_and_resnet.md's script, run as a user runs it: from a
temporary directory outside the checkout, against the installed package."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json

from absl.testing import absltest

from tests import helpers
from tests.commands import your_model_test

PAGE = os.path.join(helpers.ROOT, 'docs', 'transformer_and_resnet.md')
# Appended to the page's script: what the test reads of the run, as JSON.
_REPORT = '''
import json as _json, os as _os
print(_json.dumps(dict(
    cwd=_os.getcwd(),
    lm={name: dict(loss=loss, skipped=int(state.skipped_steps),
                   scale=float(state.loss_scale.scale),
                   dtypes=sorted({str(v.dtype)
                                  for v in jax.tree.leaves(state.params)}))
        for name, (state, loss) in lm_runs.items()},
    resnet_losses=resnet_losses, bit_exact=bit_exact,
    state_dtypes=state_dtypes, accuracy=accuracy,
    state_keys=sorted(straight.model_state))))
'''


@helpers.long_running
class TransformerAndResnetPageTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.report = json.loads(your_model_test.run_page(
        PAGE, 'my_models.py', _REPORT)[-1])

  def test_it_ran_outside_the_checkout(self):
    self.assertFalse(self.report['cwd'].startswith(helpers.ROOT))

  def test_every_lm_precision_trains_near_float32(self):
    runs = self.report['lm']
    self.assertLen(runs, 5)
    for name, run in runs.items():
      # From ln(15) = 2.7 at init: the counting is learned.
      self.assertLess(run['loss'], 0.6, name)
      self.assertLess(abs(run['loss'] - runs['float32']['loss']), 0.05, name)

  def test_float16_with_a_padding_mask_skips_nothing(self):
    run = self.report['lm']['float16, padding masked']
    self.assertEqual(run['skipped'], 0)
    self.assertGreaterEqual(run['scale'], 2.0**15)
    for run in self.report['lm'].values():
      self.assertEqual(run['skipped'], 0)

  def test_the_state_without_master_is_bfloat16(self):
    # LayerNorm's params stay float32 (its default policy).
    self.assertEqual(self.report['lm']['bfloat16 state, no master']['dtypes'],
                     ['bfloat16', 'float32'])
    self.assertEqual(self.report['lm']['bfloat16']['dtypes'], ['float32'])

  def test_resnet_trains_resumes_bit_for_bit_and_keeps_float32_state(self):
    losses = self.report['resnet_losses']
    self.assertLess(losses[-1], losses[0])
    self.assertTrue(self.report['bit_exact'])
    self.assertEqual(self.report['state_dtypes'], ['float32', 'int32'])
    self.assertTrue(any('batchnorm' in k for k in self.report['state_keys']))
    # Evaluated on a training batch with the moving statistics: above
    # chance (0.1).
    self.assertGreater(self.report['accuracy'], 0.3)


if __name__ == '__main__':
  absltest.main()
