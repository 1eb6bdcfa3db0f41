"""A classifier's loss and evaluation: float32 cross-entropy and accuracy of
any transformed Haiku `forward(images, is_training)`, read from a batch by
the keys it names."""

import inspect
from typing import Any, Callable, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from haiku_mp.update import losses
from haiku_mp.update import train_state

# eval_inputs(batch) -> the batch the model takes (normalized on the device,
# as a train step's inputs are, no randomness).
EvalInputs = Callable[[losses.Batch], losses.Batch]


def _losses(logits: jax.Array, batch: losses.Batch,
            label_smoothing: float) -> jax.Array:
  """Per-example float32 cross-entropy against the integer labels, or, with
  soft labels (`batch['targets']`, from mixing) or label smoothing, against
  those targets smoothed."""
  labels = batch['label']
  if 'targets' not in batch and not label_smoothing:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  targets = batch.get('targets')
  if targets is None:
    targets = jax.nn.one_hot(labels, logits.shape[-1], dtype=jnp.float32)
  targets = optax.smooth_labels(targets.astype(jnp.float32), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets)


def _weighted_metrics(logits: jax.Array, batch: losses.Batch,
                      axis_name: Optional[str] = None,
                      label_smoothing: float = 0.0) -> dict[str, Any]:
  """float32 cross-entropy and accuracy, masked by `batch['mask']` if present.

  With `axis_name`, the means are over the examples of every replica.
  Accuracy is against each example's own label, mixed or not.
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  labels = batch['label']
  mask = batch.get('mask')
  if mask is None:
    mask = jnp.ones(labels.shape, jnp.float32)
  mask = mask.astype(jnp.float32)
  per_example = _losses(logits, batch, label_smoothing)
  correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  sums = dict(loss=(per_example * mask).sum(), correct=(correct * mask).sum(),
              num_examples=mask.sum())
  if axis_name is not None:
    sums = jax.lax.psum(sums, axis_name)
  count = jnp.maximum(sums['num_examples'], 1.0)
  return dict(loss=sums['loss'] / count, accuracy=sums['correct'] / count,
              num_examples=sums['num_examples'])


def _takes_rng(forward: Any) -> bool:
  """Whether `forward.apply` takes a key (`hk.transform`), or not
  (`hk.without_apply_rng`), checked as Haiku writes its signatures; raises
  one line when `forward` is not a transformed Haiku function."""
  if not isinstance(forward, (hk.Transformed, hk.TransformedWithState)):
    raise TypeError(
        f'forward is a {type(forward).__name__}, not a transformed Haiku '
        'function; pass hk.transform(f) or hk.transform_with_state(f)')
  names = list(inspect.signature(forward.apply).parameters)
  first = 2 if isinstance(forward, hk.TransformedWithState) else 1
  return names[first:first + 1] == ['rng']


def _applied(forward: Any) -> Callable[..., Any]:
  """`forward.apply` as `(params, [model_state,] rng, images, is_training)`,
  whether or not it takes a key (`hk.without_apply_rng`)."""
  if _takes_rng(forward):
    return forward.apply
  if isinstance(forward, hk.TransformedWithState):
    return lambda params, state, rng, *args: forward.apply(params, state,
                                                           *args)
  return lambda params, rng, *args: forward.apply(params, *args)


class BatchKeyError(KeyError):
  """A key the loss reads that the batch lacks; its message is one line."""

  def __str__(self) -> str:
    return str(self.args[0])


def _keyed(batch: losses.Batch, image_key: str,
           label_key: str) -> losses.Batch:
  """`batch` with its images and labels under the names the loss reads, or
  one line naming the keys it has and the arguments that name them."""
  missing = [k for k in (image_key, label_key) if k not in batch]
  if missing:
    raise BatchKeyError(
        f'make_classification_loss: the batch has keys {sorted(batch)}, no '
        f'{missing[0]!r}; it reads the images at image_key={image_key!r} and '
        f'the labels at label_key={label_key!r}: name yours, '
        "make_classification_loss(forward, image_key=..., label_key=...)")
  renamed = {k: v for k, v in batch.items() if k not in (image_key, label_key)}
  return dict(renamed, image=batch[image_key], label=batch[label_key])


def make_classification_loss(forward: Union[hk.Transformed,
                                            hk.TransformedWithState],
                             label_smoothing: float = 0.0, *,
                             image_key: str = 'image',
                             label_key: str = 'label') -> losses.AnyLoss:
  """The training loss of a classifier `forward(images, is_training)`:
  cross-entropy in float32, its targets smoothed by `label_smoothing`,
  the images and integer labels read from the batch at `image_key` and
  `label_key` (mixing's soft `targets` and a `mask`, where present, by
  those names). `forward` is `hk.transform`'s (with or without
  `hk.without_apply_rng`) or `hk.transform_with_state`'s; then the loss is
  a `LossWithState`, which the train step gives the state in
  `TrainState.model_state`.

  Example:
    loss_fn = haiku_mp.make_classification_loss(hk.transform(forward), 0.1)
    loss, metrics = loss_fn(params, rng, dict(image=images, label=labels))
  """
  apply = _applied(forward)

  def metrics_of(logits, batch):
    metrics = _weighted_metrics(logits, batch,
                                label_smoothing=label_smoothing)
    return metrics.pop('loss'), metrics

  if isinstance(forward, hk.TransformedWithState):

    def loss_with_state(params, model_state, rng, batch):
      batch = _keyed(batch, image_key, label_key)
      logits, model_state = apply(params, model_state, rng, batch['image'],
                                  True)
      return (*metrics_of(logits, batch), model_state)

    return losses.LossWithState(loss_with_state)

  def loss_fn(params, rng, batch):
    batch = _keyed(batch, image_key, label_key)
    return metrics_of(apply(params, rng, batch['image'], True), batch)

  return loss_fn


def make_eval_step(forward: Union[hk.Transformed, hk.TransformedWithState],
                   axis_name: Optional[str] = None,
                   inputs: EvalInputs = lambda batch: batch
                   ) -> Callable[..., losses.Metrics]:
  """`eval_step(params, batch) -> {logits, loss, accuracy, num_examples}`, no
  dropout; for a model with Haiku state `eval_step(params, batch,
  model_state)`, which reads the state (BatchNorm's moving statistics) and
  leaves it as it is.

  Under `jax.pmap` pass its `axis_name`: the metrics then cover every replica.

  Example:
    eval_step = jax.jit(haiku_mp.make_eval_step(hk.transform(forward)))
    accuracy = eval_step(state.params, batch)['accuracy']
    # With state: eval_step(state.params, batch, state.model_state)
  """
  apply = _applied(forward)
  stateful = isinstance(forward, hk.TransformedWithState)

  def eval_step(params: hk.Params, batch: losses.Batch,
                model_state: Optional[hk.State] = None) -> losses.Metrics:
    if isinstance(params, train_state.TrainState):
      raise TypeError('eval_step: takes the params (state.params), not the '
                      'TrainState')
    if stateful and model_state is None:
      raise TypeError('eval_step: the model has Haiku state; pass it: '
                      'eval_step(params, batch, state.model_state)')
    if not stateful and model_state:
      raise TypeError('eval_step: the model takes no Haiku state (made with '
                      'hk.transform), but model_state was given')
    batch = inputs(batch)
    if stateful:
      logits, _ = apply(params, model_state, None, batch['image'], False)
    else:
      logits = apply(params, None, batch['image'], False)
    return dict(_weighted_metrics(logits, batch, axis_name), logits=logits)

  return eval_step
