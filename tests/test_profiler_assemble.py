"""Profiler pieces without launching: benchmark helpers, the round-robin schedule, assembling gathered records
into a ClusterSpec (GPU records use inventories replayed from recorded NVML answers), the fingerprint, the
summary table, and the profile command's torchrun argv and failure report."""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from profiler import bench
from profiler.assemble import (
    DeviceRecord,
    LikeGroup,
    LinkRecord,
    NodeRecord,
    ProfileRecord,
    assemble_cluster,
    fingerprint,
    format_summary,
    hardware_identity,
    name_nodes,
)
from helpers_timing import layer_times_in_order
from profiler.inventory import read_memory_total_bytes, read_node_inventory
from profiler.layer import LayerShape, active_ffn_width, layer_kinds, time_layer
from profiler.worker import like_classes
from tangram_launch.commands import profile as profile_cmd
from tangram_launch.costmodel.efficiency import intra_link
from tangram_launch.islands import build_islands
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import load_model
from test_profiler_inventory import fake


# --------------------------------------------------------------------------------------------- bench helpers

def test_round_robin_meets_every_pair_once_one_peer_per_round():
    for n in range(0, 9):
        players = list(range(n))
        rounds = bench.round_robin(players)
        if n < 2:
            assert rounds == []
            continue
        assert len(rounds) == (n - 1 if n % 2 == 0 else n)
        seen = [p for rnd in rounds for p in rnd]
        assert sorted(seen) == sorted(itertools.combinations(players, 2))  # each pair once, (low, high)
        for rnd in rounds:
            flat = [x for p in rnd for x in p]
            assert len(flat) == len(set(flat))  # nobody talks to two peers at once
            assert len(rnd) == n // 2


def test_busbw_factor_follows_nccl_tests():
    assert bench.busbw_factor(bench.ALL_REDUCE, 1) == 0.0
    assert bench.busbw_factor(bench.ALL_REDUCE, 2) == 1.0
    assert bench.busbw_factor(bench.ALL_REDUCE, 8) == pytest.approx(1.75)
    assert bench.busbw_factor(bench.REDUCE_SCATTER, 8) == bench.busbw_factor(bench.ALL_GATHER, 8) == 0.875
    with pytest.raises(ValueError):
        bench.busbw_factor(bench.ALL_REDUCE, 0)


def test_timing_median_and_spread():
    t = bench.Timing((0.2, 0.1, 0.4))
    assert t.median_s == 0.2 and t.min_s == 0.1 and t.max_s == 0.4
    assert t.spread == pytest.approx(1.5)
    assert t.to_dict()["reps"] == 3
    with pytest.raises(ValueError):
        bench.Timing(())
    with pytest.raises(ValueError):
        bench.Timing((0.1, 0.0))


def test_calibration_and_repetitions():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.01)

    inner = bench.calibrate_inner(fn, min_rep_s=0.05)
    assert 3 <= inner <= 6
    t = bench.time_repeated(fn, warmup=1, reps=3, inner=2)
    assert len(t.samples_s) == 3 and 0.009 < t.median_s < 0.05
    assert len(calls) == 2 + 2 + 6
    # CPU devices calibrate on CPU time: sleeping costs none, so the repetition count hits the cap
    assert bench.calibrate_inner(fn, min_rep_s=0.05, clock=time.process_time, max_inner=7) == 7


def _call_and_collective(events: list[str]):
    """A 2 ms call and a 25 ms collective that log themselves into ``events``."""
    def fn():
        events.append("f")
        time.sleep(0.002)

    def between():
        events.append("c")
        time.sleep(0.025)  # not part of the figure

    return fn, between


def test_interleaved_timing_runs_the_collective_after_every_call_untimed():
    events = []
    fn, between = _call_and_collective(events)
    t = bench.time_interleaved(fn, between, warmup=1, blocks=3, calls=4)
    assert events == ["f", "c"] * (1 + 3 * 4)  # fixed counts: every member of the group issues the same calls
    assert len(t.samples_s) == 3 and 0.0019 < t.median_s < 0.02  # the 25 ms between calls are not in it


def test_block_timing_runs_the_collective_after_each_block_untimed():
    events = []
    fn, between = _call_and_collective(events)
    t = bench.time_blocks(fn, between, blocks=3, calls=4)
    assert events == (["f"] * 4 + ["c"]) * 3  # one collective per block: every member issues the same count
    assert len(t.samples_s) == 3 and 0.0019 < t.median_s < 0.02  # per call; the 25 ms after each block not in it


