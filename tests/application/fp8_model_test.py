"""fp8 in the ViT trainer: its models learn as bfloat16's do, the start lines name each Linear's choice, a killed delayed-scaling run resumes bit for bit."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import json
import signal
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from haiku_mp.lab.studies import fp8_gemms
from haiku_mp.model import fp8
from haiku_mp.model import meta_params
from haiku_mp.update import train_state
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import overview
from tests import helpers
from tests.library import fp8_test

BLOCK_LINEARS = ('attention/query', 'attention/key', 'attention/value',
                 'attention/out', 'mlp_block/fc1', 'mlp_block/fc2')


@helpers.long_running
class ModelTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('encoder_blocks', '*/encoder_block_*',
       [f'vit/encoder_block_{i}/{m}' for i in (0, 1) for m in BLOCK_LINEARS]),
      ('one_layer', '*/encoder_block_1/mlp_block/fc1',
       ['vit/encoder_block_1/mlp_block/fc1']),
      ('every_linear', 'Linear',
       [f'vit/encoder_block_{i}/{m}' for i in (0, 1) for m in BLOCK_LINEARS]
       + ['vit/head']))
  def test_the_lowered_step_takes_fp8_exactly_in_the_configured_modules(
      self, modules, expected):
    result = fp8_gemms.run(settings_lib.parse(fp8_test.vit_config(modules)),
                           compile_step=False,
                           log=lambda _: None)
    fp8_rows = [r for r in result['matmuls'] if r['fp8_operands']]
    self.assertEqual(sorted({r['module'] for r in fp8_rows}), sorted(expected))
    formats = {('fprop', 'f8e4m3fn', 'f8e4m3fn'), ('dgrad', 'f8e5m2',
                                                    'f8e4m3fn'),
               ('wgrad', 'f8e4m3fn', 'f8e5m2')}
    for module in expected:
      self.assertEqual({(r['pass'], r['lhs'], r['rhs']) for r in fp8_rows
                        if r['module'] == module}, formats, module)
    self.assertLen(fp8_rows, 3 * len(expected))
    self.assertEqual(result['fp8_linears'], len(expected))
    # Every other matmul (the patch embedding, attention's batched dots, the
    # head unless selected) keeps the compute dtype or float32.
    others = [r for r in result['matmuls'] if not r['fp8_operands']]
    self.assertNotEmpty(others)
    for r in others:
      self.assertIn(r['lhs'], ('bf16', 'f32'), r)

  def _assert_histories_at_init(self, exp, state):
    """Delayed scaling's amax histories: params (per fp8 Linear, one per
    operand) that no optimizer sees."""
    histories, trained = train_state.split_fp8(state.params)
    self.assertLen(histories, 6)  # The six Linears of the block.
    for module in histories.values():
      self.assertEqual(sorted(module), sorted(meta_params.HISTORY_NAMES))
      for h in module.values():
        chex.assert_shape(h, (4,))
        chex.assert_type(h, jnp.float32)
    # The optimizer's state is that of the trained params alone.
    self.assertEqual(
        len(jax.tree.leaves(state.opt_state)),
        len(jax.tree.leaves(exp.optimizer.init(trained))))
    self.assertNotIn('fp8', ' '.join(exp.param_names))

  def _assert_histories_rolled_3_steps(self, state):
    histories, _ = train_state.split_fp8(state.params)
    for module in histories.values():
      for name, h in module.items():
        h = np.asarray(h)
        # Three steps' amaxes, newest first, then the initial zero. The
        # zero-initialized head passes no gradient back at the first step:
        # the output gradients' first amax is 0.
        seen = 2 if name == 'fp8_g_amax_history' else 3
        self.assertTrue((h[:seen] > 0).all() and not h[seen:].any(),
                        (name, h))

  def test_fp8_models_learn_a_batch_as_the_bfloat16_one_does(self):
    """Each scaling learns as bfloat16 does; the delayed one's histories
    are params no optimizer sees, and they roll (read after its third
    step)."""
    start = {}  # bfloat16's initial state, its key as data (a copy).

    def losses(modules, scaling):
      config = fp8_test.vit_config(modules, scaling=scaling,
                                   learning_rate=3e-3,
                                   **{'model.num_layers': 1})
      exp = experiment.build_without_data(settings_lib.parse(config))
      strategy = exp.strategy
      delayed = modules and scaling == 'delayed'
      if start and not delayed:
        # Current and MX scaling hold bfloat16's params and no more: they
        # start where it did (one initial program, not three).
        state = start['state']
        state = state._replace(rng=jax.random.wrap_key_data(state.rng))
        chex.assert_trees_all_equal_shapes_and_dtypes(exp.abstract_state,
                                                      state)
        state = strategy.place_state(state)
      else:
        state = strategy.init_state()
        if not modules:
          start['state'] = jax.device_get(
              state._replace(rng=jax.random.key_data(state.rng)))
      if delayed:
        self._assert_histories_at_init(exp, state)
      batch = strategy.place_batch(helpers.random_batch(config, 8, seed=0))
      out = []
      for i in range(16):
        state, metrics = strategy.train_step(state, batch)
        out.append(float(metrics['loss']))
        if delayed and i == 2:
          self._assert_histories_rolled_3_steps(state)
      return np.array(out)

    bf16 = losses('', 'current')
    self.assertLess(bf16[-1], 0.8 * bf16[0])
    for scaling in fp8.SCALINGS:
      got = losses('*/encoder_block_*', scaling)
      self.assertLess(got[-1], 0.8 * got[0], scaling)
      self.assertTrue(np.isfinite(got).all(), scaling)
      np.testing.assert_allclose(got, bf16, rtol=0.03, err_msg=scaling)


class ModelLineTest(absltest.TestCase):

  def test_the_model_line_says_what_each_scaling_runs(self):
    """Settings that apply to the scaling (MX takes no margin) and how it is
    emulated: MX on every backend, per block; the others on a CPU."""
    cpu = jax.default_backend() == 'cpu'
    expected = {
        'current': 'current (margin 0) scaling' + (
            ' (emulated: XLA:CPU converts f8 to f16 and runs float32 dots)'
            if cpu else ''),
        'delayed': 'delayed (history 4, margin 0) scaling' + (
            ' (emulated: XLA:CPU converts f8 to f16 and runs float32 dots)'
            if cpu else ''),
        'mx': 'mx (a power-of-two scale per 32 values) scaling (emulated: '
              'blocks quantized and dequantized, float32 dots)'}
    for scaling in fp8.SCALINGS:
      exp = experiment.build_without_data(
          settings_lib.parse(fp8_test.vit_config(scaling=scaling)))
      line = overview.summary_line(overview.module_rows(exp), '',
                                       exp.precision)
      self.assertTrue(line.endswith(
          '; fp8 matmuls: 12 Linear, E4M3 forward, E5M2 gradients, '
          + expected[scaling]), line)


@helpers.long_running
class ResumeTest(absltest.TestCase):

  def test_a_killed_delayed_scaling_run_resumes_bit_exactly(self):
    tmp = self.enter_context(tempfile.TemporaryDirectory())
    flags = ['--config=configs/vit_fp8.py:blocks',
             '--config.data.source=synthetic',
             '--config.precision.low_bit.scaling=delayed',
             '--config.precision.low_bit.history_length=4',
             '--config.num_train_steps=8', '--config.log_every_steps=1',
             '--config.eval_every_steps=8', '--config.checkpoint_every_steps=4',
             '--config.batch_size=8', '--config.eval_batch_size=8',
             '--config.data.synthetic_eval_examples=8',
             '--config.data.synthetic_train_examples=32',
             f'--config.compilation_cache_dir={tmp}/cache',
             *helpers.TINY_MODEL_FLAGS]
    straight = helpers.run_module('launch.train', *flags,
                                  f'--workdir={tmp}/straight', devices=1,
                                  timeout=300)
    self.assertEqual(straight.returncode, 0, straight.stderr[-3000:])
    self.assertIn('fp8 matmuls: 6 Linear, E4M3 forward, E5M2 gradients, '
                  'delayed (history 4, margin 0) scaling', straight.stderr)
    killed = helpers.run_module(
        'tests.signal_at_step', *flags, f'--workdir={tmp}/resumed',
        devices=1, env={'SIGNAL_AT_STEP': 'KILL:6'}, timeout=300)
    self.assertEqual(killed.returncode, -signal.SIGKILL)
    resumed = helpers.run_module('launch.train', *flags,
                                 f'--workdir={tmp}/resumed', devices=1,
                                 timeout=300)
    self.assertEqual(resumed.returncode, 0, resumed.stderr[-3000:])
    self.assertIn('at step 4.', resumed.stderr)

    def final(run):
      return ocp.StandardCheckpointer().restore(
          f'{tmp}/{run}/checkpoints/8/default')

    def losses(run):
      with open(f'{tmp}/{run}/metrics.jsonl') as f:
        return [e['loss'] for e in map(json.loads, f) if e['split'] == 'train']

    want, got = final('straight'), final('resumed')
    histories = [v for k, v in jax.tree_util.tree_flatten_with_path(want)[0]
                 if 'amax_history' in jax.tree_util.keystr(k)]
    self.assertLen(histories, 3 * 6)  # Three per fp8 Linear, six Linears.
    self.assertTrue(all((np.asarray(h) > 0).all() for h in histories))
    chex.assert_trees_all_equal(got, want)
    self.assertEqual(losses('resumed')[-4:], losses('straight')[-4:])


if __name__ == '__main__':
  absltest.main()
