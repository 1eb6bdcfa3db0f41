"""The collectives read from a compiled step, and their time on paper."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from haiku_mp import errors
from haiku_mp.lab.studies import collectives
from haiku_mp.lab.studies import communication
from haiku_mp.lab.studies import partitioned_step
from haiku_mp.lab.studies import wire_time
from haiku_mp.vit import settings as settings_lib
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

  def test_mesh_axes_groups(self):
    """The third form of replica groups: a mesh and the axes each group
    runs along (what jax's GSPMD steps print); groups of one device
    otherwise."""
    lines = '\n'.join(
        f'  %r{i} = f32[8]{{0}} all-reduce(%x), channel_id={i}, '
        f'replica_groups={groups}, use_global_device_ids=true, to_apply=%add'
        for i, groups in enumerate([
            "mesh['a'=4,'b'=2] {'b'}", "mesh['a'=4,'b'=2] {'a'}",
            "mesh['a'=4,'b'=2] {'a','b'}", "mesh['a'=4,'b'=2] {'a':(1)2}",
            "mesh['x'=8]", "mesh['a'=1,'b'=1,'c'=8] {'c'}"]))
    self.assertEqual([c.group_size
                      for c in collectives.parse_collectives(lines)],
                     [2, 4, 8, 2, 8, 8])

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
    got = wire_time.paper_time(rows, 989e9, 'ib_2node', 'h100_bf16')
    # 16 devices: a share of 15/16 where the compiled 8 sent 7/8.
    sent = 7e6 * (15 / 16) / (7 / 8)
    self.assertAlmostEqual(got['comm_seconds'], sent / 50e9 + 2 * 10e-6)
    self.assertAlmostEqual(got['bandwidth_seconds'], sent / 50e9)
    self.assertAlmostEqual(got['latency_seconds'], 2 * 10e-6)
    self.assertAlmostEqual(got['compute_seconds'], 1e-3)
    self.assertEqual(got['bound'], 'compute')
    # Many small collectives: bandwidth alone hides, their latencies not.
    many = [dict(rows[0], count=200, wire_bytes=7e3)]
    got = wire_time.paper_time(many, 989e9, 'ib_2node', 'h100_bf16')
    self.assertEqual((got['bandwidth_bound'], got['bound']),
                     ('compute', 'communication'))


_ASYNC = '''
HloModule m, num_partitions=8
ENTRY %main (p: f32[4], q: bf16[8]) -> f32[4] {
  %ar-start = (f32[4]{0}, bf16[8]{0}) all-reduce-start(%p, %q), replica_groups={}, to_apply=%add
  %ar-done = (f32[4]{0}, bf16[8]{0}) all-reduce-done(%ar-start)
  %cp-start = (f32[2,3]{1,0}, f32[2,3]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=1, source_target_pairs={{0,1},{1,0}}
  %cp-done = f32[2,3]{1,0} collective-permute-done(%cp-start)
  %lone-start = (bf16[4]{0}, bf16[4]{0}, u32[], u32[]) collective-permute-start(%q), source_target_pairs={{0,1}}
  %rs-start = ((f32[32]{0}), f32[8]{0}, s32[]) async-start(%p), calls=%wrapped_reduce_scatter
  %rs-done = f32[8]{0} async-done(%rs-start), calls=%wrapped_reduce_scatter
}
%wrapped_reduce_scatter (x: f32[32]) -> f32[8] {
  ROOT %rs = f32[8]{0} reduce-scatter(%x), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
}
'''

# A scan of 5 steps around a loop of 3 (jax's form: `i < N` from 0), a loop
# the compiler annotated, and a loop on data.
_LOOPS = '''
HloModule loops, num_partitions=8

%inner_body (a: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = (s32[], f32[4]{0}) parameter(0)
  %psum = f32[4]{0} all-reduce(%x), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
}

%inner_cond (b: (s32[], f32[4])) -> pred[] {
  %i = s32[] get-tuple-element(%b), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (c: (s32[], f32[4])) -> (s32[], f32[4]) {
  %g = bf16[32,16]{1,0} all-gather(%w), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %inner = (s32[], f32[4]{0}) while(%t), condition=%inner_cond, body=%inner_body
}

%outer_cond (d: (s32[], f32[4])) -> pred[] {
  %j = s32[] get-tuple-element(%d), index=0
  %five = s32[] constant(5)
  ROOT %lt.1 = pred[] compare(%j, %five), direction=LT
}

%known_body (e: (s32[], f32[4])) -> (s32[], f32[4]) {
  %rs = f32[2]{0} reduce-scatter(%y), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

%data_cond (f: (s32[], f32[4])) -> pred[] {
  %k = s32[] get-tuple-element(%f), index=0
  %m = s32[] get-tuple-element(%f), index=1
  ROOT %lt.2 = pred[] compare(%k, %m), direction=LT
}

%data_body (h: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a2a = f32[4]{0} all-to-all(%z), replica_groups=[2,4]<=[8], dimensions={0}
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %outer = (s32[], f32[4]{0}) while(%t0), condition=%outer_cond, body=%outer_body
  %known = (s32[], f32[4]{0}) while(%t1), condition=%data_cond, body=%known_body, backend_config={"known_induction_variable":{"tuple_index":"0"},"known_trip_count":{"n":"7"}}
  %data = (s32[], f32[4]{0}) while(%t2), condition=%data_cond, body=%data_body
  %once = f32[4]{0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add
}
'''


# XLA numbers every fifth element of a long tuple: `/*index=5*/`, an '='
# inside a shape. A combiner's all-reduce and a scan's carry both print so.
_LONG_TUPLES = '''HloModule m, replica_count=1, num_partitions=8

%body (carry: (s32[], f32[2], f32[2], f32[2], f32[2], f32[2])) -> (s32[], f32[2], f32[2], f32[2], f32[2], f32[2]) {
  %g = bf16[32,16]{1,0} all-gather(%w), replica_groups=[1,8]<=[8], dimensions={0}
}

ENTRY %main () -> f32[] {
  %loop = (s32[], f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %combined = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, /*index=5*/bf16[4]{0}) all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f), replica_groups=[1,8]<=[8], to_apply=%add
}
'''


class AsyncAndLoopTest(absltest.TestCase):

  def test_async_results_from_the_done(self):
    found = {c.name: c for c in collectives.parse_collectives(_ASYNC)}
    self.assertCountEqual(found, ['ar-start', 'cp-start', 'lone-start', 'rs'])
    # An all-reduce-start's tuple is its results (not operands, results):
    # both arrays; `replica_groups={}` is every device of the header.
    ar = found['ar-start']
    self.assertEqual((ar.kind, ar.dtype, ar.bytes, ar.group_size),
                     ('all-reduce', 'float32', 4 * 4 + 8 * 2, 8))
    cp = found['cp-start']
    self.assertEqual((cp.kind, cp.dtype, cp.bytes, cp.group_size),
                     ('collective-permute', 'float32', 2 * 3 * 4, 2))
    # No -done: the start's result half, its u32[] contexts left out.
    lone = found['lone-start']
    self.assertEqual((lone.dtype, lone.bytes), ('bfloat16', 4 * 2))
    # The async wrapper's computation, called once (not by its -done too).
    rs = found['rs']
    self.assertEqual((rs.kind, rs.bytes, rs.input_bytes, rs.group_size,
                      rs.calls), ('reduce-scatter', 8 * 4, 32 * 4, 4, 1))
    self.assertEqual(collectives.wire_bytes(cp), 2 * 3 * 4)

  def test_loop_bodies_count_their_trip_counts(self):
    found = {c.name: c for c in collectives.parse_collectives(_LOOPS)}
    self.assertEqual({n: (c.calls, c.exact) for n, c in found.items()},
                     {'g': (5, True), 'psum': (15, True), 'rs': (7, True),
                      'a2a': (1, False), 'once': (1, True)})
    rows = {r['kind']: r for r in collectives.summarize(found.values())}
    self.assertEqual((rows['all-gather']['count'],
                      rows['all-gather']['bytes']), (5, 5 * 32 * 16 * 2))
    self.assertAlmostEqual(rows['all-gather']['wire_bytes'],
                           5 * 0.75 * 32 * 16 * 2)
    self.assertEqual(rows['all-reduce']['count'], 16)
    self.assertEqual(rows['all-reduce']['bytes'], 16 * 4 * 4)
    self.assertEqual(rows['reduce-scatter']['bytes'], 7 * 2 * 4 * 4)
    self.assertFalse(rows['all-to-all']['exact'])
    self.assertTrue(rows['all-gather']['exact'])


  def test_long_tuples_are_read(self):
    found = {c.name: c for c in collectives.parse_collectives(_LONG_TUPLES)}
    self.assertEqual(found['g'].calls, 6)  # The loop's line was read.
    combined = found['combined']
    self.assertEqual((combined.dtype, combined.bytes, combined.group_size),
                     ('float32', 5 * 4 * 4 + 4 * 2, 8))


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
    result = partitioned_step.step_collectives(fn, w, g)
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

  def test_a_scan_gathers_once_per_layer(self):
    """FSDP over a scanned stack: one all-gather in the loop's body, run
    once per layer; the program as partitioned and the compiled one agree
    on the count (the first from the loop's condition, the second from
    XLA's trip count)."""
    mesh = jax.make_mesh((4, 2), ('batch', 'model'),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def local(ws, x):
      def layer(h, w):
        whole = jax.lax.all_gather(w.astype(jnp.bfloat16), 'batch',
                                   tiled=True)
        return h @ whole.astype(jnp.float32).T, None
      return jax.lax.scan(layer, x, ws)[0]

    fn = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P(None, 'batch'), P()), out_specs=P(),
        axis_names={'batch'}, check_vma=False))
    ws = jax.ShapeDtypeStruct((5, 16, 16), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, 'batch')))
    x = jax.ShapeDtypeStruct((2, 16), jnp.float32,
                             sharding=NamedSharding(mesh, P()))
    result = partitioned_step.step_collectives(fn, ws, x)
    self.assertEqual(result['source'], 'partitioned')
    gather, = result['collectives']
    self.assertEqual((gather['kind'], gather['dtype'], gather['count'],
                      gather['bytes'], gather['exact']),
                     ('all-gather', 'bfloat16', 5, 5 * 16 * 16 * 2, True))
    compiled, = result['compiled_collectives']
    self.assertEqual((compiled['count'], compiled['exact']), (5, True))


@helpers.long_running
class CommunicationStudyTest(absltest.TestCase):

  def test_a_bad_wire_is_one_line_before_anything_compiles(self):
    for wire, message in (('bf16/float32', "--wires (gather): unknown value "
                                           "'bf16'"),
                          ('compute', "--wires: 'compute' is not "
                                      'GATHER/REDUCE')):
      with self.assertRaises(errors.ConfigError) as raised:
        communication.run(settings_lib.parse(helpers.tiny_config()),
                          ['fsdp:8x1'], [wire],
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
    result = communication.run(settings_lib.parse(config), ['fsdp:8x1'],
                               communication.WIRES,
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
