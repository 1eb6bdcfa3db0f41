"""A step's communication and compute as time on paper: the bytes its
collectives send (`collectives.summarize`'s rows) over a named link,
against its FLOPs at a GPU's peak.

It is planning on paper, under these assumptions:
- no overlap of communication with compute: the sum is an upper bound, and
  the larger of the two a lower bound;
- ring (bandwidth-optimal) algorithms: each device sends (g-1)/g of an
  all-gather's output or a reduce-scatter's input, twice that for an
  all-reduce (`collectives.wire_bytes`);
- the link's nominal bandwidth per device, achieved, plus a fixed latency
  per collective;
- the per-device bytes and FLOPs of the partitioned program, for the mesh it
  was compiled for (`partitioned_step`).
"""

from typing import Any, Sequence

# Links, per device, nominal (NVIDIA's and InfiniBand's figures).
LINKS = {
    'nvlink_8gpu': dict(
        devices=8, bandwidth=450e9, latency=5e-6,
        about='8 H100/H200 in one node, NVLink 4 through NVSwitch: 450 GB/s '
              'per GPU each way'),
    'ib_2node': dict(
        devices=16, bandwidth=50e9, latency=10e-6,
        about='2 nodes of 8 GPUs, NDR InfiniBand 400 Gb/s (50 GB/s) per GPU, '
              'one NIC each; a ring over the nodes runs at the inter-node '
              'link'),
    'ib_16node': dict(
        devices=128, bandwidth=50e9, latency=20e-6,
        about='16 nodes of 8 GPUs, NDR InfiniBand 50 GB/s per GPU; a longer '
              'ring, a larger latency per collective'),
}
# Dense peaks per GPU (NVIDIA's H100 SXM and H200 datasheets, the same
# figures for both; without sparsity).
PEAKS = {
    'h100_bf16': dict(flops=989e12, about='H100/H200 SXM, bfloat16 dense'),
    'h100_fp8': dict(flops=1979e12, about='H100/H200 SXM, fp8 dense'),
    'h100_fp32': dict(flops=67e12, about='H100/H200 SXM, float32 (no tensor '
                                         'cores)'),
}


def paper_time(rows: Sequence[dict[str, Any]], flops: float, link: str,
               peak: str) -> dict[str, Any]:
  """Seconds a step's collectives (`collectives.summarize` rows) take on
  `link`, and its `flops` per device at `peak`: which of the two bounds the
  step (no overlap assumed), with the latencies and on bandwidth alone. The
  rows' groups over the data axis are taken to span the link's devices,
  each device keeping its batch (weak scaling): a ring's (g-1)/g share is
  recomputed for them; other groups are kept. `exact` is False where a row
  is a lower bound (a loop of unknown trip count)."""
  spec, compute_peak = LINKS[link], PEAKS[peak]['flops']
  devices = spec['devices']
  sent = 0.0
  for row in rows:
    g = row['group_size']
    share = 1.0
    if g == max(r['group_size'] for r in rows) and g > 1:
      share = ((devices - 1) / devices) / ((g - 1) / g)
    sent += row['wire_bytes'] * share
  count = sum(r['count'] for r in rows if r['group_size'] > 1)
  bandwidth = sent / spec['bandwidth']
  # One latency per collective as the program has them: an upper bound
  # where a backend's combiners merge them later.
  latency = count * spec['latency']
  comm = bandwidth + latency
  compute = flops / compute_peak
  return dict(comm_seconds=comm, bandwidth_seconds=bandwidth,
              latency_seconds=latency, collectives=count,
              compute_seconds=compute,
              bound='communication' if comm > compute else 'compute',
              bandwidth_bound=('communication' if bandwidth > compute
                               else 'compute'),
              comm_over_compute=comm / compute if compute else None,
              exact=all(r.get('exact', True) for r in rows))
