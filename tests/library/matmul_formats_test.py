"""The advisor's low-bit pipeline is driven by its format entry: a format
written here, in the test, is measured and judged by the same
`measure_matmuls` and `judge_matmuls` that fp8 and 4 bits go through."""

import dataclasses
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
from haiku_mp.advisor import numerics

F32 = 'params=float32,compute=float32,output=float32'
_HALVES = {'bfloat16': numerics.BFLOAT16, 'float16': numerics.FLOAT16}
# Per tensor: its largest magnitude, the batch's index (the probe's extra
# input), its squared norm, and its squared rounding error per half format.
_FIELDS = ('amax', 'batch', 'sum_squares', 'bfloat16', 'float16')


def _stats(x, batch):
  x = x.astype(jnp.float32)
  errors = [jnp.sum((numerics.round_to(x, f) - x)**2) for f in
            _HALVES.values()]
  return jnp.stack([jnp.max(jnp.abs(x)), batch, jnp.sum(x * x), *errors])


@dataclasses.dataclass(frozen=True)
class HalfMatmuls(advisor.MatmulFormat):
  """A format family of two choices, bfloat16 and float16 weights, that
  fails a Linear whose weight loses more than `limit` of its norm (its
  input and output gradient are measured, not judged: a planted weight
  moves its neighbours' activations too)."""
  limit: float = 0.01

  name = 'half'
  title = 'half operands'
  choices = tuple(_HALVES)
  part_sizes = (len(_FIELDS),) * 3
  max_at = (0,)
  columns = ('weight error',)

  def extra(self, path, history):
    del path
    return np.float32(len(history))  # This batch's index.

  def activations(self, x, g, extra):
    return jnp.concatenate([_stats(x, extra), _stats(g, extra)])

  def weight(self, w, extra):
    return _stats(w, extra)

  def describe(self, stats, operand):
    del operand
    named = dict(zip(_FIELDS, stats))
    norm = np.sqrt(named['sum_squares'])
    return dict(amax=named['amax'], batches=named['batch'],
                **{c: float(np.sqrt(named[c]) / norm) for c in self.choices})

  def check(self, operands, choice, limits):
    del limits
    loss = operands['weight'][choice]
    return [f'weight loses {loss:.3g} of its norm'] if loss > self.limit else []

  def cells(self, row, choice):
    return [f'{row["weight"][choice]:.3g}']


class FallingBackMatmuls(HalfMatmuls):
  """`HalfMatmuls` whose failing layers keep the wider format's bfloat16
  where it passed, as 4 bits keep fp8's current scaling."""
  fallback_choice = 'bfloat16'


class MatmulFormatsTest(absltest.TestCase):

  def test_a_format_of_the_tests_own_goes_through_the_one_pipeline(self):
    precision = haiku_mp.make_precision(F32, model_class=hk.nets.MLP)

    def forward(images, is_training):
      del is_training
      with haiku_mp.apply_precision(precision):
        return hk.nets.MLP([16, 16, 10])(images)

    model = hk.transform(forward)
    rng = np.random.default_rng(0)
    batches = [dict(image=rng.normal(size=(8, 16)).astype(np.float32),
                    label=rng.integers(0, 10, 8).astype(np.int32))
               for _ in range(3)]
    params = model.init(jax.random.key(0), batches[0]['image'], True)
    # linear_1's weight below float16's smallest subnormal: it flushes to
    # zero there, and bfloat16 holds it.
    planted = 'mlp/~/linear_1'
    params[planted]['w'] = params[planted]['w'] * 1e-9
    loss_fn = haiku_mp.make_classification_loss(model)
    classes = advisor.module_classes_of(loss_fn, params, jax.random.key(1),
                                        batches[0])
    paths = advisor.low_bit_linears(classes, 'Linear')
    fmt = HalfMatmuls()
    totals = advisor.measure_matmuls(loss_fn, params, batches, paths, fmt)

    # Summed over the batches, but for the largest magnitude (`max_at`);
    # the extra input followed each layer's own history (0 + 1 + 2).
    weight = fmt.describe(totals[planted][2], 'weight')
    self.assertEqual(weight['batches'], 3)
    self.assertAlmostEqual(
        weight['amax'],
        float(np.max(np.abs(np.asarray(params[planted]['w'])))), places=12)

    judged = advisor.judge_matmuls(totals, fmt, 'float16', None, 'Linear')
    verdicts = {r['path']: r['verdicts'] for r in judged['modules']}
    self.assertEqual(verdicts, {
        p: {'bfloat16': 'half-ok',
            'float16': 'keep-bf16' if p == planted else 'half-ok'}
        for p in paths})
    self.assertEqual(judged['keep_bf16'], [planted])
    self.assertEqual(judged['low_bit_modules'].split(';'),
                     [p for p in paths if p != planted])
    reasons = {r['path']: r['reasons'] for r in judged['modules']}
    self.assertEqual(reasons[planted]['float16'],
                     ['weight loses 1 of its norm'])

    # Judged again with that verdict as the wider format to fall back on:
    # the layer that fails keeps it where the wider one passed.
    fallback = advisor.judge_matmuls(totals, fmt, 'bfloat16', None, 'Linear')
    judged = advisor.judge_matmuls(totals, FallingBackMatmuls(), 'float16',
                                   None, 'Linear', fallback=fallback)
    self.assertEqual(
        {r['path']: r['verdicts']['float16'] for r in judged['modules']},
        {p: 'keep-half' if p == planted else 'half-ok' for p in paths})
    self.assertEqual(judged['keep_fp8'], [planted])
    self.assertEqual(judged['keep_bf16'], [])
    self.assertEqual(judged['keep_fp8_setting'], planted)


if __name__ == '__main__':
  absltest.main()
