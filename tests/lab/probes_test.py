"""probes: one pass gives every module's output and output-gradient
statistics, equal to a direct computation on the captured tensors."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp.advisor import numerics
from haiku_mp.advisor import probes
from haiku_mp.lab.advisor import module_statistics
from haiku_mp.lab import variants
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

SCALE = 2.0**12


def tiny_reference(config=None):
  """The float32 reference of `config` (default: the tiny ViT) and its
  params with a random (not zero) head, so that gradients reach every
  module."""
  exp = experiment.build_without_data(variants.float32_reference(
      settings_lib.parse(config or helpers.tiny_config())))
  params = exp.strategy.init_state().params
  head = params['vit/head']
  params['vit/head'] = dict(
      w=jax.random.normal(jax.random.key(1), head['w'].shape) * 0.3,
      b=jax.random.normal(jax.random.key(2), head['b'].shape) * 0.3)
  return exp, params


def _capture(loss_fn, params, rng, batch, paths):
  """Each module's own output and the gradient reaching it, directly: a
  zero added to each output, differentiated."""
  outputs = {}

  def loss(zeros):
    def intercept(next_f, args, kwargs, context):
      out = next_f(*args, **kwargs)
      if context.method_name != '__call__':
        return out
      path = context.module.module_name
      if path in paths and path not in outputs:
        outputs[path] = out
        out = out + zeros.get(path, 0.0)
      return out
    outputs.clear()
    with hk.intercept_methods(intercept):
      value = loss_fn(params, rng, batch)[0]
    return value, dict(outputs)

  shapes = jax.eval_shape(loss, {})[1]
  zeros = {p: jnp.zeros(s.shape, s.dtype) for p, s in shapes.items()}
  # Jitted: one program, not a compile per op of the model's passes.
  grads, captured = jax.jit(jax.grad(loss, has_aux=True))(zeros)
  return captured, grads


@helpers.long_running
class StatisticsTest(absltest.TestCase):

  def test_module_statistics_equal_a_direct_computation(self):
    exp, params = tiny_reference()
    batch = helpers.random_batch(exp.settings, 8)
    rng = jax.random.key(3)
    paths = list(module_statistics.module_classes(exp))
    stats = probes.statistics_fn(exp.loss_fn, paths)
    modules, param_stats = stats.fn(params, rng, batch, SCALE)
    self.assertEqual(stats.aliases, {
        'vit/encoder_block_0/attention': 'vit/encoder_block_0/attention/out',
        'vit': 'vit/head'})
    self.assertEqual(set(modules), set(paths) - set(stats.aliases))
    outputs, grads = _capture(exp.loss_fn, params, rng, batch, set(paths))
    for path, vector in modules.items():
      vector = np.asarray(vector)
      helpers.assert_stats_equal(
          self, numerics.as_dict(vector[:numerics.SIZE]),
          helpers.numpy_stats(outputs[path]), f'{path} output', ulps=True)
      helpers.assert_stats_equal(
          self, numerics.as_dict(vector[numerics.SIZE:]),
          helpers.numpy_stats(grads[path], SCALE), f'{path} gradient',
          ulps=True)
      self.assertGreater(
          numerics.as_dict(vector[numerics.SIZE:])['nonzero'], 0, path)
    param_grads = jax.jit(jax.grad(
        lambda p: exp.loss_fn(p, rng, batch)[0]))(params)
    for module, names in param_grads.items():
      for name, grad in names.items():
        if module.endswith('/key') and name == 'b':
          continue  # Zero but for rounding noise (the softmax cancels it).
        helpers.assert_stats_equal(
            self, numerics.as_dict(np.asarray(param_stats[module][name])),
            helpers.numpy_stats(grad, SCALE), f'{module}/{name}', ulps=True)


if __name__ == '__main__':
  absltest.main()
