"""Tests for policy parsing, per-class / per-path rules and their scoping."""

import os
import sys

if __name__ == '__main__':  # Run alone: `tests` from the repository's root.
  sys.path.insert(0, os.path.abspath(os.path.join(__file__, '..', '..', '..')))

from absl.testing import absltest
from absl.testing import parameterized
import haiku as hk
import jax
import jax.numpy as jnp
import jmp

import haiku_mp
from haiku_mp import errors
from haiku_mp.model import low_bit as low_bit_lib
from haiku_mp.model import policies
from haiku_mp.model import policy_strings
from haiku_mp.model.precision_error import PrecisionError
from haiku_mp.vit.model import forward as forward_lib
from haiku_mp.vit.model import vit
from tests import helpers

BF16 = 'params=float32,compute=bfloat16,output=float32'
FP16 = 'params=float32,compute=float16,output=float32'


def _two_blocks(*args, **kwargs):
  """The tiny config with a second block, for rules that tell blocks apart."""
  return helpers.tiny_config(*args, num_layers=2, **kwargs)


def _policies_by_path(config):
  """{path: (policy in force, input dtypes)} of every module's __call__."""
  calls, _ = forward_lib.trace_modules(
      config.model, forward_lib.precision_from_config(config))
  return {c.path: (policy_strings.policy_str(c.policy),
                   tuple(x.dtype for x in jax.tree.leaves(c.args)
                         if hasattr(x, 'dtype')))
          for c in calls if c.method == '__call__'}


class ParseTest(parameterized.TestCase):

  @parameterized.parameters(
      ('params=float32,compute=bfloat16,output=float32',
       jnp.float32, jnp.bfloat16, jnp.float32),
      ('p=f32,c=f16,o=f32', jnp.float32, jnp.float16, jnp.float32),
      ('float32', jnp.float32, jnp.float32, jnp.float32),
      ('c=bf16', jnp.float32, jnp.bfloat16, jnp.bfloat16),
  )
  def test_valid_policy(self, text, params, compute, output):
    policy = policy_strings.parse_policy(text)
    self.assertEqual(policy.param_dtype, params)
    self.assertEqual(policy.compute_dtype, compute)
    self.assertEqual(policy.output_dtype, output)

  @parameterized.parameters('float8', 'p=f32,c=foo', 'x=f32', '',
                            'p=f32;c=f16', 'params=float32,compute')
  def test_invalid_policy_names_string_and_setting(self, text):
    with self.assertRaises(PrecisionError) as cm:
      policy_strings.parse_policy(text)
    self.assertStartsWith(str(cm.exception), 'policy: ')
    self.assertIn(repr(text), str(cm.exception))

  def test_overrides_parse_in_order(self):
    rules = policies.parse_overrides(
        '*/head:float32; Attention:p=f32,c=f32,o=bf16;')
    self.assertEqual([r.target for r in rules], ['*/head', 'Attention'])
    self.assertEqual(rules[0].policy,
                     jmp.Policy(jnp.float32, jnp.float32, jnp.float32))
    self.assertEqual(rules[1].policy.output_dtype, jnp.bfloat16)

  @parameterized.parameters('head', ':float32', 'Linear:f8', 'a:f32;a:f16')
  def test_malformed_overrides_name_the_entry(self, text):
    with self.assertRaises(PrecisionError) as cm:
      policies.parse_overrides(text)
    message = str(cm.exception)
    self.assertStartsWith(message, 'overrides')

  def test_bad_override_policy_names_its_target(self):
    with self.assertRaisesRegex(PrecisionError,
                                r"overrides\['Linear'\].*'f8'"):
      policies.parse_overrides('Linear:f8')

  @parameterized.parameters('BatchNorm', '*/no_such_module', 'head')
  def test_unmatched_override_is_an_error_naming_it(self, target):
    config = _two_blocks(BF16, overrides=f'{target}:float32')
    with self.assertRaises(PrecisionError) as cm:
      forward_lib.checked_forward(config)
    self.assertIn(repr(target), str(cm.exception))
    self.assertIn('matches no module', str(cm.exception))


