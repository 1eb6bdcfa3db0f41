"""Runs a module as if some packages were not installed.

`python -m tests.without_modules tensorflow,tensorflow_datasets launch.train
--flags...`: importing a listed package raises ImportError, as on a machine
without it (the GPU machines have no TensorFlow).
"""

import runpy
import sys

if __name__ == '__main__':
  blocked, module = sys.argv[1], sys.argv[2]
  for name in blocked.split(','):
    sys.modules[name] = None  # `import name` now raises ImportError.
  sys.argv = [module] + sys.argv[3:]
  runpy.run_module(module, run_name='__main__', alter_sys=True)
