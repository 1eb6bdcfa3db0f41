"""The host at most a few programs ahead of the devices, and never stuck;
and evaluation over a whole split the same way (`evaluate`).

A compiled call returns as soon as its program is queued, so a loop that only
dispatches runs ahead until XLA's queue is full: 32 programs per device on
XLA:CPU. Dozens of queued steps buy no speed (a few keep a device fed); they
delay a stop or a checkpoint by as many steps, and on XLA:CPU with several
devices they stall the run for good. The CPU client launches a multi-device
program on a pool of max(cores, devices) threads; a launch that waits for room
in a full device queue holds one of those threads, and the program running
then has a collective whose last participant finds no thread: 7 of 8 arrive,
and XLA aborts after 40 s (docs/training.md, "Runs that never hang").

`InFlight` keeps at most `limit` dispatched programs unfinished: each push
past the limit waits for the oldest. A wait that lasts longer than the stall
limit ends the process with one line (`exit_on_stall`): nothing else can
interrupt a wait inside the runtime, and the newest checkpoint is whole.
"""

import collections
import os
import sys
import threading
import time
from typing import Any, Callable, Hashable, Optional

import jax

from haiku_mp.vit.data import prefetch
from haiku_mp.vit.settings import run as run_settings
from haiku_mp.vit.train import console


# The most programs a loop may keep in flight (the setting's own bound).
MAX_LIMIT = run_settings.MAX_STEPS_IN_FLIGHT
# A wait may take this many times the longest one seen before it counts as a
# stall, so that a run of slow steps (a large batch on a CPU) is not one.
SLOWEST_WAIT_FACTOR = 4.0
# How often the watchdog looks at the wait in progress, at most.
_POLL_SEC = 1.0
# A gap between two of the watchdog's looks this much longer than it asked
# for means that the process was not running (SIGSTOP or Ctrl-Z, a suspended
# machine or VM): that time is no device's, and does not count toward a
# stall. A stalled device leaves the watchdog running (its wait releases the
# GIL), so a real stall is never hidden this way.
SUSPENDED_GAP_SEC = 5.0
EXIT_STALLED = 1  # A failure of the environment, as `errors.RunError` exits.

OnStall = Callable[[Hashable, float], None]
# Blocks until a program's outputs are ready; returns them.
Wait = Callable[[Any], Any]

# XLA:CPU's own limits on a collective that not every device has reached:
# after 20 s it logs a warning per device, after 40 s it aborts the process
# with a hundred lines of stacks. -1: never.
_XLA_CPU_RENDEZVOUS_FLAGS = (
    'xla_cpu_collective_call_warn_stuck_timeout_seconds',
    'xla_cpu_collective_call_terminate_timeout_seconds')


def xla_flags(existing: str, stall_sec: float) -> str:
  """XLA_FLAGS (`existing`, as set) for a run whose waits are watched for
  `stall_sec`: XLA:CPU's rendezvous limits off, so that a stalled collective
  ends with the watchdog's one line; flags already set are kept, and with
  `stall_sec` 0 (no watchdog) XLA's limits stay."""
  if stall_sec <= 0:
    return existing
  added = [f'--{name}=-1' for name in _XLA_CPU_RENDEZVOUS_FLAGS
           if f'--{name}=' not in existing]
  return ' '.join([existing.strip(), *added]).strip()


def exit_on_stall(advice: str) -> OnStall:
  """An `OnStall` that prints `error: ...` with `advice` (what to do) and
  ends the process at once: the stalled thread holds the runtime, so no
  Python cleanup could run."""

  def report(label, seconds):
    sys.stderr.write(
        f'error: {label} has not finished after {seconds:.0f}s: the devices '
        'stalled (a collective that not every device reached, or a lost '
        f'process of the run). {advice}\n')
    sys.stderr.flush()
    os._exit(EXIT_STALLED)  # pylint: disable=protected-access

  return report


class _Watchdog:
  """A thread that calls `on_stall` once when a wait outlasts the limit:
  `stall_sec`, or `SLOWEST_WAIT_FACTOR` times the longest wait so far. Time
  the process spent suspended (`SUSPENDED_GAP_SEC`) is not counted."""

  def __init__(self, stall_sec: float, on_stall: OnStall,
               clock: Callable[[], float] = time.monotonic):
    self._stall_sec, self._on_stall = stall_sec, on_stall
    self._clock = clock
    # (label, start, suspended time so far at its start) of the wait in
    # progress.
    self._waiting = None
    self._suspended = 0.0  # Seconds the process was seen suspended, in all.
    self._longest = 0.0
    self._closed = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True,
                                    name='haiku_mp-stall-watchdog')
    self._thread.start()

  def limit(self) -> float:
    return max(self._stall_sec, SLOWEST_WAIT_FACTOR * self._longest)

  def _elapsed(self, now: float, start: float,
               suspended_at_start: float) -> float:
    return now - start - (self._suspended - suspended_at_start)

  def wait(self, label: Hashable, outputs: Any, wait: Wait) -> Any:
    waiting = (label, self._clock(), self._suspended)
    self._waiting = waiting
    try:
      return wait(outputs)
    finally:
      self._waiting = None
      self._longest = max(self._longest,
                          self._elapsed(self._clock(), *waiting[1:]))

  def _watch(self) -> None:
    interval = min(_POLL_SEC, self._stall_sec / 4)
    last = self._clock()
    while not self._closed.wait(interval):
      now = self._clock()
      if now - last - interval > SUSPENDED_GAP_SEC:
        self._suspended += now - last - interval
      last = now
      waiting = self._waiting
      if waiting is None:
        continue
      label, start, suspended_at_start = waiting
      seconds = self._elapsed(now, start, suspended_at_start)
      if seconds > self.limit():
        self._on_stall(label, seconds)
        return

  def close(self) -> None:
    self._closed.set()
    self._thread.join()