def test_back_to_back_layer_timing_issues_the_agreed_number_of_collectives():
    """Every member of the node issues the same collectives: one after the warm-up block and one per agreed block
    (one pass: the forward is timed inside forward+backward), whatever its own speed; the detail says how it was
    timed."""
    tiny, calls = load_model("tiny"), []
    out = time_layer(tiny, "dense", LayerShape(micro_batch=2, seq_len=16, dtype="fp32"), torch.device("cpu"),
                     warmup=1, reps=5, min_rep_s=0.0, between=lambda: calls.append(1), budget_s=10.0,
                     agree=lambda n: min(n, 2), block_cpu_s=0.005)
    assert len(calls) == 1 + 2
    for name in ("forward", "forward_backward"):
        assert len(out[name].timing.samples_s) == 2
        assert "back-to-back calls" in dict(out[name].detail)["timed"]
    forward, both = out["forward"].timing.samples_s, out["forward_backward"].timing.samples_s
    assert all(0 < f < fb for f, fb in zip(forward, both))  # each block's forward is part of its forward+backward


def test_split_block_timing_times_the_forward_inside_each_call():
    """``time_blocks_split``: each call runs its forward then the backward of what it returned, the collective
    after each block; the forward's seconds are those of the forwards inside the calls, on a fake clock exactly."""
    events, now = [], [0.0]

    def forward():
        events.append("f")
        now[0] += 0.002
        return len(events)

    def backward(out):
        events.append(("b", out))
        now[0] += 0.005

    fb, f = bench.time_blocks_split(forward, backward, lambda: events.append("c"), blocks=2, calls=3,
                                    clock=lambda: now[0])
    assert events[:7] == ["f", ("b", 1), "f", ("b", 3), "f", ("b", 5), "c"] and events.count("c") == 2
    assert fb.samples_s == pytest.approx((0.007, 0.007)) and f.samples_s == pytest.approx((0.002, 0.002))


def test_gemm_and_copy_on_cpu():
    cfg = bench.BenchConfig("cpu", True, gemm_shape=(64, 32, 48), gemm_dtypes=("fp32",), copy_bytes=2**20,
                            allreduce_bytes=2**20, p2p_bytes=2**20, warmup=1, reps=3, comm_reps=3,
                            latency_reps=3, min_rep_s=0.005)
    dev = torch.device("cpu")
    g = bench.gemm_tflops(dev, "fp32", cfg)
    assert g.value > 0 and g.unit == "TFLOP/s"
    assert g.value == pytest.approx(2 * 64 * 32 * 48 / g.timing.median_s / 1e12)
    assert dict(g.detail)["shape_mkn"] == [64, 32, 48]
    c = bench.copy_bandwidth_gbps(dev, cfg)
    assert c.value == pytest.approx(2 * 2**20 / c.timing.median_s / 1e9)
    assert bench.dtype_supported(dev, "fp32")
    with pytest.raises(ValueError):
        bench.BenchConfig("tpu", True, (1, 1, 1), ("fp32",), 1, 1, 1, 0, 1, 1, 1, 0.1)
    assert bench.BenchConfig.for_device("cuda", quick=True).gemm_dtypes == ("bf16", "fp16", "fp32")


def test_optimizer_cost_per_parameter_tensor_on_cpu():
    cfg = bench.BenchConfig("cpu", True, gemm_shape=(8, 8, 8), gemm_dtypes=("fp32",), copy_bytes=2**20,
                            allreduce_bytes=2**20, p2p_bytes=2**20, warmup=1, reps=3, comm_reps=3,
                            latency_reps=3, min_rep_s=0.005)
    m = bench.optimizer_tensor_us(torch.device("cpu"), cfg, tensors=32, numel=16)
    detail = dict(m.detail)
    assert detail["tensors"] == 32 and m.unit == "us"
    assert m.value == pytest.approx(m.timing.median_s / 32 * 1e6)  # one step over 32 tensors, per tensor
    assert 0.1 < m.value < 5000  # a dozen small kernels per tensor: microseconds, not nothing, not a second
    with pytest.raises(ValueError):
        dataclasses.replace(cfg, wait_reps=0)
    per_param = bench.optimizer_param_ns(torch.device("cpu"), cfg, m.value, tensors=4, numel=4096)
    assert per_param.unit == "ns" and dict(per_param.detail)["tensor_us"] == m.value
    # the step over 4 x 4096 parameters, less 4 tensors' fixed cost, per parameter
    want = max(0.0, per_param.timing.median_s - 4 * m.value * 1e-6) / (4 * 4096) * 1e9
    assert per_param.value == pytest.approx(want)
    assert 0.0 <= per_param.value < 1e4


