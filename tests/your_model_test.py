"""docs/your_model.md's example, run as written, and the public surface it
imports from."""

import os
import sys

if __name__ == '__main__':  # `python tests/x_test.py`: `tests` from the root.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib
import io
import re

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax
import numpy as np

import haiku_mp
from haiku_mp import advisor
from haiku_mp import model
from haiku_mp import update

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'docs', 'your_model.md')


def page_code(path: str = PAGE) -> str:
  """The page's one Python block."""
  with open(path) as f:
    blocks = re.findall(r'```python\n(.*?)```', f.read(), re.S)
  if len(blocks) != 1:
    raise AssertionError(f'{path}: expected one python block, found '
                         f'{len(blocks)}')
  return blocks[0]


class YourModelPageTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.namespace = {'__name__': 'your_model_page'}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      exec(compile(page_code(), PAGE, 'exec'), cls.namespace)  # pylint: disable=exec-used
    cls.printed = printed.getvalue()

  def test_the_loss_goes_down(self):
    losses = self.namespace['losses']
    self.assertLess(losses[-1], losses[0] / 5)

  def test_the_matmuls_run_in_float16_but_the_head(self):
    calls = []
    np_batch = self.namespace['batches'][0]
    precision = haiku_mp.make_precision(
        self.namespace['F16'], f'*/head:{self.namespace["F32"]}',
        model_class='Classifier')
    # The page's policies, observed: hidden's matmul inputs are float16, the
    # head's float32, LayerNorm computes in float32.
    classifier = self.namespace['Classifier']

    def forward(images):
      with haiku_mp.apply_precision(precision, calls.append):
        return classifier(precision.dots)(images, True)

    hk.transform(forward).init(jax.random.key(0), np_batch['image'])
    dtypes = {c.path: c.policy.compute_dtype for c in calls}
    self.assertEqual(np.dtype(dtypes['classifier/hidden']), np.float16)
    self.assertEqual(np.dtype(dtypes['classifier/norm']), np.float32)
    self.assertEqual(np.dtype(dtypes['classifier/head']), np.float32)

  def test_the_loss_scale_grew_and_no_step_was_skipped(self):
    state = self.namespace['state']
    self.assertEqual(int(state.skipped_steps), 0)
    # 48 finite steps at period 20: two doublings from 2^15.
    self.assertEqual(float(state.loss_scale.scale), 2.0**17)

  def test_the_advisor_judges_every_module(self):
    advice = self.namespace['advice']
    self.assertEqual(list(advice.verdicts),
                     ['classifier/hidden', 'classifier/norm',
                      'classifier/head'])
    low, high = advice.scale_window
    self.assertLessEqual(low, 15)
    self.assertGreaterEqual(high, 17)
    self.assertIn('overrides for float16:', self.printed)


class PublicSurfaceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('haiku_mp', haiku_mp), ('model', model), ('update', update),
      ('advisor', advisor))
  def test_every_public_name_resolves_and_none_is_private(self, package):
    self.assertNotEmpty(package.__all__)
    for name in package.__all__:
      self.assertFalse(name.startswith('_'), name)
      self.assertTrue(hasattr(package, name), name)

  def test_the_top_level_holds_the_model_and_update_surfaces(self):
    self.assertCountEqual(haiku_mp.__all__,
                          model.__all__ + update.__all__)


if __name__ == '__main__':
  absltest.main()
