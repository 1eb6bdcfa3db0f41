"""The suite's own measure: JAX's events of a run, per test class and
program (tests/jax_events.py)."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

import contextlib
import io
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp

from tests import disk_full_at_step
from tests import jax_events

_SCOPE = 'tests/commands/jax_events_test.py::JaxEventsTest'


def _a_program_of_its_own(x):
  return jnp.sin(x) * 2 + 1


class JaxEventsTest(parameterized.TestCase):

  def test_a_compile_is_counted_for_its_test_class_and_program(self):
    directory = self.enter_context(tempfile.TemporaryDirectory())
    test = f'{_SCOPE}::test_a_compile (call)'
    x = jnp.arange(3.0)
    with mock.patch.dict(os.environ, {'PYTEST_CURRENT_TEST': test}):
      stop = jax_events.record(directory)
      try:
        jax.jit(_a_program_of_its_own)(x).block_until_ready()
      finally:
        stop()
    # Nothing once stopped.
    jax.jit(lambda y: y - 1)(x).block_until_ready()
    # A line a killed process left unfinished is passed over.
    with open(os.path.join(directory, '1.jsonl'), 'w') as f:
      f.write('{"kind": "compile", "seco')
    result = jax_events.summary(jax_events.read(directory))
    self.assertEqual(result['programs'],
                     {'jit(_a_program_of_its_own)': mock.ANY})
    program = result['programs']['jit(_a_program_of_its_own)']
    self.assertEqual(program['count'], 1)
    self.assertGreater(program['seconds'], 0)
    compiled = sum(result['kinds'][k]['count']
                   for k in ('compile', 'compile_small') if k in result['kinds'])
    self.assertEqual(compiled, 1)
    self.assertEqual(result['kinds']['trace']['count'], 1)
    self.assertEqual(list(result['scopes']), [_SCOPE])
    self.assertAlmostEqual(
        sum(result['scopes'][_SCOPE].values()),
        sum(v['seconds'] for v in result['kinds'].values()))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      self.assertEqual(jax_events.main([directory, '--top=5']), 0)
    self.assertIn('| `jit(_a_program_of_its_own)` | 1 |', out.getvalue())
    self.assertIn(f'| `{_SCOPE}` |', out.getvalue())

  def test_an_event_that_finds_no_room_is_lost_not_raised(self):
    directory = self.enter_context(tempfile.TemporaryDirectory())
    x = jnp.arange(4.0)
    stop = jax_events.record(directory)
    try:
      jax.jit(lambda y: y * 3)(x).block_until_ready()
      give_room_back = disk_full_at_step.leave_no_room(directory)
      try:
        jax.jit(lambda y: y * 4)(x).block_until_ready()
      finally:
        give_room_back()
      jax.jit(lambda y: y * 5)(x).block_until_ready()
    finally:
      stop()
    result = jax_events.summary(jax_events.read(directory))
    self.assertEqual(result['kinds']['trace']['count'], 2)

  def test_a_forked_command_is_named_by_its_module_file_and_first_flag(self):
    directory = self.enter_context(tempfile.TemporaryDirectory())
    x = jnp.arange(5.0)
    argv = ['/repo/launch/train.py', '--config=configs/vit_fp16.py',
            '--workdir=runs/x']
    with mock.patch.dict(os.environ), mock.patch.object(sys, 'argv', argv):
      os.environ.pop('PYTEST_CURRENT_TEST', None)
      stop = jax_events.record(directory)
      try:
        jax.jit(lambda y: y / 7)(x).block_until_ready()
      finally:
        stop()
    result = jax_events.summary(jax_events.read(directory))
    self.assertEqual(list(result['scopes']),
                     ['launch/train.py --config=configs/vit_fp16.py'])

  @parameterized.parameters((['/nonexistent'],), (['.', '--top=many'],), ([],))
  def test_bad_arguments_are_one_line(self, argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      self.assertEqual(jax_events.main(argv), 2)
    self.assertLen(err.getvalue().splitlines(), 1)
    self.assertStartsWith(err.getvalue(), 'usage: python -m tests.jax_events')


if __name__ == '__main__':
  absltest.main()