def test_model_layer_times_dense_and_moe():
    tiny = load_model("tiny-moe")
    assert layer_kinds(tiny) == ["dense", "moe"]
    assert active_ffn_width(tiny, "moe") == tiny.top_k * tiny.expert_ffn_hidden_size
    for kind in ("dense", "moe"):
        out = layer_times_in_order(lambda: time_layer(tiny, kind, LayerShape(micro_batch=2, seq_len=16, dtype="fp32"),
                                                      torch.device("cpu"), warmup=1, reps=3, min_rep_s=0.002))
        assert dict(out["forward"].detail)["layer_kind"] == kind
    with pytest.raises(ValueError):
        LayerShape(micro_batch=0, seq_len=1, dtype="fp32")


# --------------------------------------------------------------------------------------------- assembly

def _m(value: float, unit: str = "GB/s") -> bench.Measured:
    return bench.Measured(value, unit, bench.Timing((1.0, 1.02, 0.98)))


def test_host_time_per_operator_on_cpu():
    """The reference layer's forward and backward at one token, over the operators it dispatches: the layer's own
    (the cost model's count) and the loss's sum and its gradient."""
    from profiler.host_ops import host_op_us, reference_layer_model
    from tangram_launch.costmodel.host_floor import layer_host_ops

    cfg = bench.BenchConfig("cpu", True, gemm_shape=(8, 8, 8), gemm_dtypes=("fp32",), copy_bytes=2**20,
                            allreduce_bytes=2**20, p2p_bytes=2**20, warmup=1, reps=3, comm_reps=3,
                            latency_reps=3, min_rep_s=0.005, budget_s=0.2)
    m = host_op_us(torch.device("cpu"), cfg)
    ops = dict(m.detail)["ops"]
    assert 0 < ops - sum(layer_host_ops(reference_layer_model(), 0)) <= 4
    assert m.unit == "us" and m.value == pytest.approx(m.timing.median_s / ops * 1e6)
    assert 0.1 < m.value < 1000  # microseconds an operator: not nothing, not a millisecond


def _cpu_record(speeds: list[float], hosts: list[str] | None = None) -> ProfileRecord:
    """One CPU node of len(speeds) devices (or one device per host when hosts are given)."""
    hosts = hosts or ["box"]
    per_node = len(speeds) // len(hosts)
    devices, nodes = [], []
    for n, host in enumerate(hosts):
        inv = read_node_inventory(fake.FakeNvml(None), infiniband_root="/nonexistent", host=host)
        ranks = tuple(range(n * per_node, (n + 1) * per_node))
        for local, rank in enumerate(ranks):
            devices.append(DeviceRecord(rank=rank, local_rank=local, node_rank=n, host=host, device="cpu",
                                        gemm={"fp32": _m(speeds[rank] / 4, "TFLOP/s"),
                                              "bf16": _m(speeds[rank], "TFLOP/s")},
                                        memory_bandwidth=_m(10.0), optimizer_tensor=_m(40.0 + rank, "us"),
                                        optimizer_param=_m(3.0 - rank, "ns"), host_op=_m(5.0 + rank, "us"),
                                        wake_up=dataclasses.replace(_m(900.0 + 100 * rank, "us"),
                                                                    detail=(("waited_s", 0.03 + 0.01 * rank),))))
        p2p = tuple((a, b, _m(2.0)) for a, b in itertools.combinations(range(per_node), 2))
        nodes.append(NodeRecord(node_rank=n, host=host, inventory=inv, ranks=ranks,
                                allreduce=_m(1.5) if per_node > 1 else None, p2p=p2p,
                                collective_latency=_m(240.0, "us") if per_node > 1 else None,
                                collective_wait=_m(1500.0, "us") if per_node > 1 else None))
    links = tuple(LinkRecord(a, b, bench.Timing((1e-4, 1.1e-4)), (_m(3.0),), r)
                  for r, (a, b) in enumerate(itertools.combinations(range(len(hosts)), 2)))
    return ProfileRecord(devices=tuple(devices), nodes=tuple(nodes), links=links, backend="gloo", quick=True,
                         bench={"reps": 3}, started_at="2026-01-01T00:00:00+00:00",
                         finished_at="2026-01-01T00:00:09+00:00", wall_s=9.0, torch_version="2.13.0",
                         schedule=tuple(((a, b),) for a, b in itertools.combinations(range(len(hosts)), 2)))


