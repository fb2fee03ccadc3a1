"""A reduce-scatter's and an all-gather's own bus bandwidth, where the profile timed them
(profiler.bench.collective_busbw_gbps): gloo runs both well below its all-reduce's bus bandwidth (2 CPU ranks,
32 MiB: reduce-scatter 0.41, all-gather 0.52, all-reduce 1.57 GB/s), so sharded stages are priced at what the
backend moves. A profile without the figures prices every collective at the all-reduce's, as before."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import capabilities_for
from tangram_launch.costmodel import communication as comm
from tangram_launch.costmodel.efficiency import GBPS, NET_EFFICIENCY, DeviceModel
from tangram_launch.costmodel.slice_plan import ParallelConfig
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpu, island

BASE = {"device": "cpu", "allreduce_busbw_gbps": 1.0, "allreduce_group_size": 2, "collective_latency_us": 300.0}
OPS = {"reduce_scatter_busbw_gbps": 0.25, "all_gather_busbw_gbps": 0.5}
MODEL = load_model("tiny")


def _stage(measured: dict, zero: int, *, b: int = 4, runtime: str = "torch"):
    c = coster(MODEL, island("cpu", per_node=2, measured=measured), b=b, gb=8, seq=64, dtype="fp32",
               caps=capabilities_for(runtime))
    return c.plan(ParallelConfig(tp=1, dp=2, zero_stage=zero, recompute="none", pp=1)).stages[0]


def _link(measured: dict, **kw) -> comm.GroupLink:
    dev = DeviceModel.from_gpu(gpu("cpu", measured=measured), "fp32")
    return comm.group_link(1, 2, stage_gpus=2, gpus_per_node=kw.get("per_node", 2), dev=dev,
                           inter_bandwidth_GBps=kw.get("inter"))


def test_the_figures_reach_the_device_model_and_each_collective_runs_at_its_own():
    dev = DeviceModel.from_gpu(gpu("cpu", measured={**BASE, **OPS}), "fp32")
    assert (dev.reduce_scatter_busbw, dev.all_gather_busbw) == (0.25 * GBPS, 0.5 * GBPS)
    assert {"reduce_scatter_busbw_gbps", "all_gather_busbw_gbps"} <= set(dev.sources)
    link = _link({**BASE, **OPS})
    assert link.busbw_of(comm.REDUCE_SCATTER) == 0.25 * GBPS and link.busbw_of(comm.ALL_GATHER) == 0.5 * GBPS
    assert link.busbw_of(comm.ALL_REDUCE) == link.busbw_of(comm.ALL_TO_ALL) == 1.0 * GBPS
    nbytes = 8e6  # the whole gathered buffer (nccl-tests): a 2-rank ring moves half of it
    assert comm.collective_s(comm.REDUCE_SCATTER, nbytes, 2, link) == pytest.approx(
        nbytes / 2 / (0.25 * GBPS) + link.call_s(comm.REDUCE_SCATTER, 2))
    plain = _link(BASE)  # not measured: the all-reduce's bus bandwidth, as before
    assert plain.busbw_of(comm.REDUCE_SCATTER) == plain.busbw_of(comm.ALL_GATHER) == 1.0 * GBPS


def test_across_nodes_a_collective_runs_at_the_slower_of_its_own_rate_and_the_network():
    slow_net = _link({**BASE, **OPS}, per_node=1, inter=0.1)  # 0.1 GB/s x NET_EFFICIENCY: below every figure
    net = 0.1 * GBPS * NET_EFFICIENCY
    assert slow_net.inter_node and slow_net.busbw_of(comm.REDUCE_SCATTER) == slow_net.busbw == pytest.approx(net)
    fast_net = _link({**BASE, **OPS}, per_node=1, inter=100.0)
    assert fast_net.busbw_of(comm.REDUCE_SCATTER) == 0.25 * GBPS and fast_net.busbw_of(comm.ALL_GATHER) == 0.5 * GBPS
    assert _link(BASE, per_node=1, inter=100.0).busbw_of(comm.ALL_GATHER) == 1.0 * GBPS


def test_a_sharded_stage_pays_its_gathers_and_reduce_scatters_at_the_measured_rates():
    """ZeRO-3 (the torch runtime's FSDP2, resharding after forward) gathers in every forward and backward and
    reduce-scatters in every backward; ZeRO-1 does both once per step, in the sync; ZeRO-0's all-reduce is
    unchanged. Figures equal to the all-reduce's change nothing."""
    for zero, part in ((3, "backward_s"), (3, "forward_s"), (1, "dp_sync_s")):
        assert getattr(_stage({**BASE, **OPS}, zero), part) > getattr(_stage(BASE, zero), part)
    assert _stage({**BASE, **OPS}, 0) == _stage(BASE, 0)
    same = {"reduce_scatter_busbw_gbps": 1.0, "all_gather_busbw_gbps": 1.0}
    for zero in (1, 3):
        assert _stage({**BASE, **same}, zero) == _stage(BASE, zero)


@settings(max_examples=25, deadline=None)
@given(rs=st.floats(0.05, 5.0), ag=st.floats(0.05, 5.0), zero=st.sampled_from([1, 3]))
def test_a_slower_measured_collective_never_makes_a_stage_cheaper(rs, ag, zero):
    fast = _stage({**BASE, "reduce_scatter_busbw_gbps": 2 * rs, "all_gather_busbw_gbps": 2 * ag}, zero)
    slow = _stage({**BASE, "reduce_scatter_busbw_gbps": rs, "all_gather_busbw_gbps": ag}, zero)
    for part in ("forward_s", "backward_s", "dp_sync_s"):
        assert getattr(slow, part) >= getattr(fast, part)
    assert slow.forward_s + slow.backward_s + slow.dp_sync_s > fast.forward_s + fast.backward_s + fast.dp_sync_s
