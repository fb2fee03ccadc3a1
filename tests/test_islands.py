"""Islands (paper §4, constraints (1)-(3)) on the paper's clusters and hand-made edge cases."""
import json
import subprocess
import sys

import pytest

from tangram_launch.errors import SpecError
from tangram_launch.islands import IslandTolerances, build_islands
from tangram_launch.specs.cluster import ClusterSpec


def cluster(nodes, default=3.125, fabrics=(), pairs=()):
    return ClusterSpec.from_dict({
        "network": {"default": {"bandwidth_gbps": default, "latency_us": 30}, "fabrics": list(fabrics),
                    "pairs": list(pairs)},
        "nodes": nodes,
    })


def summary(iset):
    return [(i.gpu.type, i.nodes, i.num_gpus) for i in iset.islands]


def test_c3_iii_three_islands_and_reasons(cluster_path):
    iset = build_islands(ClusterSpec.load(cluster_path("c3-full-het-iii")))
    assert summary(iset) == [("a100-80gb", ("a100-0",), 4), ("v100-32gb", ("v100-32-0",), 8),
                             ("v100-16gb", ("v100-16-0",), 4)]
    reasons = {(s.island_a, s.island_b): s.constraint for s in iset.separations}
    assert reasons[("v100-32gb", "v100-16gb")] == "(1) memory"
    assert reasons[("a100-80gb", "v100-32gb")] == "(1) compute"


def test_c3_4_islands_has_20_gpus(cluster_path):
    iset = build_islands(ClusterSpec.load(cluster_path("c3-4-islands-20gpu")))
    assert len(iset.islands) == 4 and sum(i.num_gpus for i in iset.islands) == 20


def test_identical_nodes_on_one_fabric_form_one_island():
    c = cluster([{"name": f"h{i}", "gpu": "h100-sxm", "count": 8} for i in range(3)],
                fabrics=[{"name": "ib", "nodes": ["h0", "h1", "h2"], "bandwidth_gbps": 50}])
    iset = build_islands(c)
    assert summary(iset) == [("h100-sxm", ("h0", "h1", "h2"), 24)]
    assert iset.islands[0].inter_node_link.bandwidth_gbps == 50
    assert iset.separations == ()


def test_mixed_node_sizes_split_by_r1():
    c = cluster([{"name": "a", "gpu": "a100-80gb", "count": 8}, {"name": "b", "gpu": "a100-80gb", "count": 4}],
                fabrics=[{"name": "ib", "nodes": ["a", "b"], "bandwidth_gbps": 25}])
    iset = build_islands(c)
    assert [i.num_gpus for i in iset.islands] == [8, 4]
    assert iset.separations[0].constraint == "(1) GPUs per node"


def test_same_gpu_different_interconnect_split_by_2():
    c = cluster([{"name": "nv", "gpu": "a100-80gb", "count": 4},
                 {"name": "pcie", "gpu": "a100-80gb", "count": 4, "intra_node_bandwidth_gbps": 64}],
                fabrics=[{"name": "ib", "nodes": ["nv", "pcie"], "bandwidth_gbps": 25}])
    iset = build_islands(c)
    assert len(iset.islands) == 2
    assert iset.separations[0].constraint == "(2) intra-node"
    assert "600 vs" in iset.separations[0].detail and "64" in iset.separations[0].detail


def test_slow_link_split_by_3():
    # a0, a1 and v share InfiniBand; a2 reaches everyone over Ethernet only: e(a0,a2) < e(a0,v) violates (3).
    c = cluster([{"name": n, "gpu": "a100-80gb", "count": 4} for n in ("a0", "a1", "a2")]
                + [{"name": "v", "gpu": "v100-32gb", "count": 4}],
                fabrics=[{"name": "ib", "nodes": ["a0", "a1", "v"], "bandwidth_gbps": 25}])
    iset = build_islands(c)
    assert summary(iset)[:2] == [("a100-80gb", ("a0", "a1"), 8), ("a100-80gb", ("a2",), 4)]
    names = [i.name for i in iset.islands]
    assert names[:2] == ["a100-80gb-1", "a100-80gb-2"]
    sep = [s for s in iset.separations if {s.island_a, s.island_b} == {"a100-80gb-1", "a100-80gb-2"}][0]
    assert sep.constraint == "(3) inter-node"