def test_cpu_devices_carry_measured_figures():
    spec_dict = assemble_cluster(_cpu_record([0.4, 0.41]))
    spec = ClusterSpec.from_dict(spec_dict)
    assert "network" not in spec_dict  # one node: no links to describe
    a, b = spec.nodes[0].gpus
    assert a.type == "cpu" and a.tflops == {"bf16": 0.4, "fp16": None, "fp32": 0.1, "tf32": 0.1, "fp8": None}
    assert a.memory_bandwidth_GBps == 10.0 and a.intra_node_bandwidth_GBps == 3.0  # 2 x busbw 1.5
    assert a.measured["catalog"]["tflops"]["fp32"] == 1.0
    assert a.measured["p2p_gbps"] == [None, 2.0] and b.measured["p2p_gbps"] == [2.0, None]
    assert a.measured["collective_latency_us"] == 240.0  # a tiny all-to-all over the node's 2 ranks
    assert a.measured["collective_wait_us"] == b.measured["collective_wait_us"] == 1500.0  # ... after a layer
    assert a.measured["optimizer_tensor_us"] == 40.0 and b.measured["optimizer_tensor_us"] == 41.0  # per device
    assert spec.profile["nodes"]["box"]["collective_wait"]["value"] == 1500.0
    assert spec.profile["devices"][1]["optimizer_tensor"]["value"] == 41.0
    assert a.measured["optimizer_param_ns"] == 3.0 and b.measured["optimizer_param_ns"] == 2.0
    assert build_islands(spec).islands[0].gpu.measured["optimizer_param_ns"] == 3.0  # a duration: the slowest
    assert a.measured["host_op_us"] == 5.0 and b.measured["host_op_us"] == 6.0  # per device
    assert spec.profile["devices"][1]["host_op"]["value"] == 6.0
    assert build_islands(spec).islands[0].gpu.measured["host_op_us"] == 6.0  # the slowest host
    assert a.measured["wake_up_us"] == 900.0 and b.measured["wake_up_us"] == 1000.0  # per device
    assert spec.profile["devices"][1]["wake_up"]["value"] == 1000.0
    assert build_islands(spec).islands[0].gpu.measured["wake_up_us"] == 1000.0  # the slowest wake-up
    assert a.measured["wake_up_wait_us"] == 30000.0 and b.measured["wake_up_wait_us"] == 40000.0  # after waits
    assert len(build_islands(spec).islands) == 1  # within tolerance: one island
    # the node's MemTotal, which offloaded optimizer state must fit in (costmodel/host_memory.py)
    total_gib = spec.profile["nodes"]["box"]["inventory"]["memory_total_gib"]
    assert spec.nodes[0].host_memory_gib == pytest.approx(total_gib, rel=1e-3)
    assert spec.nodes[0].host_memory_gib * 2**30 <= read_memory_total_bytes()  # never more than the node has
    slow = ClusterSpec.from_dict(assemble_cluster(_cpu_record([0.4, 0.1])))
    iset = build_islands(slow)
    assert len(iset.islands) == 2 and iset.separations[0].constraint == "(1) compute"


