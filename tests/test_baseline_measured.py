"""The `--compare` baselines price a profiled cluster from its measured figures, as the plan they are compared with
is priced: the whole-cluster island carries its slowest GPU's measured block (it had only the spec-sheet rates, so
on a profiled CPU pair the homogeneous baseline read 7-10x faster than the plan on the same two devices)."""
from __future__ import annotations

from pathlib import Path

from tangram_launch.planner.baselines import whole_cluster_island
from tangram_launch.specs.cluster import ClusterSpec

PROFILED = Path(__file__).resolve().parent.parent / "examples" / "clusters" / "profiled-cpu-2.yaml"


def test_the_whole_cluster_island_keeps_the_slowest_gpus_measured_figures():
    cluster = ClusterSpec.load(PROFILED)
    gpus = [g for _, g in cluster.iter_gpus()]
    island = whole_cluster_island(cluster, "fp32")
    slowest = min(gpus, key=lambda g: g.measured["gemm_tflops"]["fp32"])
    assert island.gpu.measured == slowest.measured
    assert island.gpu.measured["gemm_tflops"]["fp32"] == min(g.measured["gemm_tflops"]["fp32"] for g in gpus)
