"""Compiles and times one variant's train step, in a fresh process or here.

In a fresh process (`python -m haiku_mp.lab.isolated`, settings on stdin,
result as the last line of stdout) a device's peak bytes are that variant's
own, and no compile cache or allocator state carries over from the variant
measured before. Every timed lab experiment measures through `measure`.
"""

import json
import subprocess
import sys
from typing import Any

import jax

from haiku_mp import errors
from haiku_mp.lab import timing
from haiku_mp.vit import settings as settings_lib
from haiku_mp.vit.settings import fields as settings_fields


def measure_compiled(step: timing.CompiledStep, num_steps: int,
                     warmup_steps: int) -> dict[str, Any]:
  """The compiled step's stats, its timing, and the epoch time that implies."""
  times = timing.time_steps(step, num_steps, warmup_steps)
  epoch_examples = step.experiment.num_train_examples
  return dict(**step.stats, **times,
              epoch_sec=epoch_examples / times['images_per_sec'],
              device=str(jax.devices()[0].device_kind))


def time_step(settings: settings_lib.Settings, num_steps: int,
              warmup_steps: int, isolate: bool = True) -> dict[str, Any]:
  """`measure_compiled` of `settings`' train step, in a fresh process if
  `isolate`. A variant that fails there is one ConfigError naming it."""
  if not isolate:
    return measure_compiled(timing.compile_train_step(settings),
                            num_steps, warmup_steps)
  request = dict(settings=settings_fields.to_dict(settings),
                 num_steps=num_steps, warmup_steps=warmup_steps)
  proc = subprocess.run([sys.executable, '-m', __name__],
                        input=json.dumps(request), capture_output=True,
                        text=True, check=False)
  if proc.returncode:
    lines = proc.stderr.strip().splitlines() or ['(no output)']
    reason = lines[-1] if proc.returncode == 2 else '\n'.join(lines[-30:])
    raise errors.ConfigError(
        f'variant {settings.precision.policy} batch_size='
        f'{settings.batch_size} '
        f'failed: {reason}')
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
  request = json.loads(sys.stdin.read())
  # Parsed: the JSON's lists become the tuples the settings hold.
  settings = settings_lib.parse(request['settings'])
  try:
    result = time_step(settings, request['num_steps'], request['warmup_steps'],
                       isolate=False)
  except errors.ConfigError as e:
    print(f'{type(e).__name__}: {e}', file=sys.stderr)
    sys.exit(2)
  print(json.dumps(result))


if __name__ == '__main__':
  main()