def test_like_ranks_carry_their_own_small_collective_figures():
    """A node of two fast CPU devices and a throttled one: over the whole node every small collective waits for
    the throttled one (240 / 1500 us); the fast pair measured again among themselves (90 / 300 us, FSDP2 too), and
    their island, which the throttled device is not in, keeps those. The throttled device keeps the node's."""
    fsdp = ({"fp32": _m(700.0, "us")}, {"fp32": _m(1900.0, "us")}, _m(150.0, "us"))
    pair = LikeGroup((0, 1), collective_latency=_m(90.0, "us"), collective_wait=_m(300.0, "us"), fsdp_unit=fsdp)
    record = _cpu_record([0.4, 0.41, 0.1])
    record = dataclasses.replace(record, devices=tuple(dataclasses.replace(d, like_group=pair) if d.rank < 2 else d
                                                       for d in record.devices))
    spec = ClusterSpec.from_dict(assemble_cluster(record))
    a, b, slow = spec.nodes[0].gpus
    for fast in (a, b):
        assert fast.measured["collective_latency_us"] == 90.0 and fast.measured["collective_wait_us"] == 300.0
        assert fast.measured["collective_group_size"] == 2  # measured over the pair: one ring step
        assert intra_link(fast)[1] == pytest.approx(90e-6)
        assert fast.measured["fsdp_unit_forward_us"] == {"fp32": 700.0}
        assert fast.measured["optimizer_sharded_tensor_us"] == 150.0
    assert slow.measured["collective_latency_us"] == 240.0 and slow.measured["collective_wait_us"] == 1500.0
    assert slow.measured["collective_group_size"] == 3 and intra_link(slow)[1] == pytest.approx(120e-6)
    assert "fsdp_unit_forward_us" not in slow.measured  # the node measured no FSDP2 here
    assert spec.profile["devices"][0]["like_group"]["ranks"] == [0, 1]
    assert spec.profile["devices"][0]["like_group"]["collective_wait"]["value"] == 300.0
    assert "like_group" not in spec.profile["devices"][2]
    assert spec.profile["nodes"]["box"]["collective_wait"]["value"] == 1500.0  # the node's figure stays on record
    fast_island = next(i for i in build_islands(spec).islands if len(i.gpus) == 2)
    assert fast_island.gpu.measured["collective_wait_us"] == 300.0


def test_like_classes_first_fit_in_rank_order():
    assert like_classes([1.0, 1.1, 0.33], 0.15) == [[0, 1], [2]]
    assert like_classes([1.0, 3.0, 1.05, 3.1], 0.15) == [[0, 2], [1, 3]]
    assert like_classes([2.0, 2.0, 2.0], 0.0) == [[0, 1, 2]]
    assert like_classes([], 0.15) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.01, max_value=1000.0), max_size=12), st.floats(min_value=0.0, max_value=1.0))
def test_like_classes_partition_ranks_into_classes_within_tolerance(speeds, tolerance):
    classes = like_classes(speeds, tolerance)
    assert sorted(i for c in classes for i in c) == list(range(len(speeds)))  # every rank in exactly one class
    for c in classes:
        assert c == sorted(c)
        values = [speeds[i] for i in c]
        assert max(values) <= (1 + tolerance) * min(values)
    # first fit: a rank opens a new class only where it fits none of the classes before it (their members so far)
    for k, c in enumerate(classes):
        for j in range(k):
            earlier = [speeds[i] for i in classes[j] if i < c[0]] + [speeds[c[0]]]
            assert max(earlier) > (1 + tolerance) * min(earlier)
    if speeds and max(speeds) <= (1 + tolerance) * min(speeds):
        assert len(classes) == 1


