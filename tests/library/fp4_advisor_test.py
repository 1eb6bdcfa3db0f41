"""The advisor's 4-bit verdicts: block statistics as NVFP4 and MXFP4 hold a
tensor, and a planted outlier channel that only one Linear's blocks cannot
hold, named with the override that keeps it in fp8."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import haiku_mp
from haiku_mp import advisor
from haiku_mp.advisor import fp4_numerics
from haiku_mp.model import fp4
from haiku_mp.model import fp4_blocks
from tests import helpers

BF16 = 'params=float32,compute=bfloat16,output=float32'
_SIGNS = jnp.ones([fp4_blocks.NVFP4_BLOCK], jnp.float32)
# Compiled whole: run op by op, its many small operations are a program
# each, five times the CPU time.
_tensor_stats = jax.jit(fp4_numerics.tensor_stats, static_argnums=1)


@helpers.long_running
class Fp4NumericsTest(absltest.TestCase):

  def test_an_outlier_flushes_its_block_and_only_it(self):
    # 4 rows of 64 features: in row 0, feature 3 is 1000 and the other 63
    # are 1; 1 / 1000 is under E2M1's smallest step at the block's scale
    # (1000 / 6 x 0.5), so the outlier's block rounds its 15 (NVFP4) or 31
    # (MXFP4) neighbours to zero, and no other block loses a value.
    x = np.ones((4, 64), np.float32)
    x[0, 3] = 1000.0
    stats = fp4_numerics.as_dict(np.asarray(_tensor_stats(
        jnp.asarray(x), 'input', _SIGNS)), 'input')
    self.assertEqual(stats['nonzero'], 256)
    nv, mx = stats['nvfp4']['forward'], stats['mxfp4']['forward']
    self.assertEqual(nv['flushed_share'], 1 / 16)  # 1 of 4 x 4 blocks.
    self.assertEqual(nv['underflow_share'], 15 / 256)
    self.assertEqual(mx['flushed_share'], 1 / 8)  # 1 of 4 x 2 blocks.
    self.assertEqual(mx['underflow_share'], 31 / 256)
    # Blocked along the 4 tokens (the weight gradient's), the outlier
    # shares a block with three 1s only.
    self.assertEqual(stats['nvfp4']['wgrad']['underflow_share'], 3 / 256)

  def test_the_hadamard_transform_spreads_an_outlier_token(self):
    # 16 tokens of one feature, one of them 1000: along the tokens its block
    # flushes the other 15; rotated, every value of the block is +-1000/4
    # plus a little, and none is lost.
    x = np.ones((16, 1), np.float32)
    x[5, 0] = 1000.0
    signs = fp4.initial_signs('layer')((fp4_blocks.NVFP4_BLOCK,), jnp.float32)
    stats = fp4_numerics.as_dict(np.asarray(_tensor_stats(
        jnp.asarray(x), 'gradient', signs)), 'gradient')['nvfp4']
    self.assertEqual(stats['wgrad']['flushed_share'], 1.0)
    self.assertEqual(stats['wgrad_hadamard']['flushed_share'], 0.0)
    self.assertEqual(stats['wgrad_hadamard']['underflow_share'], 0.0)

  def test_gaussian_values_fit_the_default_limits(self):
    x = jax.random.normal(jax.random.key(0), (256, 64))
    operands = {t: fp4_numerics.as_dict(np.asarray(_tensor_stats(
        x, t, _SIGNS)), t) for t in ('input', 'gradient', 'weight')}
    for fmt in fp4.FORMATS:
      reasons = advisor.Fp4Matmuls(hadamard=True).check(
          operands, fmt, advisor.Fp4Thresholds(0.2, 0.05))
      self.assertEmpty(reasons)


def _mlp(modules='', fp4_config=None, keep_fp8=''):
  precision = haiku_mp.make_precision(
      BF16, model_class=hk.nets.MLP, low_bit=haiku_mp.LowBit(
          modules, fp4_config or haiku_mp.Fp8(), keep_fp8))

  def forward(images, is_training):
    del is_training
    with haiku_mp.apply_precision(precision):
      return hk.nets.MLP([64, 64, 10])(images)

  return hk.transform(forward), precision


@helpers.long_running
class Fp4AdviceTest(absltest.TestCase):

  def test_a_channel_4_bit_blocks_cannot_hold_is_named_and_kept_in_fp8(self):
    """linear_0's output feature 5, 100 times the others, is linear_1's
    input feature 5: every 4-bit block of linear_1's input that holds it
    flushes its neighbours (E2M1 keeps nothing under 1/24 of a block's
    largest), while fp8's per-tensor E4M3 holds the 100-fold range. The
    advice keeps linear_1 in fp8 and linear_0 in 4 bits; unplanted, both
    take 4 bits. (The head, as in the NVFP4 recipe, is no candidate: its
    logits' gradient is one large value per row among small ones.)"""
    forward, _ = _mlp()
    rng = np.random.default_rng(0)
    batches = [dict(image=rng.normal(size=(64, 64)).astype(np.float32),
                    label=rng.integers(0, 10, 64).astype(np.int32))
               for _ in range(2)]
    params = forward.init(jax.random.key(0), batches[0]['image'], True)
    loss_fn = haiku_mp.make_classification_loss(forward)
    targets = '*/linear_0;*/linear_1'
    classes = advisor.module_classes_of(loss_fn, params, jax.random.key(1),
                                        batches[0])
    paths = advisor.low_bit_linears(classes, targets)
    self.assertEqual(paths, ['mlp/~/linear_0', 'mlp/~/linear_1'])

    def advise(params):
      fp8, fp4 = advisor.Fp8Matmuls(), advisor.Fp4Matmuls()
      fp8_judged = advisor.judge_matmuls(
          advisor.measure_matmuls(loss_fn, params, batches, paths, fp8), fp8,
          'mx', advisor.Fp8Thresholds(0.1, 0.01, 0.0), targets)
      totals = advisor.measure_matmuls(loss_fn, params, batches, paths, fp4)
      return advisor.judge_matmuls(totals, fp4, 'nvfp4',
                                   advisor.Fp4Thresholds(0.2, 0.05), targets,
                                   fallback=fp8_judged)

    judged = advise(params)
    self.assertEqual({r['path']: r['verdicts'] for r in judged['modules']},
                     {p: {'nvfp4': 'fp4-ok', 'mxfp4': 'fp4-ok'}
                      for p in paths})
    self.assertEqual(judged['keep_fp8_setting'], '')

    planted = 'mlp/~/linear_0'
    params[planted]['w'] = params[planted]['w'].at[:, 5].multiply(100.0)
    params[planted]['b'] = params[planted]['b'].at[5].set(20.0)
    judged = advise(params)
    self.assertEqual({r['path']: r['verdicts'] for r in judged['modules']}, {
        'mlp/~/linear_0': {'nvfp4': 'fp4-ok', 'mxfp4': 'fp4-ok'},
        'mlp/~/linear_1': {'nvfp4': 'keep-fp8', 'mxfp4': 'keep-fp8'}})
    reasons = {r['path']: r['reasons'] for r in judged['modules']}
    self.assertRegex(reasons['mlp/~/linear_1']['nvfp4'][0],
                     r"^[\d.]+% of the input \(forward\)'s nvfp4 blocks are "
                     r'flushed by an outlier \(> 5%\)$')
    self.assertEqual((judged['low_bit_modules'], judged['keep_fp8_setting']),
                     (targets, 'mlp/~/linear_1'))
    # The advice pasted in: linear_1 runs fp8, linear_0 4 bits.
    _, precision = _mlp(judged['low_bit_modules'], haiku_mp.Fp4('nvfp4'),
                        judged['keep_fp8_setting'])
    self.assertEqual({p: precision.runs_fp4('Linear', p) for p in paths},
                     {'mlp/~/linear_0': True, 'mlp/~/linear_1': False})
    self.assertTrue(precision.runs_low_bit('Linear', 'mlp/~/linear_1'))


if __name__ == '__main__':
  absltest.main()
