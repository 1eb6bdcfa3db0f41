"""Any optax optimizer with half-precision params: as it is (its state keeps
the dtypes `init` gave it), or in the master-less layouts of
`haiku_mp.without_master` and the float32 copy of `haiku_mp.float32_master`;
`make_optimizer`'s hyperparameters."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import haiku_mp

PURE_BF16 = 'params=bfloat16,compute=bfloat16,output=float32'
F32 = 'params=float32,compute=float32,output=float32'
STEPS = 6
# The optimizers the issue names, each a fresh transformation.
OPTIMIZERS = {
    'adam': lambda: optax.adam(3e-2, b2=0.99),
    'lion': lambda: optax.lion(3e-3),
    'adafactor': lambda: optax.adafactor(3e-2),
    'clip_adamw': lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                      optax.adamw(3e-2)),
    'multi_steps': lambda: optax.MultiSteps(optax.adam(3e-2), 2),
}


def _problem(policy):
  """A linear classifier whose params `policy` stores, and its batch."""
  precision = haiku_mp.make_precision(policy, model_class='Linear')

  def forward(x, is_training):
    del is_training
    with haiku_mp.apply_precision(precision):
      return hk.Linear(3)(x)

  forward = hk.transform(forward)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 8)).astype(np.float32)
  batch = dict(image=jnp.asarray(x),
               label=jnp.asarray(np.argmax(x[:, :3], axis=1), jnp.int32))
  params = forward.init(jax.random.key(0), batch['image'], True)
  return haiku_mp.make_classification_loss(forward), params, batch


def _train(optimizer, policy=PURE_BF16):
  loss_fn, params, batch = _problem(policy)
  scaler = haiku_mp.LossScaler()
  state = haiku_mp.init_train_state(params, optimizer, scaler,
                                    jax.random.key(1))
  step = jax.jit(haiku_mp.make_train_step(loss_fn, optimizer, scaler))
  start = state
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics['loss']))
  return start, state, losses


def _dtypes(tree):
  return jax.tree.map(lambda x: jnp.asarray(x).dtype, tree)


class AnyOptimizerTest(parameterized.TestCase):

  @parameterized.named_parameters(*OPTIMIZERS.items())
  def test_as_it_is_with_bfloat16_params_is_one_line_naming_the_fix(self, make):
    # Its updates would be rounded to nearest into bfloat16 without a word.
    with self.assertRaisesRegex(
        TypeError, r"^train_step: \d+ params are half precision .* "
        r"haiku_mp.float32_master\(opt\), haiku_mp.without_master\(opt, "
        r"'stochastic'\) or 'kahan', or without_master\(opt, 'nearest'\) "
        r'for round-to-nearest$'):
      _train(make())

  @parameterized.named_parameters(*OPTIMIZERS.items())
  def test_rounded_to_nearest_when_asked(self, make):
    start, state, losses = _train(haiku_mp.without_master(make(), 'nearest'))
    self.assertLess(losses[-1], losses[0])
    self.assertEqual(int(state.skipped_steps), 0)
    # The params and every leaf of the optimizer's state keep their dtypes.
    chex.assert_trees_all_equal(_dtypes(state.params), _dtypes(start.params))
    chex.assert_trees_all_equal(_dtypes(state.opt_state),
                                _dtypes(start.opt_state))

  @parameterized.named_parameters(*OPTIMIZERS.items())
  def test_without_a_master_rounded_stochastically(self, make):
    start, state, losses = _train(haiku_mp.without_master(make(),
                                                          'stochastic'))
    self.assertLess(losses[-1], losses[0])
    self.assertEqual({str(d) for d in jax.tree.leaves(_dtypes(state.params))},
                     {'bfloat16'})
    chex.assert_trees_all_equal(_dtypes(state.opt_state),
                                _dtypes(start.opt_state))

  def test_a_float32_master_around_adam_with_its_b2(self):
    start, state, losses = _train(haiku_mp.float32_master(
        optax.adam(3e-2, b2=0.99)))
    self.assertLess(losses[-1], losses[0])
    master = state.opt_state.master
    self.assertEqual({str(d) for d in jax.tree.leaves(_dtypes(master))},
                     {'float32'})
    chex.assert_trees_all_equal(
        state.params, jax.tree.map(lambda m: m.astype(jnp.bfloat16), master))
    del start

  def test_a_layout_inside_a_chain_is_one_line(self):
    nested = optax.chain(optax.clip_by_global_norm(1.0),
                         haiku_mp.without_master(optax.adam(1e-2),
                                                 'stochastic'))
    with self.assertRaisesRegex(TypeError, 'it must wrap the whole '
                                'optimizer'):
      _train(nested)

  def test_no_master_for_float32_params_is_one_line(self):
    with self.assertRaisesRegex(ValueError, 'every param is float32'):
      _train(haiku_mp.without_master(optax.adam(1e-2), 'nearest'), F32)


class MakeOptimizerTest(absltest.TestCase):

  def test_its_adam_hyperparameters_are_optaxs(self):
    params = {'w': jnp.linspace(-1.0, 1.0, 6)}
    # Gradients that change from step to step, so that b2 matters after
    # bias correction.
    grads = [{'w': jnp.linspace(0.5, -0.2, 6) * (1 + 3 * i)} for i in range(3)]
    ours = haiku_mp.make_optimizer(optax.constant_schedule(1e-2), b1=0.8,
                                   b2=0.99, eps=1e-6, weight_decay=0.1)
    theirs = optax.adamw(1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1,
                         mask=lambda p: {'w': True})
    for optimizer in (ours, theirs):
      state = optimizer.init(params)
      for g in grads:
        updates, state = optimizer.update(g, state, params)
      if optimizer is ours:
        ours_updates = updates
    chex.assert_trees_all_close(ours_updates, updates, rtol=1e-6)
    # Another b2 gives another update: the value reaches the optimizer.
    other = haiku_mp.make_optimizer(optax.constant_schedule(1e-2), b1=0.8,
                                    b2=0.9, eps=1e-6, weight_decay=0.1)
    state = other.init(params)
    for g in grads:
      other_updates, state = other.update(g, state, params)
    self.assertFalse(np.allclose(other_updates['w'], updates['w']))


if __name__ == '__main__':
  absltest.main()
