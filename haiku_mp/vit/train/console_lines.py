"""The trainer's console: a line per log window, the skipped steps'
warnings, the summary line at the end."""

import contextlib
import contextvars
from typing import Any, Iterator, Mapping, Optional

from absl import logging

from haiku_mp.vit.train import progress as progress_lib


def log_overflows(window, first_step: int, param_names: list[str],
                   most: int = 5) -> None:
  """Names the parameters whose gradients were not finite at skipped steps."""
  for i, m in enumerate(window):
    if bool(m['grads_finite']):
      continue
    bad = [n for n, flag in zip(param_names, m['nonfinite_grads']) if flag]
    more = f' and {len(bad) - most} more' if len(bad) > most else ''
    logging.warning('step %d skipped (loss scale %g): non-finite gradients in '
                    '%s%s', first_step + i, float(m['loss_scale']),
                    ', '.join(bad[:most]), more)


def _percent(value: Optional[float]) -> str:
  return '-' if value is None else f'{100 * value:.2f}%'


def summary_line(summary: Mapping[str, Any], path: str) -> str:
  """The console's last line of a finished run: its figures rounded as the
  progress lines round them; `path` (summary.json) keeps them whole."""
  val_loss = summary.get('val_loss')
  parts = [
      f'test {_percent(summary["test_accuracy"])} '
      f'(loss {summary["test_loss"]:.4f}), val '
      f'{_percent(summary.get("val_accuracy"))}' +
      (f' (loss {val_loss:.4f})' if val_loss is not None else '')]
  if summary.get('ema_test_accuracy') is not None:
    parts.append(f'moving average: test '
                 f'{_percent(summary["ema_test_accuracy"])}, val '
                 f'{_percent(summary.get("ema_val_accuracy"))}')
  parts.append(f'{summary["steps"]} steps, {summary["skipped_steps"]} '
               f'skipped, final loss scale {summary["final_loss_scale"]:g}')
  if summary.get('epsilon') is not None:
    parts.append(f'epsilon {summary["epsilon"]:.2f}')
  parts.append(
      f'{summary["images_per_sec"]:.0f} img/s, train '
      f'{progress_lib.format_duration(summary["train_time_sec"])}, eval '
      f'{progress_lib.format_duration(summary["eval_time_sec"])}')
  return f'Summary: {"; ".join(parts)}. Every figure: {path}'


def log_line(step: int, total: int, summary: Mapping[str, Any],
             progress: Mapping[str, float]) -> str:
  """The console's line for a log window."""
  epsilon = (f'eps {summary["epsilon"]:.2f} ' if 'epsilon' in summary
             else '')
  return (f'step {step}/{total} [{100 * step / total:.0f}%] '
          f'loss {summary["loss"]:.4f} acc {summary["accuracy"]:.3f} '
          f'scale {summary["loss_scale"]:g} skipped {summary["skipped_steps"]} '
          f'{epsilon}| {progress["images_per_sec"]:.0f} img/s '
          f'| ETA {progress_lib.format_duration(progress["eta_sec"])}')


# Whether the trainer's INFO lines are held back (`quietly`): the library's
# own state, per context, where lowering absl's verbosity would change the
# whole process's logging.
_QUIET = contextvars.ContextVar('haiku_mp_trainer_quiet', default=False)


def info(message: str, *args) -> None:
  """One of the trainer's INFO lines (startup, progress, checkpoints,
  evaluation, summary), logged as from its caller's line, unless `quietly`
  holds it back."""
  if _QUIET.get() and logging.get_verbosity() <= logging.INFO:
    return
  logging.info(message, *args, stacklevel=2)


@contextlib.contextmanager
def quietly() -> Iterator[None]:
  """The trainer's INFO lines (`info`) held back inside the block at the
  default verbosity (`--verbosity=1` shows them), for callers that print one
  line per run of their own (the report, the loop benchmark); each run's
  record is in its workdir (metrics.jsonl, summary.json). Warnings, errors
  and every other logger are left as they are."""
  token = _QUIET.set(True)
  try:
    yield
  finally:
    _QUIET.reset(token)
