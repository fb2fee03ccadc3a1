"""Islands (paper §4, constraints (1)-(3)) on the paper's clusters and hand-made edge cases."""
import json
import os
import subprocess
import sys

import pytest

from helpers_islands import check_island_set, violations
from timeouts import SUBPROCESS_TIMEOUT_S
from tangram_launch.cli import main
from tangram_launch.errors import SpecError
from tangram_launch.islands import IslandTolerances, node_ranges, build_islands, format_islands_table
from tangram_launch.specs.cluster import ClusterSpec


def cluster(nodes, default=3.125, fabrics=(), pairs=()):
    return ClusterSpec.from_dict({
        "network": {"default": {"bandwidth_GBps": default, "latency_us": 30}, "fabrics": list(fabrics),
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
                fabrics=[{"name": "ib", "nodes": ["h0", "h1", "h2"], "bandwidth_GBps": 50}])
    iset = build_islands(c)
    assert summary(iset) == [("h100-sxm", ("h0", "h1", "h2"), 24)]
    assert iset.islands[0].inter_node_link.bandwidth_GBps == 50
    assert iset.separations == ()


def test_mixed_node_sizes_split_by_r1():
    c = cluster([{"name": "a", "gpu": "a100-80gb", "count": 8}, {"name": "b", "gpu": "a100-80gb", "count": 4}],
                fabrics=[{"name": "ib", "nodes": ["a", "b"], "bandwidth_GBps": 25}])
    iset = build_islands(c)
    assert [i.num_gpus for i in iset.islands] == [8, 4]
    assert iset.separations[0].constraint == "(1) GPUs per node"


def test_same_gpu_different_interconnect_split_by_2():
    c = cluster([{"name": "nv", "gpu": "a100-80gb", "count": 4},
                 {"name": "pcie", "gpu": "a100-80gb", "count": 4, "intra_node_bandwidth_GBps": 64}],
                fabrics=[{"name": "ib", "nodes": ["nv", "pcie"], "bandwidth_GBps": 25}])
    iset = build_islands(c)
    assert len(iset.islands) == 2
    assert iset.separations[0].constraint == "(2) intra-node"
    assert "600 vs" in iset.separations[0].detail and "64" in iset.separations[0].detail


def test_node_behind_a_slow_link_is_split_off():
    # a0, a1 and v share InfiniBand; a2 reaches everyone over Ethernet only. {a0, a1, a2} would violate both (3)
    # (e(a0,a2) < e(a0,v)) and (4) (links of 25 and 3.125 GB/s); the cheaper parity check is named.
    c = cluster([{"name": n, "gpu": "a100-80gb", "count": 4} for n in ("a0", "a1", "a2")]
                + [{"name": "v", "gpu": "v100-32gb", "count": 4}],
                fabrics=[{"name": "ib", "nodes": ["a0", "a1", "v"], "bandwidth_GBps": 25}])
    iset = build_islands(c)
    assert summary(iset)[:2] == [("a100-80gb", ("a0", "a1"), 8), ("a100-80gb", ("a2",), 4)]
    names = [i.name for i in iset.islands]
    assert names[:2] == ["a100-80gb-1", "a100-80gb-2"]
    sep = [s for s in iset.separations if {s.island_a, s.island_b} == {"a100-80gb-1", "a100-80gb-2"}][0]
    assert sep.constraint == "(4) inter-node parity"
    assert violations(c, list(iset.islands[0].gpus) + list(iset.islands[1].gpus), iset.tolerances) == {
        "(3) inter-node", "(4) inter-node parity"}


def test_faster_link_to_an_outsider_splits_by_3():
    # All A100 links are 25 GB/s (parity holds for any subset), but a0 reaches the V100 node at 50 GB/s: an island
    # holding a0 and another A100 node would have a link leaving it 2x faster than its own.
    c = cluster([{"name": n, "gpu": "a100-80gb", "count": 4} for n in ("a0", "a1", "a2")]
                + [{"name": "v", "gpu": "v100-32gb", "count": 4}],
                fabrics=[{"name": "ib", "nodes": ["a0", "a1", "a2", "v"], "bandwidth_GBps": 25}],
                pairs=[{"nodes": ["a0", "v"], "bandwidth_GBps": 50}])
    iset = build_islands(c)
    assert summary(iset)[:2] == [("a100-80gb", ("a0",), 4), ("a100-80gb", ("a1", "a2"), 8)]
    sep = iset.separations[0]
    assert (sep.island_a, sep.island_b, sep.constraint) == ("a100-80gb-1", "a100-80gb-2", "(3) inter-node")
    assert "a0<->v leaves the island at 50 GB/s" in sep.detail and "ratio 2.00 > 1.25" in sep.detail
    check_island_set(c, iset, iset.tolerances)


def test_fabric_slower_than_the_default_is_cut_into_nodes():
    # u0, u1 share only a 1 GB/s fabric, slower than the 3.125 GB/s default that reaches x: as a pair they are not
    # an island ((3) at u0: x leaves at 3.125 > 1.25 x 1), so they start apart and x joins the first of them.
    c = cluster([{"name": n, "gpu": "a100-80gb", "count": 2} for n in ("u0", "u1", "x")],
                fabrics=[{"name": "slow", "nodes": ["u0", "u1"], "bandwidth_GBps": 1}])
    iset = build_islands(c)
    assert [i.nodes for i in iset.islands] == [("u0", "x"), ("u1",)]
    assert iset.separations[0].constraint == "(4) inter-node parity"
    check_island_set(c, iset, iset.tolerances)


@pytest.mark.parametrize("eps_n", [0.0, 0.25, 1.0])
def test_issue_14_constraint_3_counterexample(eps_n):
    # A, B, C: A100 nodes; D: a V100 node. A-B 10, A-C 20, B-C 1 GB/s, 5 GB/s otherwise. The earlier construction
    # returned {A, B} with C outside although e(A,B) = 10 < e(A,C) = 20. A-C together or each alone, never that.
    c = cluster([{"name": n, "gpu": "a100-80gb", "count": 4} for n in "ABC"] + [{"name": "D", "gpu": "v100-32gb",
                                                                                 "count": 4}],
                default=5, pairs=[{"nodes": ["A", "B"], "bandwidth_GBps": 10},
                                  {"nodes": ["A", "C"], "bandwidth_GBps": 20},
                                  {"nodes": ["B", "C"], "bandwidth_GBps": 1}])
    tol = IslandTolerances(network=eps_n)
    iset = build_islands(c, tol)
    a100 = [set(i.nodes) for i in iset.islands if i.gpu.type == "a100-80gb"]
    assert {"A", "B"} not in a100
    assert a100 == [{"A", "C"}, {"B"}]  # {A, C} is valid: its links leaving (10, 5, 1 GB/s) are slower than 20
    check_island_set(c, iset, tol)


def test_issue_14_two_pods_joined_by_a_slow_link_are_two_islands(cluster_path):
    c = ClusterSpec.load(cluster_path("two-pods-slow-link"))
    iset = build_islands(c)
    assert summary(iset) == [("a100-80gb", ("a0", "a1"), 16), ("a100-80gb", ("b0", "b1"), 16)]
    assert [i.inter_node_link.bandwidth_GBps for i in iset.islands] == [25, 25]
    (sep,) = iset.separations
    assert sep.constraint == "(4) inter-node parity" and "0.125 GB/s (a0<->b0)" in sep.detail
    check_island_set(c, iset, iset.tolerances)
    # a tolerance wide enough to accept the 1 GbE link joins them again, as the paper's (1)-(3) would
    assert len(build_islands(c, IslandTolerances(network=200)).islands) == 1


def test_cli_eps_network_and_drawing(cluster_path, capsys, tmp_path):
    assert main(["islands", "--cluster", cluster_path("two-pods-slow-link")]) == 0
    table = capsys.readouterr().out
    assert "eps_n=0.25" in table and "a[0-1]" in table and "b[0-1]" in table and "(4) inter-node parity" in table
    svg = tmp_path / "islands.svg"
    assert main(["islands", "--cluster", cluster_path("two-pods-slow-link"), "--eps-network", "200",
                 "--format", "json", "--draw", str(svg)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tolerances"]["network"] == 200
    assert [i["nodes"] for i in data["islands"]] == [["a0", "a1", "b0", "b1"]]
    assert data["islands"][0]["inter_node_bandwidth_GBps"] == 0.125  # the slowest of its links, as before
    assert svg.read_text().startswith("<svg")


def test_two_pod_plan_uses_a_whole_pod(cluster_path, tmp_path):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--cluster", cluster_path("two-pods-slow-link"), "--model", "llama3-8b", "--global-batch",
               "16", "--seq-len", "2048", "--microbatch-sequences", "1", "--workers", "1", "-o", str(out)])
    assert rc == 0
    plan = json.loads(out.read_text())
    used = {(g["node"], g["local_gpu"]) for s in plan["stages"] for g in s["gpus"]}
    pods = [{(n, k) for n in pod for k in range(8)} for pod in (("a0", "a1"), ("b0", "b1"))]
    assert any(pod <= used for pod in pods), sorted(used)


def test_mixed_link_island_without_outsiders_splits_by_parity():
    # Nothing is outside the three nodes, so (3) holds vacuously for all three; (4) parity splits the slow node off.
    c = cluster([{"name": n, "gpu": "a100-80gb", "count": 4} for n in ("a0", "a1", "a2")],
                fabrics=[{"name": "ib", "nodes": ["a0", "a1"], "bandwidth_GBps": 25}])
    iset = build_islands(c)
    assert summary(iset) == [("a100-80gb", ("a0", "a1"), 8), ("a100-80gb", ("a2",), 4)]
    assert iset.islands[0].inter_node_link.bandwidth_GBps == 25
    (sep,) = iset.separations
    assert sep.constraint == "(4) inter-node parity"
    assert "3.125 GB/s" in sep.detail and "25 GB/s" in sep.detail and "ratio 8.00 > 1.25" in sep.detail


@pytest.mark.parametrize("ratio, together", [(1.15, True), (1.1501, False)])
def test_compute_tolerance_boundary(ratio, together):
    base = {"type": "custom", "memory_gib": 40, "memory_bandwidth_GBps": 1000, "intra_node_bandwidth_GBps": 300}
    c = cluster([
        {"name": "x", "gpus": [dict(base, tflops={"bf16": 100.0})] * 2},
        {"name": "y", "gpus": [dict(base, tflops={"bf16": 100.0 * ratio})] * 2},
    ], fabrics=[{"name": "ib", "nodes": ["x", "y"], "bandwidth_GBps": 25}])
    assert (len(build_islands(c).islands) == 1) is together


@pytest.mark.parametrize("eps, together", [(0.0, False), (1.0, True)])
def test_memory_tolerance_is_a_parameter(eps, together):
    c = cluster([{"name": "v32", "gpu": "v100-32gb", "count": 4}, {"name": "v16", "gpu": "v100-16gb", "count": 4}],
                fabrics=[{"name": "ib", "nodes": ["v32", "v16"], "bandwidth_GBps": 25}])
    iset = build_islands(c, IslandTolerances(memory=eps))
    assert (len(iset.islands) == 1) is together


def test_mixed_gpus_inside_one_node_split_into_parts():
    c = cluster([{"name": "m", "gpus": [{"type": "a100-80gb"}, {"type": "a100-80gb"}, {"type": "t4"}, {"type": "t4"}]}])
    iset = build_islands(c)
    assert summary(iset) == [("a100-80gb", ("m",), 2), ("t4", ("m",), 2)]


@pytest.mark.distributed
def test_same_islands_whatever_the_hash_seed(tmp_path):
    # Fabric members are frozensets and pair overrides are keyed by them: iterating either in hash order would
    # make islands, their names or their order depend on PYTHONHASHSEED. Ties everywhere: equal GPUs and links.
    c = cluster([{"name": f"n{i}", "gpu": "a100-80gb", "count": 2} for i in range(8)],
                fabrics=[{"name": "x", "nodes": ["n0", "n1", "n2", "n3"], "bandwidth_GBps": 25},
                         {"name": "y", "nodes": ["n4", "n5", "n6", "n7"], "bandwidth_GBps": 25}],
                pairs=[{"nodes": ["n3", "n4"], "bandwidth_GBps": 25}, {"nodes": ["n0", "n7"], "bandwidth_GBps": 25}])
    path = tmp_path / "c.yaml"
    c.dump(path)
    outputs = set()
    for seed in ("0", "1", "2"):
        out = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "islands", "--cluster", str(path),
                              "--format", "json"], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, timeout=SUBPROCESS_TIMEOUT_S)
        assert out.returncode == 0, out.stderr
        outputs.add(out.stdout)
    assert len(outputs) == 1
    assert json.loads(outputs.pop()) == build_islands(c).to_dict()


