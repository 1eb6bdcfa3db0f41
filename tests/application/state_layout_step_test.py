"""The train step over the ViT's state layouts: what each layout's step keeps and rounds."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from haiku_mp.update import step as step_lib
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from tests import helpers

FP32 = 'params=float32,compute=float32,output=float32'
BF16_PARAMS = 'params=bfloat16,compute=bfloat16,output=float32'


def _jitted_step(exp):
  """The experiment's train step, built here on one device (jitted)."""
  return jax.jit(step_lib.make_train_step(
      exp.loss_fn, exp.optimizer, exp.scaler))


def _copy(tree):
  return jax.tree.map(np.array, tree)


# (param_update, mu_dtype, nu_dtype): layouts without a float32 master, their
# kinds of state (stochastic draws, a compensation, bfloat16 moments, 8-bit
# moments: codes and block scales).
NO_MASTER_LAYOUTS = (('stochastic', 'bfloat16', 'bfloat16'),
                     ('kahan', 'float32', 'bfloat16'),
                     ('stochastic', 'float8_blocks', 'float8_blocks'))
# The dtypes a moment's leaves hold.
_MOMENT_LEAF_DTYPES = {'float32': {jnp.dtype(jnp.float32)},
                       'bfloat16': {jnp.dtype(jnp.bfloat16)},
                       'float8_blocks': {jnp.dtype(jnp.float8_e4m3fn),
                                         jnp.dtype(jnp.float32)}}


@helpers.long_running
class StateLayoutStepTest(parameterized.TestCase):
  """bfloat16 params without a master copy, in the whole train step."""

  @parameterized.parameters(*NO_MASTER_LAYOUTS)
  def test_a_skipped_step_changes_no_state_and_draws_as_a_taken_one(
      self, update, mu_dtype, nu_dtype):
    config = helpers.tiny_config(BF16_PARAMS, loss_scale='dynamic')
    config.precision.update(param_update=update, mu_dtype=mu_dtype,
                            nu_dtype=nu_dtype)
    config.ema_decay = 0.5
    config.learning_rate = 1e-2
    exp = experiment.build_without_data(settings_lib.parse(config))
    step = _jitted_step(exp)
    batch = helpers.random_batch(config)
    state = exp.strategy.init_state()
    losses = []
    for _ in range(8):
      state, metrics = step(state, batch)
      losses.append(float(metrics['loss']))
    self.assertLess(losses[-1], 0.9 * losses[0])
    chex.assert_trees_all_equal_dtypes(state.params,
                                       exp.strategy.init_state().params)
    self.assertEqual(state.params['vit/head']['w'].dtype, jnp.bfloat16)
    self.assertIsNone(optax.tree_utils.tree_get(state.opt_state, 'master'))
    ema = optax.tree_utils.tree_get(state.opt_state, 'ema_params')
    self.assertEqual({x.dtype for x in jax.tree.leaves(ema)},
                     {jnp.dtype(jnp.float32)})
    nu = optax.tree_utils.tree_get(state.opt_state, 'nu')
    self.assertEqual({x.dtype for x in jax.tree.leaves(nu)},
                     _MOMENT_LEAF_DTYPES[nu_dtype])

    before = _copy((state.params, state.opt_state))
    rng = jax.random.key_data(state.rng)
    bad = dict(batch, image=batch['image'].at[0, 0, 0, 0].set(jnp.inf))
    state, metrics = step(state, bad)
    self.assertFalse(bool(metrics['grads_finite']))
    chex.assert_trees_all_equal(_copy((state.params, state.opt_state)), before)
    # The key moves on as after a taken step: a skip shifts no later draw.
    chex.assert_trees_all_equal(
        jax.random.key_data(state.rng),
        jax.random.key_data(jax.random.split(
            jax.random.wrap_key_data(rng), 3)[0]))

  def test_updates_lost_counts_what_rounding_to_nearest_drops(self):
    """At a small learning rate most of a step's updates are below half a
    bfloat16 ulp: rounded to nearest they are lost; stochastically, fewer
    params move but by a whole ulp, so on average none is; float32 params
    lose nothing.

    The stochastic rounding is drawn from the state key (its step, without
    dropout or augmentation, checked first): two steps from the same state
    round alike; from another key, the same gradients round some params the
    other way."""
    lost = {}
    for name, policy, update in (('float32', FP32, 'master'),
                                 ('nearest', BF16_PARAMS, 'nearest'),
                                 ('stochastic', BF16_PARAMS, 'stochastic')):
      config = helpers.tiny_config(policy)
      config.precision.param_update = update
      config.learning_rate = 1e-4
      if name == 'stochastic':
        config.model.dropout_rate = 0.0
        config.data.augment = False
      exp = experiment.build_without_data(settings_lib.parse(config))
      step = _jitted_step(exp)
      state = exp.strategy.init_state()
      if name == 'stochastic':
        self._assert_drawn_from_the_state_key(step, state,
                                              helpers.random_batch(config))
      for _ in range(3):
        state, metrics = step(state, helpers.random_batch(config))
      lost[name] = float(metrics['updates_lost'])
    self.assertLess(abs(lost['float32']), 1e-3)  # float32's own rounding.
    self.assertGreater(lost['nearest'], 0.5)
    # Stochastic: unbiased, its noise a few percent at this size.
    self.assertLess(abs(lost['stochastic']), 0.15)

  def _assert_drawn_from_the_state_key(self, step, state, batch):
    one, _ = step(state, batch)
    chex.assert_trees_all_equal(one.params, step(state, batch)[0].params)
    # Another key, committed to the state's device as its own is (an
    # uncommitted one would compile the step again).
    key = jax.device_put(jax.random.key(9), state.rng.sharding)
    other, _ = step(state._replace(rng=key), batch)
    # No dropout, no augmentation: the same gradients, rounded otherwise.
    chex.assert_trees_all_equal(one.opt_state, other.opt_state)
    differ = [not np.array_equal(a, b) for a, b in
              zip(jax.tree.leaves(one.params), jax.tree.leaves(other.params))]
    self.assertTrue(any(differ))


if __name__ == '__main__':
  absltest.main()