def test_gpu_nodes_from_recorded_nvml():
    """An H100 NVLink node and an L4 PCIe node; torch sees the H100s in reverse NVML order."""
    h100 = read_node_inventory(fake.FakeNvml.from_file("h100-sxm-8.json"), infiniband_root="/x", host="hgx-01")
    l4 = read_node_inventory(fake.FakeNvml.from_file("l4-pcie-4.json"), infiniband_root="/x", host="l4-box")
    devices = []
    for i in range(8):
        g = h100.gpus[7 - i]
        devices.append(DeviceRecord(rank=i, local_rank=i, node_rank=0, host="hgx-01", device=f"cuda:{i}",
                                    torch_uuid=g.uuid[4:], torch_name=g.name, total_memory_bytes=g.memory_total_bytes,
                                    gemm={"bf16": _m(650.0 + i, "TFLOP/s"), "fp32": _m(50.0, "TFLOP/s")},
                                    memory_bandwidth=_m(2900.0)))
    for i in range(4):
        g = l4.gpus[i]
        devices.append(DeviceRecord(rank=8 + i, local_rank=i, node_rank=1, host="l4-box", device=f"cuda:{i}",
                                    torch_uuid=g.uuid, torch_name=g.name, gemm={"bf16": _m(90.0, "TFLOP/s")},
                                    memory_bandwidth=_m(250.0)))
    record = ProfileRecord(
        devices=tuple(devices),
        nodes=(NodeRecord(0, "hgx-01", h100, tuple(range(8)), allreduce=_m(360.0), reduce_scatter=_m(330.0),
                          all_gather=_m(340.0)),
               NodeRecord(1, "l4-box", l4, tuple(range(8, 12)), allreduce=_m(18.0))),
        links=(LinkRecord(0, 1, bench.Timing((8e-6, 9e-6)), tuple(_m(11.0) for _ in range(4))),),
        backend="nccl", quick=False, bench={}, started_at="t0", finished_at="t1", wall_s=40.0,
        schedule=(((0, 1),),))
    spec_dict = assemble_cluster(record, name="lab")
    spec = ClusterSpec.from_dict(spec_dict)
    assert spec.name == "lab" and spec.node_names == ("hgx-01", "l4-box")
    hgx, box = spec.nodes
    assert {g.type for g in hgx.gpus} == {"h100-sxm"} and {g.type for g in box.gpus} == {"l4"}
    g0 = hgx.gpus[0]
    assert g0.uuid == h100.gpus[7].uuid and g0.measured["nvml"]["index"] == 7  # matched by UUID
    assert g0.measured["nvml"]["nvlink_active_links"] == 18 and box.gpus[0].measured["nvml"]["nvlink_active_links"] == 0
    assert g0.tflops["bf16"] == 989  # catalog peak kept; the measurement beside it
    assert g0.measured["gemm_tflops"]["bf16"] == 650.0 and g0.measured["allreduce_busbw_gbps"] == 360.0
    # each collective's own bus bandwidth where the node timed it; a node that did not has none
    assert (g0.measured["reduce_scatter_busbw_gbps"], g0.measured["all_gather_busbw_gbps"]) == (330.0, 340.0)
    assert not {"reduce_scatter_busbw_gbps", "all_gather_busbw_gbps"} & set(box.gpus[0].measured)
    assert spec_dict["profile"]["nodes"]["hgx-01"]["reduce_scatter"]["value"] == 330.0
    assert spec_dict["profile"]["nodes"]["l4-box"]["all_gather"] is None
    link = spec.link("hgx-01", "l4-box")
    assert link.bandwidth_GBps == 44.0 and link.latency_us == 4.25  # 4 rank pairs summed; half the median RTT
    assert spec_dict["profile"]["inter_node"]["schedule"] == [[["hgx-01", "l4-box"]]]
    inv = spec_dict["profile"]["nodes"]["hgx-01"]["inventory"]
    assert inv["gpus"][0]["nvlinks"]["active"] == 18 and len(inv["pairs"]) == 28
    names = [i.gpu.type for i in build_islands(spec).islands]
    assert names == ["h100-sxm", "l4"]
    text = format_summary(spec)
    assert "8x h100-sxm" in text and "4x l4" in text and "650-657" in text
    assert "node-to-node bandwidth GB/s (latency us):" in text and "44 (4.25)" in text


def test_unknown_gpu_is_custom_with_measured_figures():
    inv = read_node_inventory(fake.FakeNvml(None), infiniband_root="/x", host="lab")
    devs = tuple(DeviceRecord(rank=i, local_rank=i, node_rank=0, host="lab", device=f"cuda:{i}",
                              torch_uuid=f"uuid-{i}", torch_name="Contoso Accelerator X", total_memory_bytes=48 * 2**30,
                              gemm={"bf16": _m(200.0, "TFLOP/s"), "fp16": _m(210.0, "TFLOP/s")},
                              memory_bandwidth=_m(1200.0)) for i in range(2))
    record = ProfileRecord(devices=devs, nodes=(NodeRecord(0, "lab", inv, (0, 1), allreduce=_m(20.0)),), links=(),
                           backend="nccl", quick=True, bench={}, started_at="t", finished_at="t", wall_s=1.0)
    spec = ClusterSpec.from_dict(assemble_cluster(record))
    g = spec.nodes[0].gpus[0]
    assert g.type == "custom" and g.uuid == "uuid-0"
    assert g.tflops == {"bf16": 200.0, "fp16": 210.0, "fp32": None}
    assert g.memory_gib == 48.0 and g.memory_bandwidth_GBps == 1200.0 and g.intra_node_bandwidth_GBps == 40.0
    assert g.measured["name"] == "Contoso Accelerator X"


