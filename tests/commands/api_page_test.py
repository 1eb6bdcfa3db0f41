"""docs/api.md is the code's: every public name with a summary and a
two-line example, and the page as `launch.api_page` writes it."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest

from launch import api_page


class ApiPageTest(absltest.TestCase):

  def test_every_public_name_has_a_summary_and_an_example(self):
    for package in api_page.PACKAGES:
      for name in package.__all__:
        summary, example = api_page.parts(getattr(package, name))
        self.assertNotEmpty(summary, name)
        lines = [l for l in example.splitlines() if l.strip()]
        self.assertGreaterEqual(len(lines), 2, f'{name}: {example!r}')
        compile(example, name, 'exec')  # Python, whatever it refers to.

  def test_the_page_is_up_to_date(self):
    with open(api_page.PAGE) as f:
      self.assertEqual(f.read(), api_page.page(),
                       'docs/api.md is out of date: run python -m '
                       'launch.api_page')


if __name__ == '__main__':
  absltest.main()