def test_measured_compute_overrides_peak():
    c = cluster([{"name": "x", "gpus": [{"type": "cpu", "measured": {"gemm_tflops": {"bf16": 0.1}}}]},
                 {"name": "y", "gpus": [{"type": "cpu", "measured": {"gemm_tflops": {"bf16": 0.033}}}]}],
                fabrics=[{"name": "lo", "nodes": ["x", "y"], "bandwidth_GBps": 10}])
    iset = build_islands(c)
    assert len(iset.islands) == 2 and iset.separations[0].constraint == "(1) compute"


@pytest.mark.parametrize("field", ["compute", "memory", "interconnect", "network"])
def test_negative_tolerance_refused(field):
    with pytest.raises(SpecError, match=f"tolerances.{field}"):
        IslandTolerances(**{field: -0.1})


@pytest.mark.parametrize("names, text", [
    (("h100-0",), "h100-0"),
    (tuple(f"h100-{i}" for i in range(64)), "h100-[0-63]"),
    (("n0", "n1", "n2", "n5", "n7", "n8"), "n[0-2,5,7-8]"),
    (("a0", "a1", "b0", "b1"), "a[0-1],b[0-1]"),
    (("head", "n3", "n4", "n01"), "head,n[3-4],n01"),  # a leading zero is a name, not a number
])
def test_node_lists_print_as_ranges(names, text):
    assert node_ranges(names) == text