def test_mixed_link_island_without_outsiders_splits_by_parity():
    # Nothing is outside the three nodes, so (3) holds vacuously for all three; (4) parity splits the slow node off.
    c = cluster([{"name": n, "gpu": "a100-80gb", "count": 4} for n in ("a0", "a1", "a2")],
                fabrics=[{"name": "ib", "nodes": ["a0", "a1"], "bandwidth_gbps": 25}])
    iset = build_islands(c)
    assert summary(iset) == [("a100-80gb", ("a0", "a1"), 8), ("a100-80gb", ("a2",), 4)]
    assert iset.islands[0].inter_node_link.bandwidth_gbps == 25
    (sep,) = iset.separations
    assert sep.constraint == "(4) inter-node parity"
    assert "3.125 GB/s" in sep.detail and "25 GB/s" in sep.detail and "ratio 8.00 > 1.25" in sep.detail


@pytest.mark.parametrize("ratio, together", [(1.15, True), (1.1501, False)])
def test_compute_tolerance_boundary(ratio, together):
    base = {"type": "custom", "memory_gib": 40, "memory_bandwidth_gbps": 1000, "intra_node_bandwidth_gbps": 300}
    c = cluster([
        {"name": "x", "gpus": [dict(base, tflops={"bf16": 100.0})] * 2},
        {"name": "y", "gpus": [dict(base, tflops={"bf16": 100.0 * ratio})] * 2},
    ], fabrics=[{"name": "ib", "nodes": ["x", "y"], "bandwidth_gbps": 25}])
    assert (len(build_islands(c).islands) == 1) is together


@pytest.mark.parametrize("eps, together", [(0.0, False), (1.0, True)])
def test_memory_tolerance_is_a_parameter(eps, together):
    c = cluster([{"name": "v32", "gpu": "v100-32gb", "count": 4}, {"name": "v16", "gpu": "v100-16gb", "count": 4}],
                fabrics=[{"name": "ib", "nodes": ["v32", "v16"], "bandwidth_gbps": 25}])
    iset = build_islands(c, IslandTolerances(memory=eps))
    assert (len(iset.islands) == 1) is together


def test_mixed_gpus_inside_one_node_split_into_parts():
    c = cluster([{"name": "m", "gpus": [{"type": "a100-80gb"}, {"type": "a100-80gb"}, {"type": "t4"}, {"type": "t4"}]}])
    iset = build_islands(c)
    assert summary(iset) == [("a100-80gb", ("m",), 2), ("t4", ("m",), 2)]


def test_deterministic(cluster_path):
    c = ClusterSpec.load(cluster_path("c3-4-islands-20gpu"))
    assert build_islands(c).to_dict() == build_islands(c).to_dict()


def test_measured_compute_overrides_peak():
    c = cluster([{"name": "x", "gpus": [{"type": "cpu", "measured": {"gemm_tflops": {"bf16": 0.1}}}]},
                 {"name": "y", "gpus": [{"type": "cpu", "measured": {"gemm_tflops": {"bf16": 0.033}}}]}],
                fabrics=[{"name": "lo", "nodes": ["x", "y"], "bandwidth_gbps": 10}])
    iset = build_islands(c)
    assert len(iset.islands) == 2 and iset.separations[0].constraint == "(1) compute"


def test_negative_tolerance_refused():
    with pytest.raises(SpecError, match="tolerances.compute"):
        IslandTolerances(compute=-0.1)


def test_cli_islands_json_and_errors(cluster_path, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "islands", "--cluster",
                          cluster_path("c3-full-het-iii"), "--format", "json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [i["name"] for i in data["islands"]] == ["a100-80gb", "v100-32gb", "v100-16gb"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - {name: a, gpu: h100-sxn, count: 8}\n")
    out = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "islands", "--cluster", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "h100-sxm" in out.stderr and str(bad) in out.stderr


def test_island_carries_minimum_of_measured_figures():
    g = lambda t, bw, extra: dict({"type": "cpu", "measured": dict({"gemm_tflops": {"bf16": t, "fp32": t / 2},
                                                                     "memory_bandwidth_gbps": bw}, **extra)})
    c = cluster([{"name": "x", "gpus": [g(0.10, 12.0, {"layer_s": 0.5}), g(0.095, 10.0, {})]}])
    (isl,) = build_islands(c).islands
    assert isl.gpu.measured == {"gemm_tflops": {"bf16": 0.095, "fp32": 0.0475}, "memory_bandwidth_gbps": 10.0}
