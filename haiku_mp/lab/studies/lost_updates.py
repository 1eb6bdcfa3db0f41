"""Study `rounding`: which params' updates bfloat16 rounds away.

At a run's checkpoint (or after `advisor.init_steps` steps from init), the
optimizer's float32 update of each
param is computed on the run's own next batches, as its train step would
(the state is not moved), and rounded into bfloat16 params to nearest and
stochastically. Per param it reports the share of the update (by magnitude)
that does not reach the params, 1 - sum(applied x sign(update)) /
sum(|update|), the train step's `updates_lost`, and how large the update is
against the param's bfloat16 spacing: updates below half an ulp are what
rounding to nearest drops every step (and a Kahan buffer carries on).
"""

import collections
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from haiku_mp import errors
from haiku_mp.lab import charts
from haiku_mp.lab import run_inputs
from haiku_mp.lab import run_plots
from haiku_mp.update import gradients as gradients_lib
from haiku_mp.update import rounding as rounding_lib
from haiku_mp.update import train_state
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.parallel import sharding
from haiku_mp.vit.train import experiment

# Params grouped the way a table reads them: (group, regex over the name).
GROUPS = (
    ('attention weights', r'.*/attention/\w+/w$'),
    ('MLP weights', r'.*/mlp_block/fc\d/w$'),
    ('biases', r'.*/b$'),
    ('LayerNorm', r'.*/(ln_\w+)/(scale|offset)$'),
    ('patch embedding', r'.*/patch_embed/.*/w$'),
    ('head', r'.*/head/w$'),
    ('cls token, positions', r'.*/(cls_token|pos_embedding)$'),
)
OTHER = 'other'


def group_of(name: str) -> str:
  for group, pattern in GROUPS:
    if re.fullmatch(pattern, name):
      return group
  return OTHER


def _applied(key, before, updates):
  """{way: per-leaf change} of `before` (bfloat16 values, as float32) when
  `updates` are rounded into them each way."""
  results = [b + u for b, u in zip(before, jax.tree.leaves(updates))]
  keys = jax.random.split(key, len(before))
  nearest = [r.astype(jnp.bfloat16).astype(jnp.float32) for r in results]
  stochastic = [rounding_lib.stochastic_round(k, r, jnp.bfloat16).astype(
      jnp.float32) for k, r in zip(keys, results)]
  return {name: [a - b for a, b in zip(after, before)] for name, after in
          (('nearest', nearest), ('stochastic', stochastic))}


def _sums(key, params, updates):
  """Per leaf: sum |u|, sum applied x sign(u) each way, and the updates
  below half the param's bfloat16 spacing. Every param is taken as the
  bfloat16 it would be stored as (float32 ones too: what bfloat16 storage
  would do to them)."""
  before = [p.astype(jnp.bfloat16) for p in jax.tree.leaves(params)]
  applied = _applied(key, [b.astype(jnp.float32) for b in before], updates)
  rows = []
  for i, (b, u) in enumerate(zip(before, jax.tree.leaves(updates))):
    spacing = jnp.abs(jnp.nextafter(b, jnp.bfloat16(jnp.inf)).astype(
        jnp.float32) - b.astype(jnp.float32))
    rows.append(dict(
        update=jnp.sum(jnp.abs(u)),
        below_half_ulp=jnp.sum((jnp.abs(u) < spacing / 2) & (u != 0)),
        **{f'applied_{way}': jnp.sum(changes[i] * jnp.sign(u))
           for way, changes in applied.items()}))
  return rows