def test_large_cluster_table_stays_readable():
    # 8 pods of 32 nodes on their own fabrics: 8 islands, 28 pairs; node lists as ranges, reasons counted.
    names = [f"h100-{i}" for i in range(256)]
    c = cluster([{"name": n, "gpu": "h100-sxm", "count": 8} for n in names],
                fabrics=[{"name": f"pod{k}", "nodes": names[32 * k:32 * k + 32], "bandwidth_GBps": 50}
                         for k in range(8)])
    iset = build_islands(c)
    assert [i.num_nodes for i in iset.islands] == [32] * 8
    table = format_islands_table(iset, max_reasons=10)
    lines = table.splitlines()
    assert lines[2].split()[2] == "h100-[0-31]" and lines[9].split()[2] == "h100-[224-255]"
    assert "why apart (28 island pairs; --format json lists each):" in table
    assert "(4) inter-node parity: 28 pairs, e.g. h100-sxm-1 / h100-sxm-2:" in table
    assert max(len(line) for line in lines) < 200
    assert len(lines) == 2 + 8 + 3  # title, header, 8 islands; blank, "why apart", one line per constraint
    assert len(format_islands_table(iset).splitlines()) == 2 + 8 + 2 + 28  # up to 40 pairs: one line each


@pytest.mark.distributed
def test_cli_islands_json_and_errors(cluster_path, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "islands", "--cluster",
                          cluster_path("c3-full-het-iii"), "--format", "json"], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [i["name"] for i in data["islands"]] == ["a100-80gb", "v100-32gb", "v100-16gb"]
    assert data["tolerances"]["network"] == 0.25
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - {name: a, gpu: h100-sxn, count: 8}\n")
    out = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "islands", "--cluster", str(bad)],
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "h100-sxm" in out.stderr and str(bad) in out.stderr