def test_two_agents_on_one_host_are_named_apart():
    assert name_nodes(["a", "b"]) == ["a", "b"]
    assert name_nodes(["a", "b", "a"]) == ["a-0", "b", "a-1"]
    assert len(set(name_nodes(["a", "a", "a-0"]))) == 3
    spec = ClusterSpec.from_dict(assemble_cluster(_cpu_record([0.4, 0.4], hosts=["box", "box"])))
    assert spec.node_names == ("box-0", "box-1")
    assert spec.link("box-0", "box-1").bandwidth_GBps == 3.0
    assert spec.default_link.bandwidth_GBps == 3.0


def test_missing_inter_node_link_is_an_error():
    record = _cpu_record([0.4, 0.4, 0.4], hosts=["a", "b", "c"])
    broken = ProfileRecord(**{**record.__dict__, "links": record.links[:2]})
    with pytest.raises(ValueError, match="not measured"):
        assemble_cluster(broken)


def test_fingerprint_covers_hardware_not_measurements():
    a = _cpu_record([0.4, 0.41])
    b = _cpu_record([0.1, 0.9])
    assert fingerprint(hardware_identity(a)) == fingerprint(hardware_identity(b))
    assert assemble_cluster(a)["fingerprint"] == assemble_cluster(b)["fingerprint"]
    c = _cpu_record([0.4, 0.4, 0.4])
    assert fingerprint(hardware_identity(a)) != fingerprint(hardware_identity(c))
    d = _cpu_record([0.4, 0.41], hosts=["other"])
    assert fingerprint(hardware_identity(a)) != fingerprint(hardware_identity(d))


@pytest.mark.parametrize("name", ["profiled-h200", "profiled-cpu-2"])
def test_profiled_examples_load(cluster_path, name):
    """Files the profiler wrote (an H200 of the device machine, this CPU machine) load and form islands."""
    spec = ClusterSpec.load(cluster_path(name))
    assert spec.fingerprint.startswith("sha256:") and spec.profile["tool"] == "tangram-launch profile"
    for _, g in spec.iter_gpus():
        assert g.measured["gemm_tflops"]
    assert build_islands(spec).islands
    assert spec.node_names[0] in format_summary(spec)


# --------------------------------------------------------------------------------------------- the command

def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    return parser.parse_args(argv)


