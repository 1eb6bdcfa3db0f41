"""The loss a train step takes: `loss_fn(params, rng, batch)`, or a
`LossWithState` for a model with Haiku state, and either as the one form
the step calls, its result checked."""

import dataclasses
from typing import Any, Callable, Mapping, Union

import haiku as hk
import jax

Batch = Mapping[str, jax.Array]
Metrics = dict[str, jax.Array]
# loss_fn(params, rng, batch) -> (float32 scalar loss, metrics such as accuracy).
LossFn = Callable[[hk.Params, jax.Array, Batch], tuple[jax.Array, Metrics]]


@dataclasses.dataclass(frozen=True)
class LossWithState:
  """The loss of a model with Haiku state (`hk.transform_with_state`:
  BatchNorm's moving statistics): `fn(params, model_state, rng, batch) ->
  (loss, metrics, new_model_state)`. `make_train_step` keeps the state in
  `TrainState.model_state`, and a skipped step leaves it as it was.

  Example:
    loss_fn = haiku_mp.make_classification_loss(hk.transform_with_state(f))
    # or, written by hand:
    loss_fn = haiku_mp.LossWithState(my_loss)
  """
  fn: Callable[[hk.Params, hk.State, jax.Array, Batch],
               tuple[jax.Array, Metrics, hk.State]]

  def __call__(self, params, model_state, rng, batch):
    return self.fn(params, model_state, rng, batch)


AnyLoss = Union[LossFn, LossWithState]


def _returned(result: Any, stateful: bool) -> tuple:
  """A loss's result as the step takes it, or one line naming what it
  should return: `(loss, metrics)`, with the new Haiku state third for a
  `LossWithState`."""
  expected = ('(loss, metrics, new_model_state)' if stateful else
              '(loss, metrics)')
  size = 3 if stateful else 2
  if not isinstance(result, tuple) or len(result) != size:
    if isinstance(result, tuple):
      got = f'a tuple of {len(result)}'
    elif hasattr(result, 'shape'):
      got = f'an array of shape {tuple(result.shape)}'
    else:
      got = f'a {type(result).__name__}'
    raise TypeError(
        f'train_step: loss_fn returned {got}, not {expected}; return '
        f'{"(loss, {}, new_model_state)" if stateful else "(loss, {})"} '
        'for a loss without metrics')
  return result


def with_state(loss_fn: AnyLoss) -> LossWithState:
  """`loss_fn` as a loss with state: a stateless one passes the state on;
  either's result checked (`_returned`)."""
  if isinstance(loss_fn, LossWithState):
    return LossWithState(lambda *args: _returned(loss_fn(*args), True))

  def fn(params, model_state, rng, batch):
    return (*_returned(loss_fn(params, rng, batch), False), model_state)

  return LossWithState(fn)
