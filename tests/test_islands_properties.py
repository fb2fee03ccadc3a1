"""Property test of island construction over random clusters: node types and sizes, mixed nodes, fabrics, pair
overrides, measured figures with noise and tolerances, against the reference in helpers_islands.py."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_islands import check_island_set
from tangram_launch.islands import IslandTolerances, build_islands
from tangram_launch.specs.cluster import ClusterSpec

KINDS = ("a100-80gb", "a100-40gb", "h100-sxm", "v100-32gb", "v100-16gb")
BANDWIDTHS_GBPS = (0.125, 3.125, 12.5, 25.0, 50.0)


@st.composite
def gpu_entry(draw, kind: str) -> dict:
    entry: dict = {"type": kind}
    if draw(st.booleans()):  # a profiled GPU: measured GEMM throughput with noise around the peak
        entry["measured"] = {"gemm_tflops": {"bf16": draw(st.floats(50.0, 1000.0))}}
    if draw(st.integers(0, 4)) == 0:
        entry["intra_node_bandwidth_GBps"] = draw(st.sampled_from((64.0, 300.0, 600.0)))
    return entry


@st.composite
def clusters(draw) -> tuple[ClusterSpec, IslandTolerances]:
    num_nodes = draw(st.integers(1, 7))
    names = [f"n{i}" for i in range(num_nodes)]
    nodes = []
    for name in names:
        size = draw(st.sampled_from((1, 2, 4)))
        if draw(st.integers(0, 3)) == 0:  # a mixed node
            gpus = [draw(gpu_entry(draw(st.sampled_from(KINDS)))) for _ in range(size)]
            nodes.append({"name": name, "gpus": gpus})
        else:
            nodes.append({"name": name, "gpu": draw(st.sampled_from(KINDS)), "count": size})

    def bandwidth() -> float:
        base = draw(st.sampled_from(BANDWIDTHS_GBPS))
        return round(base * draw(st.floats(0.8, 1.2)), 4) if draw(st.booleans()) else base  # measured noise

    network: dict = {"default": {"bandwidth_GBps": bandwidth(), "latency_us": 30}, "fabrics": [], "pairs": []}
    if num_nodes >= 2:
        for f in range(draw(st.integers(0, 3))):
            members = draw(st.lists(st.sampled_from(names), min_size=2, max_size=num_nodes, unique=True))
            network["fabrics"].append({"name": f"f{f}", "nodes": members, "bandwidth_GBps": bandwidth(),
                                       "latency_us": draw(st.sampled_from((1, 2, 5)))})
        pairs = draw(st.lists(st.lists(st.sampled_from(names), min_size=2, max_size=2, unique=True), max_size=6,
                              unique_by=lambda p: frozenset(p)))
        for p in pairs:
            network["pairs"].append({"nodes": p, "bandwidth_GBps": bandwidth(), "latency_us": 3})
    tol = IslandTolerances(compute=draw(st.sampled_from((0.0, 0.15, 0.5))), memory=0.10,
                           interconnect=0.25, network=draw(st.sampled_from((0.0, 0.1, 0.25, 1.0))))
    return ClusterSpec.from_dict({"name": "random", "nodes": nodes, "network": network}), tol


@pytest.mark.slow
@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(clusters())
def test_random_clusters_give_valid_maximal_deterministic_islands(case):
    cluster, tol = case
    iset = build_islands(cluster, tol)
    check_island_set(cluster, iset, tol)
    again = build_islands(ClusterSpec.from_dict(cluster.to_dict()), tol)  # a fresh parse: no shared objects
    assert again.to_dict() == iset.to_dict()