def test_torchrun_argv_round_trips_through_torchs_parser(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    args = _parse(["--nnodes", "2", "--nproc_per_node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   "head:29500", "--rdzv-conf", "join_timeout=5", "-o", "c.yaml", "--quick", "--model", "tiny"])
    argv = profile_cmd.torchrun_argv(args)
    assert argv == ["--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    "head:29500", "--rdzv-conf", "join_timeout=5"]
    assert args.output == "c.yaml" and args.quick and args.model == "tiny"
    from torch.distributed.run import get_args_parser

    back = get_args_parser().parse_args(argv + ["x.py"])
    assert (back.nnodes, back.nproc_per_node, back.rdzv_endpoint) == ("2", "4", "head:29500")
    standalone = profile_cmd.torchrun_argv(_parse(["--standalone", "--nproc-per-node", "2"]))
    assert standalone == ["--nproc-per-node", "2", "--standalone"]


def test_bad_options_are_spec_errors(tmp_path):
    from tangram_launch.errors import SpecError

    with pytest.raises(SpecError, match="--micro-batch"):
        profile_cmd.run(_parse(["--micro-batch", "0", "-o", str(tmp_path / "c.yaml")]))
    with pytest.raises(SpecError, match="model"):
        profile_cmd.run(_parse(["--model", "no-such-model", "-o", str(tmp_path / "c.yaml")]))
    with pytest.raises(SpecError, match="--output"):
        profile_cmd.run(_parse(["-o", str(tmp_path / "missing" / "c.yaml")]))


def test_failure_message_names_node_rank_and_phase(tmp_path):
    def status(local, **kw):
        d = {"rank": 4 + local, "local_rank": local, "node_rank": 1, "host": "box", "node": "box-1", **kw}
        (tmp_path / f"rank-{local}.json").write_text(json.dumps(d))

    status(0, phase="intra-node all-reduce", state="failed", error="RuntimeError: Connection reset by peer")
    status(1, phase="GEMM fp32/bf16", state="running")
    msg = profile_cmd.failure_message(str(tmp_path), 1, None)
    lines = msg.splitlines()
    assert lines[0].startswith("profiling failed on node 'box-1' (host box, node rank 1)")
    assert "local rank 1 (global rank 5) stopped during 'GEMM fp32/bf16'" in lines[1]  # the root cause first
    assert "local rank 0 (global rank 4) failed during 'intra-node all-reduce': RuntimeError" in lines[2]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "before any worker started" in profile_cmd.failure_message(str(empty), 1, None)
    assert profile_cmd.failure_message(str(empty), 1, "rendezvous of 2 node(s)") == "rendezvous of 2 node(s)"


def test_gemm_grows_from_a_quarter_of_its_shape_and_a_hopeless_dtype_stops_at_the_first():
    assert bench.gemm_sizes((1024, 1024, 1024)) == [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024)]
    assert bench.gemm_sizes((2, 1, 3)) == [(1, 1, 1), (2, 1, 3)]  # halved to at least 1, no size twice
    cfg = bench.BenchConfig("cpu", True, gemm_shape=(64, 32, 48), gemm_dtypes=("fp32",), copy_bytes=2**20,
                            allreduce_bytes=2**20, p2p_bytes=2**20, warmup=1, reps=3, comm_reps=3,
                            latency_reps=3, min_rep_s=0.005, budget_s=0.5)
    # a "fastest dtype" no CPU reaches: this one is hopeless next to it, timed at the first size only, and says so
    g = bench.gemm_tflops(torch.device("cpu"), "fp32", cfg, best_tflops=1e6)
    detail = dict(g.detail)
    assert detail["shape_mkn"] == [16, 8, 12] and "slower than the fastest dtype" in detail["stopped"]
    assert g.value == pytest.approx(2 * 16 * 8 * 12 / g.timing.median_s / 1e12)
    assert 1 <= len(g.timing.samples_s) <= cfg.reps


def test_devices_sharing_cores_grow_the_gemm_only_while_every_one_of_them_does():
    """The grow-or-stop vote of every size, then the calls per block and the blocks, each the node's least, and a
    start per block: a node whose other device votes to stop at the first size keeps this one at the first size too
    (a stand-in ``agree`` for the node's all-reduce MIN, a count per call)."""
    cfg = bench.BenchConfig("cpu", True, gemm_shape=(64, 32, 48), gemm_dtypes=("fp32",), copy_bytes=2**20,
                            allreduce_bytes=2**20, p2p_bytes=2**20, warmup=1, reps=3, comm_reps=3,
                            latency_reps=3, min_rep_s=0.005, budget_s=2.0)
    alone = bench.gemm_tflops(torch.device("cpu"), "fp32", cfg)
    assert dict(alone.detail)["shape_mkn"] == [64, 32, 48]  # grows to the full shape within 2 s
    votes = []

    def other_stops(n: int) -> int:
        votes.append(n)
        return 0 if len(votes) == 1 else n

    held = bench.gemm_tflops(torch.device("cpu"), "fp32", cfg, agree=other_stops)
    assert dict(held.detail)["shape_mkn"] == [16, 8, 12] and "stopped" not in dict(held.detail)
    # it would have grown; then calls per block, blocks, and one start per block
    calls, blocks = votes[1], votes[2]
    assert votes[0] == 1 and calls >= 1 and 3 <= blocks <= cfg.reps and votes[3:] == [1] * blocks
    assert len(held.timing.samples_s) == blocks
    votes.clear()
    every = bench.gemm_tflops(torch.device("cpu"), "fp32", cfg, agree=lambda n: votes.append(n) or n)
    assert dict(every.detail)["shape_mkn"] == [64, 32, 48] and votes[:3] == [1, 1, 0]

    def fewest(n: int) -> int:  # a node whose other device affords one call per block: every device times one
        votes.append(n)
        return 1 if len(votes) == 4 else n

    votes.clear()
    one = bench.gemm_tflops(torch.device("cpu"), "fp32", cfg, agree=fewest)
    assert votes[3] > 1 and len(one.timing.samples_s) == votes[4] and dict(one.detail)["shape_mkn"] == [64, 32, 48]


def test_repetitions_stop_at_the_budget():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.01)

    t = bench.time_within(fn, once_s=0.01, budget_s=0.05, min_rep_s=0.0, max_reps=100)
    assert 1 <= len(t.samples_s) <= 5 and len(calls) == len(t.samples_s)  # ~10 ms each: the budget, not max_reps
    assert len(bench.time_within(fn, once_s=0.01, budget_s=10.0, min_rep_s=0.0, max_reps=3).samples_s) == 3
    with pytest.raises(ValueError):
        bench.BenchConfig.for_device("cpu", quick=True, budget_s=-1.0)