class InFlight:
  """At most `limit` pushed programs unfinished, their waits watched.

  `push(label, outputs)` records a dispatched program by its outputs (any
  pytree of device arrays); past the limit it waits for the oldest and
  returns its (label, outputs), ready, so that reading them costs a copy,
  not a wait. With `stall_sec` > 0 a wait that lasts longer than the
  watchdog's limit calls `on_stall(label, seconds)`. `wait` is how a wait
  is done (an instrument or a test may see each one), `clock` how time is
  read (a test may move it). A context manager: the
  watchdog's thread ends with it; what is still in flight is left to run.
  """

  def __init__(self, limit: int, stall_sec: float = 0.0,
               on_stall: Optional[OnStall] = None,
               wait: Wait = jax.block_until_ready,
               clock: Callable[[], float] = time.monotonic):
    if limit < 1:
      raise ValueError(f'limit={limit} must be at least 1')
    self.limit = limit
    self._wait_for = wait
    self._pending = collections.deque()
    self._watchdog = None
    if stall_sec > 0:
      self._watchdog = _Watchdog(stall_sec, on_stall or exit_on_stall(''),
                                 clock)

  def _wait(self, item):
    label, outputs = item
    if self._watchdog is None:
      return label, self._wait_for(outputs)
    return label, self._watchdog.wait(label, outputs, self._wait_for)

  def push(self, label: Hashable, outputs: Any):
    """(label, outputs) of the oldest program once more than `limit` are in
    flight (waited for), else None."""
    self._pending.append((label, outputs))
    if len(self._pending) > self.limit:
      return self._wait(self._pending.popleft())
    return None

  def drain(self) -> list[tuple[Hashable, Any]]:
    """Waits for every program in flight; their (label, outputs) in order."""
    done = []
    while self._pending:
      done.append(self._wait(self._pending.popleft()))
    return done

  def __len__(self) -> int:
    return len(self._pending)

  def close(self) -> None:
    if self._watchdog is not None:
      self._watchdog.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


_SUMMED = ('loss', 'accuracy', 'num_examples')


def evaluate(eval_step, params, batches, to_host,
             watch: InFlight) -> dict[str, float]:
  """Loss and accuracy over every (unpadded) example of `batches`.

  `eval_step` returns metrics over the whole global batch, so the result
  covers every process's examples. Each batch is one program on the devices:
  its metrics are summed on the host (`to_host`: the strategy's copy of
  replicated values) once it is finished, with at most `watch.limit`
  batches in flight (`watch`: an empty `InFlight`).
  """
  sums = dict.fromkeys(_SUMMED, 0.0)

  def add(finished):
    _, out = finished
    out = to_host(out)
    n = float(out['num_examples'])
    sums['loss'] += float(out['loss']) * n
    sums['accuracy'] += float(out['accuracy']) * n
    sums['num_examples'] += n

  for i, batch in enumerate(batches):
    out = eval_step(params, batch)
    finished = watch.push(f'eval batch {i + 1}', {k: out[k] for k in _SUMMED})
    if finished is not None:
      add(finished)
  for finished in watch.drain():
    add(finished)
  n = sums['num_examples']
  return dict(loss=sums['loss'] / n, accuracy=sums['accuracy'] / n,
              num_examples=int(n))


class Evaluator:
  """Evaluates on a split, logs and writes the result, keeps the time spent."""

  def __init__(self, exp, splits, shard, writer, progress,
               on_stall: Optional[OnStall] = None):
    self._exp, self._splits, self._shard = exp, splits, shard
    self._writer, self._progress = writer, progress
    self._on_stall = on_stall

  def __call__(self, split_name: str, step: int, params,
               label: Optional[str] = None, **extra) -> dict[str, float]:
    """The split's metrics, written with `extra` ones (DP-SGD's epsilon) as
    the split `label` (default: its name; 'val_ema' for the params' moving
    average)."""
    label = label or split_name
    exp = self._exp
    start = time.perf_counter()
    with prefetch.DevicePrefetch(
        exp.eval_batches(getattr(self._splits, split_name), self._shard),
        exp.strategy.place_batch, exp.settings.data.prefetch_batches
    ) as batches, InFlight(
        exp.settings.steps_in_flight, exp.settings.stall_timeout_sec,
        self._on_stall) as watch:
      result = dict(evaluate(exp.strategy.eval_step, params, batches,
                             exp.strategy.to_host, watch), **extra)
    self._progress.eval_seconds += time.perf_counter() - start
    self._writer.write(step, label, result)
    console.info('%s at step %d: loss %.4f accuracy %.4f (%d examples)',
                       label, step, result['loss'], result['accuracy'],
                       result['num_examples'])
    return result
