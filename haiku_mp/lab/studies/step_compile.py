"""Study `step_compile`: how long `make_train_step` takes to compile, against
a plain step of the same model, for models nobody here wrote.

A user who trains their own Haiku model pays the library's step in compile
time on every new shape. The plain step is what they would write
themselves: the model's loss (float32 cross-entropy), its gradients and
`optax.adam`'s update, Haiku state threaded through. The library's is
`make_train_step` with the same loss and optimizer, with no loss scaling and
with dynamic loss scaling. Both models run under the same bfloat16 policy:

- `resnet18`: `hk.nets.ResNet18` (BatchNorm state) on 32x32 images;
- `lm`: a 4-block pre-LayerNorm transformer of Haiku's own modules
  (`hk.MultiHeadAttention`, `hk.nets.MLP`), 64 tokens.

Compile time is the CPU time of XLA's compile (`lower(...).compile()`),
with JAX's persistent cache off: CPU time, not wall time, so that another
process on the machine does not count. Each variant is compiled `repeats`
times (a fresh function each time) and the median kept; ratios are to the
plain step of the same model, in the same process.
"""

import statistics
import time
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import optax

from haiku_mp.lab import charts
from haiku_mp.lab import hardware
from haiku_mp.model import interception
from haiku_mp.model import policies
from haiku_mp.update import classification
from haiku_mp.update import loss_scaling
from haiku_mp.update import step as step_lib
from haiku_mp.update import train_state
from haiku_mp.vit.train import compilation

MODELS = ('resnet18', 'lm')
VARIANTS = ('plain', 'make_train_step', 'make_train_step_dynamic')
POLICY = 'params=float32,compute=bfloat16,output=float32'
BATCH_SIZE = 8
IMAGE_SIZE = 32
CLASSES = 10
# The LM's shape: vocabulary, tokens, width, heads, blocks.
VOCAB, TOKENS, WIDTH, HEADS, BLOCKS = 256, 64, 128, 4, 4
LEARNING_RATE = 1e-3


def _resnet(images, is_training):
  return hk.nets.ResNet18(CLASSES, resnet_v2=True)(images, is_training)


class _Lm(hk.Module):
  """Pre-LayerNorm blocks of Haiku's attention and MLP, causal."""

  def __call__(self, tokens, is_training):
    del is_training
    mask = jnp.tril(jnp.ones((1, 1, TOKENS, TOKENS)))
    h = hk.Embed(VOCAB, WIDTH)(tokens)
    for _ in range(BLOCKS):
      x = hk.LayerNorm(-1, True, True)(h)
      h = h + hk.MultiHeadAttention(
          HEADS, WIDTH // HEADS,
          w_init=hk.initializers.VarianceScaling(1.0))(x, x, x, mask)
      h = h + hk.nets.MLP([4 * WIDTH, WIDTH])(hk.LayerNorm(-1, True, True)(h))
    return hk.Linear(VOCAB)(hk.LayerNorm(-1, True, True)(h))


def _lm(tokens, is_training):
  return _Lm(name='lm')(tokens, is_training)


def _model(name: str) -> tuple[hk.TransformedWithState, dict[str, Any]]:
  """The model under the bfloat16 policy and a batch of zeros for it."""
  fn, model_class = {'resnet18': (_resnet, 'ResNet18'),
                     'lm': (_lm, '_Lm')}[name]
  precision = policies.make_precision(POLICY, model_class=model_class)

  def forward(inputs, is_training):
    with interception.apply(precision):
      return fn(inputs, is_training)

  if name == 'resnet18':
    batch = dict(image=jnp.zeros((BATCH_SIZE, IMAGE_SIZE, IMAGE_SIZE, 3)),
                 label=jnp.zeros((BATCH_SIZE,), jnp.int32))
  else:
    batch = dict(image=jnp.zeros((BATCH_SIZE, TOKENS), jnp.int32),
                 label=jnp.zeros((BATCH_SIZE, TOKENS), jnp.int32))
  return hk.transform_with_state(forward), batch


