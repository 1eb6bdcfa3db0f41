"""Whether a model's Haiku state is finite, leaf by leaf: the train step
skips a step whose new state is not (as one whose gradients are not), and
`LossScaler.check_metrics` names the module it came from."""

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp


def _floating(model_state: hk.State) -> list[tuple[Any, jax.Array]]:
  return [(path, x) for path, x in
          jax.tree_util.tree_flatten_with_path(model_state)[0]
          if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def leaves(model_state: hk.State) -> list[str]:
  """The path of each floating leaf of a Haiku state (`module/name` for
  Haiku's own), in the order of `flags`."""
  return ['/'.join(str(getattr(k, 'key', k)) for k in path)
          for path, _ in _floating(model_state)]


def flags(model_state: hk.State) -> jax.Array:
  """Per floating leaf of `model_state` (`leaves`' order), whether it holds
  inf or NaN: its sum is not finite (no false alarm from large finite
  values, as a sum of squares would give)."""
  found = [~jnp.isfinite(jnp.sum(x.astype(jnp.float32)))
           for _, x in _floating(model_state)]
  return jnp.stack(found) if found else jnp.zeros([0], bool)


def modules_of(model_state: hk.State, nonfinite: Any) -> list[str]:
  """The modules (a leaf's path but its last part) whose leaves `nonfinite`
  (`flags`' values, read on the host) marks, outermost first: a module's
  state is often made by the module around it (a VQ-VAE's codebook
  averages, by its quantizer), which an override of the outer one
  covers."""
  bad = [n for n, flag in zip(leaves(model_state), nonfinite) if flag]
  modules = list(dict.fromkeys(n.rsplit('/', 1)[0] for n in bad))
  return sorted(modules, key=lambda m: m.count('/'))


def applied(metrics: Any) -> bool:
  """Whether a train step's update was applied, from its metrics read on
  the host: its `applied`, or for a step logged before that metric existed
  (a checkpoint's window of steps), its `grads_finite`."""
  return bool(metrics.get('applied', metrics['grads_finite']))