def test_island_carries_minimum_of_measured_figures():
    g = lambda t, bw, extra: dict({"type": "cpu", "measured": dict({"gemm_tflops": {"bf16": t, "fp32": t / 2},
                                                                     "memory_bandwidth_GBps": bw}, **extra)})
    c = cluster([{"name": "x", "gpus": [g(0.10, 12.0, {"layer_s": 0.5}), g(0.095, 10.0, {})]}])
    (isl,) = build_islands(c).islands
    assert isl.gpu.measured == {"gemm_tflops": {"bf16": 0.095, "fp32": 0.0475}, "memory_bandwidth_GBps": 10.0}


def test_benchmark_runs_and_splits_along_pods(capsys):
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_islands.py")
    spec = importlib.util.spec_from_file_location("bench_islands", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--sizes", "64", "--repeat", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[2], r[3]) for r in rows] == [("64", "fabrics", "2"), ("64", "8-pods", "8"), ("64", "pairs", "3")]
    # the pod with the 20 GB/s link loses a node to parity (20 vs ~50 GB/s); the other pod stays whole
    iset = build_islands(bench.make_cluster(64, overrides=True))
    assert sorted(i.num_nodes for i in iset.islands) == [1, 31, 32]


def test_island_representative_takes_the_slowest_measured_figures():
    """Rates take their minimum, durations (layer times, collective latency) their maximum: an island runs at the
    pace of its slowest member, not at the fastest one's layer time."""
    def cpu(gemm, layer_s, latency_us):
        return {"type": "cpu", "measured": {"gemm_tflops": {"fp32": gemm}, "collective_latency_us": latency_us,
                                            "layer_forward_s": {"m|dense|seq=64|mbs=1|tp=1": layer_s}}}
    spec = ClusterSpec.from_dict({"nodes": [{"name": "box", "gpus": [cpu(0.12, 0.003, 150.0),
                                                                      cpu(0.10, 0.002, 300.0)]}]})
    iset = build_islands(spec, IslandTolerances(compute=1.0), dtype="fp32")
    assert len(iset.islands) == 1
    m = iset.islands[0].gpu.measured
    assert m["gemm_tflops"]["fp32"] == 0.10  # the slower GEMM rate
    assert m["layer_forward_s"]["m|dense|seq=64|mbs=1|tp=1"] == 0.003  # the slower layer
    assert m["collective_latency_us"] == 300.0
