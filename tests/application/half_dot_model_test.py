"""Half-precision matmuls in the ViT: the dtypes that reach its matmuls per setting."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized

from haiku_mp.lab.studies import matmul_precision as precision_lab
from haiku_mp.lab import variants
from haiku_mp.model import half_dot
from haiku_mp.vit import settings as settings_lib
from tests import helpers


class ModelTest(parameterized.TestCase):
  """The tiny ViT's loss and gradients against a float64 reference."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = helpers.tiny_config(num_layers=1)
    cls.reference = precision_lab.reference(settings_lib.parse(cls.config), 8)

  def _errors(self, dtype, form):
    variant = settings_lib.replace(
        variants.variant_settings(settings_lib.parse(self.config), dtype, 8,
                                  'single:1x1'),
        precision=dict(dot_form=form))
    return precision_lab.error_vs(variant, self.reference, 8)

  # Within a few units of each dtype's rounding (bf16: 2**-8, fp16: 2**-11).
  @parameterized.parameters(('bfloat16', 'native', 3e-2),
                            ('bfloat16', 'auto', 3e-2),
                            ('float16', 'native', 4e-3),
                            ('float16', 'auto', 4e-3))
  def test_half_gradients_agree_with_float64(self, dtype, form, tolerance):
    errors_ = self._errors(dtype, form)
    self.assertLess(errors_['grads_relative_error'], tolerance)
    self.assertGreater(errors_['grads_relative_error'], 1e-5)  # Really half.

  def test_float32_is_the_same_whatever_the_form(self):
    results = {form: self._errors('float32', form) for form in half_dot.FORMS}
    for form in half_dot.FORMS:
      self.assertEqual(results[form], results['plain'], form)
    self.assertLess(results['plain']['grads_relative_error'], 1e-5)


if __name__ == '__main__':
  absltest.main()
