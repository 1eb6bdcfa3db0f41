"""The advisor's float16 forward pass: a module that makes inf or NaN in
float16 from finite inputs (a mask value that is -inf there) is kept in
float32, though its float32 statistics are fine."""

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
from haiku_mp.advisor import verdicts

F32 = 'params=float32,compute=float32,output=float32'
F16 = 'params=float32,compute=float16,output=float32'
LIMITS = advisor.Thresholds(max_relative_error=0.01, max_overflow_share=0.0,
                            loss_scale_headroom=1.0)


class MaskedMix(hk.Module):
  """A user's own attention-like mixing, masked as Haiku masks (-1e30) in
  its compute dtype: -inf in float16, so a row with every key masked (a
  padding query) is NaN."""

  def __call__(self, x, mask):
    logits = jnp.einsum('btd,bsd->bts', x, x)
    logits = jnp.where(mask, logits, -1e30)
    return jnp.einsum('bts,bsd->btd', jax.nn.softmax(logits), x)


class Net(hk.Module):

  def __call__(self, x, mask):
    h = MaskedMix()(hk.Linear(8)(x), mask)
    return hk.Linear(3)(h.mean(axis=1))


def _loss(policy):
  precision = haiku_mp.make_precision(policy, model_class=Net)

  def forward(x, mask):
    with haiku_mp.apply_precision(precision):
      return Net()(x, mask)

  forward = hk.transform(forward)

  def loss_fn(params, rng, batch):
    logits = forward.apply(params, rng, batch['x'], batch['mask'])
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), -1)), {}

  return forward, loss_fn


def _batch():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 5, 6)).astype(np.float32)
  keys = np.arange(5)[None, :] < np.array([5, 3, 5, 2])[:, None]
  # Padding queries attend to nothing.
  return dict(x=x, mask=keys[:, None, :] & keys[:, :, None])


class Float16PassTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    forward, loss32 = _loss(F32)
    # Static: a function set on the class would be bound as a method.
    cls.loss32, cls.loss16 = staticmethod(loss32), staticmethod(_loss(F16)[1])
    cls.batch = _batch()
    cls.params = forward.init(jax.random.key(0), cls.batch['x'],
                              cls.batch['mask'])

  def _advice(self, **kwargs):
    modules = advisor.measure_model(self.loss32, self.params, [self.batch],
                                    jax.random.key(1), **kwargs)
    return modules, advisor.judge(modules, LIMITS)

  def test_the_model_is_nan_in_float16_and_finite_in_float32(self):
    self.assertTrue(np.isnan(float(self.loss16(self.params, None,
                                               self.batch)[0])))
    self.assertTrue(np.isfinite(float(self.loss32(self.params, None,
                                                  self.batch)[0])))

  def test_float32_statistics_alone_approve_float16(self):
    _, advice = self._advice()
    self.assertNotIn('keep-f32', {v.float16 for v in advice.verdicts.values()})

  def test_the_float16_pass_keeps_the_mixing_alone_in_float32(self):
    modules, advice = self._advice(float16_loss_fn=self.loss16)
    kept = {p for p, v in advice.verdicts.items() if v.float16 == 'keep-f32'}
    # Not its container, nor the Linear that reads its NaN.
    self.assertEqual(kept, {'net/masked_mix'})
    self.assertIn('float16 forward pass',
                  advice.verdicts['net/masked_mix'].reasons['float16'])
    overrides = advisor.overrides(modules, advice, 'float16')
    self.assertEqual(overrides, 'net/masked_mix:' + verdicts.F32_POLICY)
    # The advice pasted back in: finite in float16.
    precision = haiku_mp.make_precision(F16, overrides, model_class=Net)

    def forward(x, mask):
      with haiku_mp.apply_precision(precision):
        return Net()(x, mask)

    logits = hk.transform(forward).apply(self.params, None, self.batch['x'],
                                         self.batch['mask'])
    self.assertTrue(bool(jnp.isfinite(logits).all()))


if __name__ == '__main__':
  absltest.main()