def run(settings: settings_lib.Settings, checkpoint: str = '',
        checkpoint_step: int = -1, num_batches: int = 4,
        log: Callable[[str], None] = print) -> dict[str, Any]:
  """Per param and per group: the share of the update each rounding loses,
  over `num_batches` of the run's next batches (the state is not moved)."""
  if num_batches < 1:
    raise errors.ConfigError(f'--batches={num_batches} must be at least 1')
  exp = experiment.build(settings)
  state, step, source = run_inputs.initial_state(exp, checkpoint,
                                                 checkpoint_step)
  # From init, the run's own steps first (`advisor.init_steps`): a ViT's
  # zero head gives the rest no gradient at step 0.
  init_steps = 0 if checkpoint else exp.settings.advisor.init_steps
  batches = run_inputs.training_batches(settings, init_steps + num_batches,
                                        step)
  for batch in batches[:init_steps]:
    state, _ = exp.strategy.train_step(state, exp.strategy.place_batch(batch))
  if init_steps:
    source += f' + {init_steps} steps'
  inputs = run_inputs.model_inputs(exp, batches[init_steps:], settings.seed)
  _, trained = train_state.split_fp8(state.params)

  @jax.jit
  def sums(state, batch, key):
    grads, _, _ = gradients_lib.gradients(exp.loss_fn, exp.scaler,
                                          state.loss_scale, state.params, key,
                                          batch)
    _, grads = train_state.split_fp8(grads)
    _, trained = train_state.split_fp8(state.params)
    updates, new_opt_state = exp.optimizer.update(grads, state.opt_state,
                                                  trained, key=key)
    master = getattr(new_opt_state, 'master', None)
    if master is not None:  # The master's float32 update.
      updates = jax.tree.map(lambda m, old: m - old, master,
                             state.opt_state.master)
    return _sums(key, trained, updates)

  totals = None
  for i, batch in enumerate(inputs):
    rows = jax.device_get(sums(state, batch, jax.random.fold_in(
        jax.random.key(settings.seed), 1000 + i)))
    totals = rows if totals is None else [
        {k: a[k] + b[k] for k in a} for a, b in zip(totals, rows)]
  names = [sharding.param_name(path) for path, _ in
           jax.tree_util.tree_flatten_with_path(trained)[0]]
  counts = [int(np.prod(p.shape)) for p in jax.tree.leaves(trained)]
  params = [_row(name, count * num_batches, t, group_of(name))
            for name, count, t in zip(names, counts, totals)]
  by_group = collections.defaultdict(lambda: collections.Counter())
  for name, count, t in zip(names, counts, totals):
    by_group[group_of(name)].update(dict(t, elements=count * num_batches))
  groups = [_row(g, int(c['elements']), c, g) for g, c in by_group.items()]
  everything = collections.Counter()
  for c in by_group.values():
    everything.update(c)
  at_step = step + init_steps
  result = dict(
      experiment='rounding', params_from=source, step=at_step,
      batches=num_batches, learning_rate=float(exp.schedule(at_step)),
      layout=dict(policy=settings.precision.policy,
                  param_update=settings.precision.param_update,
                  mu_dtype=settings.precision.mu_dtype,
                  nu_dtype=settings.precision.nu_dtype),
      total=_row('all params', int(everything['elements']), everything,
                 'all'),
      groups=groups, params=params)
  for row in [result['total']] + groups:
    log(line(row))
  return result


def _row(name: str, elements: int, t, group: str) -> dict[str, Any]:
  update = float(t['update'])
  lost = lambda way: (1 - float(t[f'applied_{way}']) / update
                      if update else 0.0)
  return dict(name=name, group=group, elements=elements,
              lost_nearest=lost('nearest'),
              lost_stochastic=lost('stochastic'),
              below_half_ulp=float(t['below_half_ulp']) / max(elements, 1))


def line(row: dict[str, Any]) -> str:
  return (f'rounding {row["name"]}: to nearest loses '
          f'{100 * row["lost_nearest"]:.1f}% of the update, stochastically '
          f'{100 * row["lost_stochastic"]:.1f}%; '
          f'{100 * row["below_half_ulp"]:.1f}% of updates below half an ulp')


def table(result: dict[str, Any]) -> str:
  """The groups and the total as a Markdown table."""
  head = ('| params | elements | lost to nearest | lost stochastically | '
          'updates below half an ulp |\n|---|---|---|---|---|')
  body = [f'| {r["name"]} | {r["elements"]:,} | {100 * r["lost_nearest"]:.1f}% '
          f'| {100 * r["lost_stochastic"]:.1f}% | '
          f'{100 * r["below_half_ulp"]:.1f}% |'
          for r in result['groups'] + [result['total']]]
  return '\n'.join([head] + body)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """A bar per group: the share of its update each rounding loses."""
  rows = result['groups'] + [result['total']]
  path = os.path.join(out_dir, 'rounding.png')
  charts.grouped_bar_chart(
      path, [r['name'] for r in rows],
      {'to nearest': [100 * r['lost_nearest'] for r in rows],
       'stochastic': [100 * r['lost_stochastic'] for r in rows]},
      run_plots.axis_label('update_lost', '%'),
      f'update lost to bfloat16 rounding at step {result["step"]} '
      f'(learning rate {result["learning_rate"]:.2g})',
      run_plots.axis_label('params'))
  return [path]
