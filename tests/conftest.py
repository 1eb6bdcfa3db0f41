"""pytest: the test package's eight CPU devices before any module loads JAX."""

import tests  # pylint: disable=unused-import
