"""4-bit Linears in the ViT trainer: the model trains, its module table, matmul listing and checkpoints, a resume is bit exact."""

import contextlib
import copy
import os
import sys
import tempfile

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from haiku_mp import errors as haiku_mp_errors
from haiku_mp.lab.studies import fp8_gemms
from haiku_mp.model import fp4
from haiku_mp.model import fp4_blocks
from haiku_mp.vit.parallel import sharding as sharding_lib
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.train import checkpoint
from haiku_mp.vit.train import experiment
from haiku_mp.vit.train import overview
from tests import helpers


BLOCK_LINEARS = ('attention/query', 'attention/key', 'attention/value',
                 'attention/out', 'mlp_block/fc1', 'mlp_block/fc2')


def _config(**fp8):
  config = helpers.tiny_config('params=float32,compute=bfloat16,output=float32')
  config.precision.low_bit.update(dict(dict(modules='*/encoder_block_*',
                                            format='nvfp4'), **fp8))
  return config


@helpers.long_running
class ModelTest(absltest.TestCase):
  """The tiny ViT with its encoder blocks' Linears in NVFP4, as a config
  asks for it."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One set of settings (dropout off, 16 images: whole blocks of tokens)
    # for the step's jaxpr, its listing and the resume, so that they share
    # one compiled train step.
    cls.config = _config()
    cls.config.model.dropout_rate = 0.0
    cls.config.data.source = 'synthetic'
    cls.config.batch_size = 16
    cls.exp = experiment.build_without_data(settings_lib.parse(cls.config))
    cls.batches = [helpers.random_batch(cls.config, 16, seed=s)
                   for s in range(4)]
    cls._traced = cls._compiled = None

  @classmethod
  def _traced_step(cls):
    """The trainer's step traced on abstract inputs, as the `fp8` study
    lowers it."""
    if cls._traced is None:
      cls._traced = cls.exp.strategy.train_step.trace(
          *cls.exp.abstract_inputs())
    return cls._traced

  @classmethod
  def _step(cls):
    """That step compiled: one program for this class's one-device steps
    and the study's listing (which then loads it from the persistent
    cache)."""
    if cls._compiled is None:
      cls._compiled = cls._traced_step().lower().compile()
    return cls._compiled

  def test_the_step_runs_every_gemm_of_the_chosen_linears_in_4_bits(self):
    """The trainer's step, its listing (`fp8` study) and its start line."""
    exp = self.exp
    eqns = list(helpers.iter_eqns(self._traced_step().jaxpr.jaxpr))
    linears = 6  # One block: query, key, value, out, fc1, fc2.
    dequantized = [e for e in eqns if e.primitive.name == 'dot_general'
                   and e.params['precision'] is not None]
    self.assertLen(dequantized, 3 * linears)  # Forward, dx, dw.
    casts = [e for e in eqns if e.primitive.name == 'convert_element_type'
             and e.params['new_dtype'] == fp4_blocks.E2M1]
    # x and w forward, x along the tokens backward (the gradients are
    # rounded stochastically, on the grid).
    self.assertLen(casts, 3 * linears)
    line = overview.summary_line(overview.module_rows(exp), '',
                                     exp.precision)
    self.assertTrue(line.endswith(
        '; 4-bit matmuls: 6 Linear, nvfp4 (blocks of 16), 16x16 weight tiles, '
        'Hadamard on the weight gradient, stochastic gradients (emulated: '
        'dequantized float32 GEMMs)'), line)
    state = exp.strategy.init_state()
    signs = {k: np.asarray(v[fp4.SIGNS_NAME]) for k, v in state.params.items()
             if fp4.SIGNS_NAME in v}
    self.assertLen(signs, linears)
    step = self._step()
    losses = []
    for _ in range(4):
      state, metrics = step(state, self.batches[0])
      losses.append(float(metrics['loss']))
    self.assertEqual(losses, sorted(losses, reverse=True))
    for path, drawn in signs.items():  # Kept as they were drawn.
      np.testing.assert_array_equal(state.params[path][fp4.SIGNS_NAME], drawn)
    # The listing: each 4-bit Linear's three GEMMs (one block: the ViT's
    # blocks are alike), compiled (the program above, from the cache).
    result = fp8_gemms.run(settings_lib.parse(self.config), compile_step=True,
                           log=lambda _: None)
    low = [r for r in result['matmuls'] if r['format'] == 'nvfp4']
    expected = [f'vit/encoder_block_0/{m}' for m in BLOCK_LINEARS]
    self.assertEqual(sorted({r['module'] for r in low}), sorted(expected))
    self.assertLen(low, 3 * len(expected))
    for r in low:
      self.assertEqual((r['lhs'], r['rhs']), ('f32', 'f32'), r)
      self.assertStartsWith(r['fp8_gemm'], 'emulated: nvfp4 blocks')
    self.assertEqual(result['fp4_matmuls'], len(low))
    self.assertFalse(any(r['fp8_operands'] for r in result['matmuls']))
    self.assertIn(f'{len(low)} on nvfp4 operands', fp8_gemms.summary(result))
    self.assertIn('fp8_gemm', fp8_gemms.table(result))

  def test_kept_linears_run_fp8_beside_the_4_bit_ones(self):
    """`keep_fp8` (the advisor's override): fc1 and fc2 take E4M3 / E5M2
    operands, the attention's four Linears 4-bit ones."""
    config = _config(keep_fp8='*/mlp_block')
    exp = experiment.build_without_data(settings_lib.parse(config))
    state = exp.abstract_state  # Traced only: no state to compute.
    batch = helpers.random_batch(config, 16)
    eqns = list(helpers.iter_eqns(jax.make_jaxpr(exp.strategy.train_step)(
        state, batch).jaxpr))
    fp8_dots = [e for e in eqns if e.primitive.name == 'dot_general' and
                {v.aval.dtype for v in e.invars} <= {jnp.dtype(jnp.float8_e4m3fn),
                                                     jnp.dtype(jnp.float8_e5m2)}]
    self.assertLen(fp8_dots, 3 * 2)  # fc1, fc2: forward, dx, dw.
    casts = [e for e in eqns if e.primitive.name == 'convert_element_type'
             and e.params['new_dtype'] == fp4_blocks.E2M1]
    self.assertLen(casts, 3 * 4)  # query, key, value, out.
    signs = {k for k, v in state.params.items() if fp4.SIGNS_NAME in v}
    self.assertEqual(signs, {f'vit/encoder_block_0/attention/{n}'
                             for n in ('query', 'key', 'value', 'out')})
    line = overview.summary_line(overview.module_rows(exp), '',
                                     exp.precision)
    self.assertIn('; 4-bit matmuls: 4 Linear (2 kept in fp8), nvfp4', line)

  def test_a_resume_is_bit_exact_and_pjit_stays_with_one_device(self):
    """The gradients' stochastic rounding draws from the state's key: 2
    steps, a checkpoint, 2 more are the 4 straight steps bit for bit; a
    pjit run over a (1, 8) mesh, whose program is the whole batch's, stays
    near them. (Not bit for bit: XLA:CPU sums a shard's GEMM in another
    order than the whole batch's, and a last-bit difference in a bfloat16
    activation flips one of its 4-bit roundings now and then; the draws
    themselves agree, `test_pjit_draws_and_mixes_as_one_device`.)"""
    exp = self.exp

    def steps(state, first, last, strategy=exp.strategy, step=self._step()):
      losses = []
      for batch in self.batches[first:last]:
        state, metrics = step(state, strategy.place_batch(batch))
        losses.append(float(metrics['loss']))
      return state, losses

    straight, losses = steps(exp.strategy.init_state(), 0, 4)
    with tempfile.TemporaryDirectory() as workdir:
      with contextlib.closing(checkpoint.Checkpointer(workdir, 1)) as ckpt:
        ckpt.save(2, steps(exp.strategy.init_state(), 0, 2)[0])
      with contextlib.closing(checkpoint.Checkpointer(workdir, 1)) as ckpt:
        _, restored = ckpt.restore_latest(exp.abstract_state)
    resumed, _ = steps(exp.strategy.place_state(restored), 2, 4)
    storable = lambda s: jax.device_get(s._replace(
        rng=jax.random.key_data(s.rng)))
    chex.assert_trees_all_equal(storable(resumed), storable(straight))
    # The batch on one replica: a 4-bit Linear's token blocks are each
    # device's (16 examples of 5 tokens), the kernels split 8 ways.
    config = copy.deepcopy(self.config)
    config.parallel.update(strategy='pjit', mesh_shape=(1, 8))
    pjit = experiment.build(settings_lib.parse(config)).strategy
    _, pjit_losses = steps(pjit.init_state(), 0, 4, pjit, pjit.train_step)
    np.testing.assert_allclose(pjit_losses, losses, rtol=1e-4)

  def test_pjit_draws_and_mixes_as_one_device(self):
    """The stochastic roundings and the Hadamard transform of a gradient
    split over the mesh as the pjit step splits it (tokens over `batch`,
    features over `model`) are one device's, bit for bit."""
    # Four devices split both axes as eight do.
    mesh = sharding_lib.make_mesh((2, 2), jax.devices()[:4])
    g = jax.random.normal(jax.random.key(0), (80, 32))  # 80 tokens: 16 x 5.
    signs = jnp.where(jax.random.bernoulli(jax.random.key(1), 0.5, (16,)),
                      1.0, -1.0)

    def rounded(g, bits):
      key = jax.random.wrap_key_data(bits)
      return [fp4_blocks.nvfp4(g, 1, key=key), fp4_blocks.mxfp4(g, 1, key=key),
              fp4_blocks.nvfp4(fp4_blocks.hadamard_transform(g, signs, 0), 0, key=key)]

    for seed in range(3):
      bits = jax.random.key_data(jax.random.key(seed))
      want = jax.jit(rounded)(g, bits)
      for spec in (P('batch'), P('batch', 'model'), P(None, 'model')):
        sharded = jax.device_put(g, jax.sharding.NamedSharding(mesh, spec))
        chex.assert_trees_all_equal(jax.jit(rounded)(sharded, bits), want)

  def test_settings_that_cannot_work_name_themselves(self):
    for fp8, message in (
        (dict(format='fp5'), "precision.low_bit.format: unknown value 'fp5'"),
        (dict(scaling='delayed'), 'precision.low_bit.scaling=delayed with '
         'precision.low_bit.format=nvfp4'),
        (dict(format='mxfp4'), 'vit/encoder_block_0/attention/query: input '
         'features: 16, not a multiple of 32'),
        (dict(keep_fp8='*/head'), "precision.low_bit.keep_fp8: target '\\*/head' "
         'selects no Linear that precision.low_bit.modules runs in 4 bits'),
        (dict(format='fp8', keep_fp8='*/fc1'), 'precision.low_bit.keep_fp8: keeps '
         'fp8 among 4-bit Linears')):
      with self.assertRaisesRegex(haiku_mp_errors.ConfigError, message):
        experiment.build_without_data(settings_lib.parse(_config(**fp8)))


if __name__ == '__main__':
  absltest.main()
