"""The collectives read from a compiled step, and their time on paper."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from haiku_mp import errors
from haiku_mp.studies import collectives
from haiku_mp.studies import communication
from tests import helpers

_LINES = '''
  %all_gather.4 = bf16[64,128]{1,0} all-gather(%x), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}, use_global_device_ids=true
  %all-reduce = f32[8,32]{1,0} all-reduce(%dot.1), channel_id=4, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %reduce_scatter.12 = f32[16,128]{0,1} reduce-scatter(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %ag-start = (f8e4m3fn[4,16]{1,0}, f8e4m3fn[32,16]{1,0}) all-gather-start(%q), replica_groups=[1,8]<=[8], dimensions={0}
  %ag-done = f8e4m3fn[32,16]{1,0} all-gather-done(%ag-start)
  %psum = f32[] all-reduce(%s), replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %tuple-ar = (f32[4]{0}, bf16[8]{0}) all-reduce(%a, %b), replica_groups=[4,2]<=[8], to_apply=%add
'''


class ParseTest(absltest.TestCase):

  def test_each_form_once(self):
    found = {c.name: c for c in collectives.parse_collectives(_LINES)}
    self.assertCountEqual(found, ['all_gather.4', 'all-reduce',
                                  'reduce_scatter.12', 'ag-start', 'psum',
                                  'tuple-ar'])
    gather = found['all_gather.4']
    self.assertEqual((gather.kind, gather.dtype, gather.bytes,
                      gather.group_size), ('all-gather', 'bfloat16',
                                           64 * 128 * 2, 4))
    self.assertEqual(found['all-reduce'].group_size, 4)
    scatter = found['reduce_scatter.12']
    self.assertEqual((scatter.bytes, scatter.input_bytes, scatter.group_size),
                     (16 * 128 * 4, 16 * 128 * 4 * 8, 8))
    start = found['ag-start']  # Its outputs, not its operands.
    self.assertEqual((start.kind, start.dtype, start.bytes, start.group_size),
                     ('all-gather', 'float8_e4m3fn', 32 * 16, 8))
    self.assertEqual((found['psum'].bytes, found['psum'].group_size), (4, 1))
    self.assertEqual((found['tuple-ar'].bytes, found['tuple-ar'].dtype),
                     (4 * 4 + 8 * 2, 'float32'))

  def test_ring_bytes_and_rows(self):
    found = {c.name: c for c in collectives.parse_collectives(_LINES)}
    self.assertAlmostEqual(collectives.wire_bytes(found['all_gather.4']),
                           0.75 * 64 * 128 * 2)
    self.assertAlmostEqual(collectives.wire_bytes(found['all-reduce']),
                           2 * 0.75 * 8 * 32 * 4)
    self.assertAlmostEqual(collectives.wire_bytes(found['reduce_scatter.12']),
                           7 / 8 * 16 * 128 * 4 * 8)
    rows = collectives.summarize(found.values())
    # The group of one device moves nothing and is left out.
    self.assertNotIn(1, [r['group_size'] for r in rows])
    scatter = next(r for r in rows if r['kind'] == 'reduce-scatter')
    self.assertEqual((scatter['count'], scatter['bytes']),
                     (1, 16 * 128 * 4 * 8))

  def test_paper_time(self):
    rows = [dict(kind='all-gather', dtype='bfloat16', group_size=8, count=2,
                 bytes=8e6, wire_bytes=7e6)]
    got = collectives.paper_time(rows, 989e9, 'ib_2node', 'h100_bf16')
    # 16 devices: a share of 15/16 where the compiled 8 sent 7/8.
    sent = 7e6 * (15 / 16) / (7 / 8)
    self.assertAlmostEqual(got['comm_seconds'], sent / 50e9 + 2 * 10e-6)
    self.assertAlmostEqual(got['compute_seconds'], 1e-3)
    self.assertEqual(got['bound'], 'compute')


class StepTest(parameterized.TestCase):

  @parameterized.parameters(('bfloat16', 2), ('float8_e4m3fn', 1))
  def test_the_partitioned_program_carries_the_gather_dtype(self, dtype,
                                                            size):
    """A shard_map that gathers a cast and reduce-scatters in float32: the
    program as partitioned says so, whatever XLA:CPU widens them to."""
    mesh = jax.make_mesh((4, 2), ('batch', 'model'),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def local(w, g):
      whole = jax.lax.all_gather(w.astype(dtype), 'batch', tiled=True)
      summed = jax.lax.psum_scatter(g, 'batch', tiled=True)
      return whole.astype(jnp.float32), summed

    fn = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P('batch'), P()),
        out_specs=(P(), P('batch')), axis_names={'batch'}, check_vma=False))
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32,
                             sharding=NamedSharding(mesh, P('batch')))
    g = jax.ShapeDtypeStruct((32, 16), jnp.float32,
                             sharding=NamedSharding(mesh, P()))
    result = collectives.step_collectives(fn, w, g)
    self.assertEqual(result['source'], 'partitioned')
    gathers = [r for r in result['collectives'] if r['kind'] == 'all-gather']
    self.assertEqual([(r['dtype'], r['bytes'], r['group_size'])
                      for r in gathers], [(dtype, 32 * 16 * size, 4)])
    scatter, = [r for r in result['collectives']
                if r['kind'] == 'reduce-scatter']
    self.assertEqual((scatter['dtype'], scatter['bytes']),
                     ('float32', 32 * 16 * 4))
    self.assertNotEmpty(result['compiled_collectives'])
    self.assertGreater(result['memory']['argument_bytes'], 0)


@helpers.long_running
class CommunicationStudyTest(absltest.TestCase):

  def test_a_bad_wire_is_one_line_before_anything_compiles(self):
    for wire, message in (('bf16/float32', "--wires (gather): unknown value "
                                           "'bf16'"),
                          ('compute', "--wires: 'compute' is not "
                                      'GATHER/REDUCE')):
      with self.assertRaises(errors.ConfigError) as raised:
        communication.run(helpers.tiny_config(), ['fsdp:8x1'], [wire],
                          log=self.fail)
      self.assertIn(message, str(raised.exception))
      self.assertNotIn('\n', str(raised.exception))

  def test_fsdp_gathers_and_reduces_in_the_dtypes_asked(self):
    """The tiny ViT under fsdp on 8 devices: float32 gathers and
    reductions, then bfloat16 gathers with float32 reductions, then both
    bfloat16, then fp8 kernels; each variant's bytes below the last."""
    config = helpers.tiny_config(
        'params=float32,compute=bfloat16,output=float32', dropout_rate=0.0)
    config.batch_size = config.eval_batch_size = 16
    result = communication.run(config, ['fsdp:8x1'], communication.WIRES,
                               log=lambda _: None)
    by_wire = {v['wire']: v for v in result['variants']}

    def dtypes(wire, kind):
      return {r['dtype'] for r in by_wire[wire]['collectives']
              if r['kind'] == kind}

    self.assertEqual(dtypes('float32/float32', 'all-gather'), {'float32'})
    self.assertEqual(dtypes('float32/float32', 'reduce-scatter'),
                     {'float32'})
    # Matrices in bfloat16, vectors as stored.
    self.assertEqual(dtypes('compute/float32', 'all-gather'),
                     {'bfloat16', 'float32'})
    self.assertEqual(dtypes('compute/float32', 'reduce-scatter'),
                     {'float32'})
    self.assertEqual(dtypes('compute/compute', 'reduce-scatter'),
                     {'bfloat16'})
    self.assertIn('float8_e4m3fn', dtypes('fp8/compute', 'all-gather'))
    ratios = [by_wire[w]['bytes_ratio'] for w in communication.WIRES]
    self.assertEqual(ratios[0], 1.0)
    self.assertEqual(ratios, sorted(ratios, reverse=True))
    self.assertLess(ratios[-1], 0.5)


if __name__ == '__main__':
  absltest.main()