class RuleTest(parameterized.TestCase):

  def test_defaults_model_policy_and_float32_layer_norm(self):
    paths = _policies_by_path(_two_blocks(FP16))
    self.assertEqual(paths['vit'][0], 'p=f32,c=f16,o=f32')
    self.assertEqual(paths['vit/encoder_block_0/attention/query'][0],
                     'p=f32,c=f16,o=f32')
    ln = paths['vit/encoder_block_1/ln_mlp']
    self.assertEqual(ln[0], 'p=f32,c=f32,o=f16')
    self.assertEqual(ln[1], (jnp.float32,))  # Statistics see float32 inputs.

  def test_class_override_changes_exactly_that_class_and_children(self):
    base = _policies_by_path(_two_blocks(BF16))
    over = _policies_by_path(_two_blocks(
        BF16, overrides='Attention:p=f32,c=f32,o=bf16'))
    changed = {p for p in base if base[p] != over[p]}
    expected = {p for p in base if '/attention' in p}
    self.assertEqual(changed, expected)
    self.assertLen(expected, 2 * 5)  # 2 blocks x (Attention + 4 Linear).
    self.assertEqual(over['vit/encoder_block_0/attention/key'],
                     ('p=f32,c=f32,o=bf16', (jnp.float32,)))

  def test_path_override_beats_class_policy(self):
    base = _policies_by_path(_two_blocks(BF16))
    over = _policies_by_path(_two_blocks(
        BF16, overrides='Linear:p=f32,c=f16,o=f16;*/head:float32'))
    self.assertEqual(over['vit/head'], ('p=f32,c=f32,o=f32', (jnp.float32,)))
    linears = {p for p in base if p.endswith(('query', 'key', 'value', 'out',
                                              'fc1', 'fc2'))}
    for path in linears:
      self.assertEqual(over[path][0], 'p=f32,c=f16,o=f16', path)
    changed = {p for p in base if base[p] != over[p]}
    self.assertEqual(changed, linears | {'vit/head'})

  def test_path_glob_matches_a_whole_block(self):
    over = _policies_by_path(_two_blocks(
        BF16, overrides='*encoder_block_1*:float32'))
    for path, (policy, _) in over.items():
      expected = ('p=f32,c=f32,o=f32' if 'encoder_block_1' in path else
                  'p=f32,c=f32,o=bf16' if path.endswith(('ln_attention',
                                                         'ln_mlp', 'ln_final'))
                  else 'p=f32,c=bf16,o=f32')
      self.assertEqual(policy, expected, path)

  def test_layer_norm_float32_can_be_switched_off(self):
    config = _two_blocks(FP16)
    config.precision.float32_layer_norm = False
    self.assertEqual(_policies_by_path(config)['vit/ln_final'][0],
                     'p=f32,c=f16,o=f32')


class JmpAndHaikuTest(absltest.TestCase):
  """`make_precision` from jmp policies and module classes is the precision
  the configs' strings give."""

  def test_policies_and_classes_equal_the_strings(self):
    from_strings = policies.make_precision(
        'params=float32,compute=bfloat16,output=float32',
        '*/linear_1:float32;LayerNorm:p=f32,c=f32,o=f32', model_class='MLP',
        low_bit=haiku_mp.LowBit('Linear'))
    from_objects = policies.make_precision(
        jmp.get_policy('p=f32,c=bf16,o=f32'),
        {'*/linear_1': jmp.get_policy('float32'),
         hk.LayerNorm: 'p=f32,c=f32,o=f32'},
        model_class=hk.nets.MLP, low_bit=haiku_mp.LowBit([hk.Linear]))
    self.assertEqual(from_objects, from_strings)

  def test_delayed_scaling_with_a_4_bit_format_names_both_settings(self):
    with self.assertRaisesRegex(
        errors.ConfigError,
        '^fp8.scaling=delayed with fp4.format=nvfp4: 4-bit formats scale per '
        'block themselves'):
      low_bit_lib.from_parts('Linear', haiku_mp.Fp8('delayed'),
                             haiku_mp.Fp4('nvfp4'))

  def test_a_target_that_is_neither_class_nor_string_names_the_setting(self):
    with self.assertRaisesRegex(PrecisionError,
                                '^overrides: a target must be'):
      policies.make_precision('float32', {3: 'float32'}, model_class='MLP')
    with self.assertRaisesRegex(PrecisionError,
                                '^modules: a target must be'):
      policies.make_precision('p=f32,c=bf16,o=f32', model_class='MLP',
                              low_bit=haiku_mp.LowBit([None]))


