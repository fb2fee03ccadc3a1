"""A reference for island constraints, written straight from the definitions (GPU by GPU, node pair by node pair,
through ``ClusterSpec.link``), to check the fast construction in tangram_launch/islands.py against."""
from __future__ import annotations

from collections import Counter
from itertools import combinations

from tangram_launch.islands import IslandTolerances, build_islands, compute_tflops
from tangram_launch.specs.cluster import ClusterSpec, GpuRef


def violations(cluster: ClusterSpec, gpus: list[GpuRef], tol: IslandTolerances, dtype: str = "bf16") -> set[str]:
    """Every constraint the GPU set violates, named as Separation.constraint names them."""
    out: set[str] = set()
    specs = [cluster.gpu(r) for r in gpus]
    for name, values, eps in (("(1) compute", [compute_tflops(g, dtype) for g in specs], tol.compute),
                              ("(1) memory", [g.memory_gib for g in specs], tol.memory),
                              ("(2) intra-node", [g.intra_node_bandwidth_GBps for g in specs], tol.interconnect)):
        if any(max(a, b) / min(a, b) > 1 + eps for a, b in combinations(values, 2)):
            out.add(name)
    per_node = Counter(r.node for r in gpus)
    if len(set(per_node.values())) > 1 or len(set(gpus)) != len(gpus):
        out.add("(1) GPUs per node")
    nodes = list(per_node)
    outside = [n for n in cluster.node_names if n not in per_node]
    limit = 1 + tol.network
    for u in nodes:
        for v in nodes:
            if u == v:
                continue
            inside_gbps = cluster.link(u, v).bandwidth_GBps
            if any(cluster.link(u, w).bandwidth_GBps / inside_gbps > limit for w in outside):
                out.add("(3) inter-node")
    links = [cluster.link(u, v).bandwidth_GBps for u, v in combinations(nodes, 2)]
    if links and max(links) / min(links) > limit:
        out.add("(4) inter-node parity")
    return out


def check_island_set(cluster: ClusterSpec, iset, tol: IslandTolerances, dtype: str = "bf16") -> None:
    """Every island valid, every GPU in exactly one island, the island's figures as the reference computes them,
    and every pair of islands apart for a reason their union really violates (pairwise maximality)."""
    seen = Counter(r for isl in iset.islands for r in isl.gpus)
    assert set(seen) == {r for r, _ in cluster.iter_gpus()}
    assert set(seen.values()) == {1}, "a GPU in two islands"
    for isl in iset.islands:
        assert violations(cluster, list(isl.gpus), tol, dtype) == set(), isl.name
        assert isl.num_gpus == isl.num_nodes * isl.gpus_per_node
        pairs = [cluster.link(u, v) for u, v in combinations(isl.nodes, 2)]
        if pairs:
            assert isl.inter_node_link.bandwidth_GBps == min(p.bandwidth_GBps for p in pairs)
            assert isl.inter_node_link.latency_us == max(p.latency_us for p in pairs)
        else:
            assert isl.inter_node_link is None
    by_pair = {(s.island_a, s.island_b): s for s in iset.separations}
    names = [i.name for i in iset.islands]
    assert len(set(names)) == len(names)
    assert list(by_pair) == list(combinations(names, 2))
    for a, b in combinations(iset.islands, 2):
        reasons = violations(cluster, list(a.gpus) + list(b.gpus), tol, dtype)
        assert by_pair[(a.name, b.name)].constraint in reasons, (a.name, b.name, reasons)


def uniform_island(gpu: str, per_node: int, nodes: int, dtype: str = "fp16"):
    """The one island of ``nodes`` nodes of ``per_node`` GPUs of type ``gpu`` (12.5 GB/s between nodes)."""
    cl = ClusterSpec.from_dict({
        "name": "gen", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 10}},
        "nodes": [{"name": f"n{i}", "gpu": gpu, "count": per_node} for i in range(nodes)]})
    (isl,) = build_islands(cl, dtype=dtype).islands
    return isl
