"""The learning rate over a run: linear warmup, then cosine decay."""

import optax


def learning_rate_schedule(learning_rate: float, warmup_steps: int,
                           total_steps: int) -> optax.Schedule:
  """Linear warmup to `learning_rate`, then cosine decay to 0 at `total_steps`.

  Example:
    schedule = haiku_mp.learning_rate_schedule(1e-3, 500, total_steps=10_000)
    optimizer = haiku_mp.make_optimizer(schedule, weight_decay=0.05)
  """
  warmup = max(int(warmup_steps), 0)
  if not warmup:
    return optax.cosine_decay_schedule(learning_rate, max(total_steps, 1))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1))