class ScopeTest(parameterized.TestCase):

  def test_same_program_as_hk_mixed_precision_for_class_rules(self):
    config = _two_blocks(FP16)
    ours = forward_lib.make_forward(
        config.model, forward_lib.precision_from_config(config))
    kwargs = dict(config.model)
    main = policy_strings.parse_policy(FP16)
    layer_norm = jmp.Policy(jnp.float32, jnp.float32, jnp.float16)

    def haiku_forward(images, is_training):
      with hk.mixed_precision.push_policy(vit.VisionTransformer, main), \
          hk.mixed_precision.push_policy(hk.LayerNorm, layer_norm):
        return vit.VisionTransformer(**kwargs)(images, is_training)

    theirs = hk.transform(haiku_forward)
    images = helpers.random_batch(config)['image']
    # The programs are traced, never run: the params' shapes are enough.
    params = jax.eval_shape(lambda key: ours.init(key, images, True),
                            jax.random.key(0))
    rng = jax.random.key(1)
    trace = lambda f: jax.make_jaxpr(
        lambda p, r, x: f.apply(p, r, x, True))(params, rng, images)
    ours_jaxpr, theirs_jaxpr = trace(ours), trace(theirs)
    self.assertIn('f16[', str(ours_jaxpr))
    self.assertEqual(str(ours_jaxpr), str(theirs_jaxpr))

  def test_two_models_in_one_process_do_not_leak(self):
    fp16 = _two_blocks(FP16)
    fp32 = _two_blocks('float32')
    for config in (fp16, fp32):  # float16 dots as float16 (not on a CPU).
      config.precision.dot_platform = 'gpu'
    images = helpers.random_batch(fp16)['image']
    f16_forward, _ = forward_lib.checked_forward(fp16)
    f32_forward, _ = forward_lib.checked_forward(fp32)
    params = f16_forward.init(jax.random.key(0), images, False)
    for forward, dtype in ((f16_forward, 'float16'), (f32_forward, 'float32'),
                           (f16_forward, 'float16')):
      eqns = helpers.eqns_of(
          lambda p, x, f=forward: f.apply(p, None, x, False), params, images)
      self.assertNotEmpty(eqns)
      self.assertEqual({helpers.operand_dtypes(e) for e in eqns},
                       {(dtype, dtype)})


class WithDtypesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('params', dict(params='bfloat16'),
       'params=bfloat16,compute=float16,output=float32'),
      ('compute_and_output', dict(compute='bfloat16', output='bfloat16'),
       'params=float32,compute=bfloat16,output=bfloat16'),
      ('none_keeps', dict(compute=None), 'params=float32,compute=float16,'
       'output=float32'))
  def test_the_named_dtypes_change_the_rest_stay(self, dtypes, expected):
    got = policy_strings.with_dtypes('p=f32,c=f16,o=f32', **dtypes)
    self.assertEqual(got, expected)
    self.assertEqual(policy_strings.parse_policy(got),
                     policy_strings.parse_policy(expected))

  def test_a_bad_dtype_names_the_setting(self):
    with self.assertRaisesRegex(Exception, '^sweep dtype'):
      policy_strings.with_dtypes('p=f32,c=f16,o=f32', setting='sweep dtype',
                           compute='float13')


if __name__ == '__main__':
  absltest.main()