def _plain_step(forward, optimizer):
  """The step a user writes: loss, gradients, optax's update, state on."""

  def train_step(carry, batch):
    params, model_state, opt_state = carry

    def loss_fn(params):
      logits, new_state = forward.apply(params, model_state,
                                        jax.random.key(0), batch['image'],
                                        True)
      loss = optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), batch['label']).mean()
      return loss, new_state

    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), new_state, opt_state), loss

  return train_step


def _step_and_args(name: str, variant: str) -> tuple[Callable, tuple]:
  """The step and its arguments' shapes and dtypes (`jax.eval_shape`): all
  that lowering needs, without an eager init (ResNet18's takes seconds)."""
  forward, batch = _model(name)
  optimizer = optax.adam(LEARNING_RATE)
  scaler = loss_scaling.LossScaler(
      'dynamic' if variant.endswith('dynamic') else 'none')

  def args():
    params, model_state = forward.init(jax.random.key(0), batch['image'],
                                       True)
    if variant == 'plain':
      return (params, model_state, optimizer.init(params)), batch
    return train_state.init_train_state(params, optimizer, scaler,
                                        jax.random.key(1), model_state), batch

  step = (_plain_step(forward, optimizer) if variant == 'plain' else
          step_lib.make_train_step(
              classification.make_classification_loss(forward), optimizer,
              scaler))
  return step, jax.eval_shape(args)


def compile_seconds(name: str, variant: str) -> dict[str, float]:
  """CPU seconds to trace (`lower`) and to compile one fresh step."""
  step, args = _step_and_args(name, variant)
  start = time.process_time()
  lowered = jax.jit(step).lower(*args)
  traced = time.process_time()
  lowered.compile()
  return dict(lower_cpu_s=traced - start,
              compile_cpu_s=time.process_time() - traced)


def _rows(models, repeats: int, log) -> list[dict[str, Any]]:
  """One row per model and variant."""
  rows = []
  for name in models:
    times = {v: [] for v in VARIANTS}
    for _ in range(repeats):
      for variant in VARIANTS:
        times[variant].append(compile_seconds(name, variant))
    plain = statistics.median(t['compile_cpu_s'] for t in times['plain'])
    for variant in VARIANTS:
      compile_s = statistics.median(t['compile_cpu_s']
                                    for t in times[variant])
      row = dict(model=name, variant=variant, compile_cpu_s=compile_s,
                 lower_cpu_s=statistics.median(t['lower_cpu_s']
                                               for t in times[variant]),
                 compile_vs_plain=compile_s / plain, repeats=repeats)
      rows.append(row)
      if log:
        log(f'{name} {variant}: compile {compile_s:.1f} s of CPU, '
            f'{row["compile_vs_plain"]:.2f}x the plain step')
  return rows


def run(models=MODELS, repeats: int = 3,
        log: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
  """Every model's variants, alternated `repeats` times; the median of each
  and its ratio to the plain step."""
  with compilation.disabled():  # Every compile a fresh one.
    rows = _rows(models, repeats, log)
  return dict(machine=hardware.describe(), jax=jax.__version__,
              policy=POLICY, batch_size=BATCH_SIZE, rows=rows)


def plot(result: dict[str, Any], out_dir: str) -> list[str]:
  """Compile CPU seconds per model, one bar per variant."""
  path = f'{out_dir}/step_compile.png'
  models = list(dict.fromkeys(r['model'] for r in result['rows']))
  series = {v: [next(r['compile_cpu_s'] for r in result['rows']
                     if r['model'] == m and r['variant'] == v)
                for m in models] for v in VARIANTS}
  charts.grouped_bar_chart(path, models, series, 'compile, CPU s',
                           'Train step compile time', xlabel='model')
  return [path]
