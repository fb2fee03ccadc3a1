"""GPU islands (paper §4): groups of similar GPUs that a homogeneous parallelizer can treat as one cluster.

An island satisfies, for every pair of its GPUs g, g' (paper eqs. (1)-(3)):
  (1) max(c)/min(c) <= 1+eps_c and max(m)/min(m) <= 1+eps_m, and all its nodes hold the same number of GPUs (R1);
  (2) max(b)/min(b) <= 1+eps_i for the intra-node bandwidths b;
  (3) for g, g' on different nodes of the island and any g'' outside it: e(g, g') >= e(g, g'').
Construction is deterministic (nodes in file order, GPUs in index order) and every split is explained.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from tangram_launch.errors import SpecError
from tangram_launch.specs.cluster import ClusterSpec, GPUSpec, GpuRef, LinkSpec


@dataclass(frozen=True)
class IslandTolerances:
    """eps = (eps_c, eps_m, eps_i).

    Defaults: identical GPUs measure within a few per cent of each other (profiler noise, clocks), while GPU
    generations differ by >= 1.5x in compute (V100 125 vs A100 312 TFLOP/s) and memory variants by >= 1.17x
    (H100 80 vs NVL 94 GiB); NVLink and PCIe differ by >= 4x. So 15 % / 10 % / 25 % keep twins together and
    generations and memory variants apart.
    """

    compute: float = 0.15
    memory: float = 0.10
    interconnect: float = 0.25

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "interconnect"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise SpecError("tolerance must be a number >= 0", field=f"tolerances.{name}", value=v)


def compute_tflops(gpu: GPUSpec, dtype: str = "bf16") -> float:
    """Compute capacity c_g: measured GEMM throughput when profiled, else the dense peak; falls back to fp16/fp32
    for GPUs without the dtype (T4/V100 have no bf16) so islands are defined on every cluster."""
    measured = gpu.measured.get("gemm_tflops") if gpu.measured else None
    for d in (dtype, "fp16", "fp32"):
        if isinstance(measured, dict) and measured.get(d):
            return float(measured[d])
        if gpu.tflops.get(d):
            return float(gpu.tflops[d])
    raise SpecError("GPU has no throughput figure", field="tflops", value=dict(gpu.tflops))


def _ratio(a: float, b: float) -> float:
    return max(a, b) / min(a, b)


@dataclass(frozen=True)
class Island:
    name: str
    nodes: tuple[str, ...]
    gpus: tuple[GpuRef, ...]
    gpus_per_node: int
    gpu: GPUSpec  # conservative representative: element-wise minimum of its GPUs' figures
    inter_node_link: LinkSpec | None  # slowest link between its nodes; None on one node

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def to_dict(self, dtype: str = "bf16") -> dict:
        return {
            "name": self.name,
            "gpu_type": self.gpu.type,
            "nodes": list(self.nodes),
            "gpus_per_node": self.gpus_per_node,
            "num_gpus": self.num_gpus,
            "compute_tflops": round(compute_tflops(self.gpu, dtype), 3),
            "memory_gib": self.gpu.memory_gib,
            "intra_node_bandwidth_gbps": self.gpu.intra_node_bandwidth_gbps,
            "inter_node_bandwidth_gbps": self.inter_node_link.bandwidth_gbps if self.inter_node_link else None,
            "gpus": [str(g) for g in self.gpus],
        }


@dataclass(frozen=True)
class Separation:
    """Why two islands were not merged: the first constraint that fails between them, with the numbers."""

    island_a: str
    island_b: str
    constraint: str  # "(1) compute" | "(1) memory" | "(1) GPUs per node" | "(2) intra-node" | "(3) inter-node"
    detail: str

    def to_dict(self) -> dict:
        return {"islands": [self.island_a, self.island_b], "constraint": self.constraint, "detail": self.detail}


@dataclass(frozen=True)
class IslandSet:
    islands: tuple[Island, ...]
    separations: tuple[Separation, ...]
    tolerances: IslandTolerances = field(default_factory=IslandTolerances)

    def by_name(self, name: str) -> Island:
        for i in self.islands:
            if i.name == name:
                return i
        raise SpecError("unknown island", field="island", value=name,
                        valid=", ".join(i.name for i in self.islands))

    def to_dict(self, dtype: str = "bf16") -> dict:
        return {
            "tolerances": {"compute": self.tolerances.compute, "memory": self.tolerances.memory,
                           "interconnect": self.tolerances.interconnect},
            "islands": [i.to_dict(dtype) for i in self.islands],
            "separations": [s.to_dict() for s in self.separations],
        }


# A "part" is the GPUs of one node that are alike; islands are unions of parts from different nodes.
@dataclass
class _Part:
    node: str
    node_index: int
    gpus: list[tuple[GpuRef, GPUSpec]]


def _pair_failure(a: GPUSpec, b: GPUSpec, tol: IslandTolerances, dtype: str) -> tuple[str, str] | None:
    ca, cb = compute_tflops(a, dtype), compute_tflops(b, dtype)
    if _ratio(ca, cb) > 1 + tol.compute:
        return "(1) compute", f"{a.type} {ca:g} vs {b.type} {cb:g} TFLOP/s: ratio {_ratio(ca, cb):.2f} > {1 + tol.compute:g}"
    if _ratio(a.memory_gib, b.memory_gib) > 1 + tol.memory:
        return "(1) memory", (f"{a.type} {a.memory_gib:g} vs {b.type} {b.memory_gib:g} GiB: ratio "
                              f"{_ratio(a.memory_gib, b.memory_gib):.2f} > {1 + tol.memory:g}")
    ia, ib = a.intra_node_bandwidth_gbps, b.intra_node_bandwidth_gbps
    if _ratio(ia, ib) > 1 + tol.interconnect:
        return "(2) intra-node", (f"{a.type} {ia:g} vs {b.type} {ib:g} GB/s intra-node: ratio {_ratio(ia, ib):.2f} > "
                                  f"{1 + tol.interconnect:g}")
    return None


def _split_node(cluster: ClusterSpec, tol: IslandTolerances, dtype: str) -> list[_Part]:
    parts: list[_Part] = []
    for ni, node in enumerate(cluster.nodes):
        local: list[_Part] = []
        for li, g in enumerate(node.gpus):
            for p in local:
                if all(_pair_failure(g, h, tol, dtype) is None for _, h in p.gpus):
                    p.gpus.append((GpuRef(node.name, li), g))
                    break
            else:
                local.append(_Part(node.name, ni, [(GpuRef(node.name, li), g)]))
        parts.extend(local)
    return parts


def _compatible(group: list[_Part], part: _Part, tol: IslandTolerances, dtype: str) -> bool:
    if any(p.node == part.node for p in group):
        return False
    if len(group[0].gpus) != len(part.gpus):
        return False
    return all(_pair_failure(g, h, tol, dtype) is None for p in group for _, g in p.gpus for _, h in part.gpus)


def _refine_by_links(groups: list[list[_Part]], cluster: ClusterSpec) -> list[list[_Part]]:
    """Split groups until constraint (3) holds: links inside an island are at least as fast as links leaving it.

    A group is split into the connected components of its "fast-link" graph, where nodes u, v are joined when
    e(u, v) >= every link from u or v to a node outside the group; repeat until nothing splits (splits only
    refine, so this terminates).
    """
    changed = True
    while changed:
        changed = False
        out: list[list[_Part]] = []
        for grp in groups:
            if len(grp) == 1:
                out.append(grp)
                continue
            inside = {p.node for p in grp}
            outside = [n for n in cluster.node_names if n not in inside]

            def leaving(u: str) -> float:
                return max((cluster.link(u, w).bandwidth_gbps for w in outside), default=0.0)

            # union-find over the group's parts
            parent = list(range(len(grp)))

            def find(i: int) -> int:
                while parent[i] != i:
                    parent[i] = parent[parent[i]]
                    i = parent[i]
                return i

            for i in range(len(grp)):
                for j in range(i + 1, len(grp)):
                    u, v = grp[i].node, grp[j].node
                    if cluster.link(u, v).bandwidth_gbps >= max(leaving(u), leaving(v)):
                        parent[find(j)] = find(i)
            comps: dict[int, list[_Part]] = {}
            for i, p in enumerate(grp):
                comps.setdefault(find(i), []).append(p)
            pieces = list(comps.values())
            if len(pieces) > 1:
                changed = True
            out.extend(pieces)
        groups = out
    # A transitive component may still contain a slow pair; split such pairs off deterministically.
    final: list[list[_Part]] = []
    for grp in groups:
        _split_slow_pairs(grp, cluster, final)
    return final


def _split_slow_pairs(grp: list[_Part], cluster: ClusterSpec, final: list[list[_Part]]) -> None:
    inside = {p.node for p in grp}
    outside = [n for n in cluster.node_names if n not in inside]
    kept: list[_Part] = []
    rest: list[_Part] = []
    for p in grp:
        ok = all(
            cluster.link(p.node, q.node).bandwidth_gbps
            >= max((cluster.link(p.node, w).bandwidth_gbps for w in outside), default=0.0)
            for q in kept
        )
        (kept if ok else rest).append(p)
    final.append(kept)
    if rest:
        _split_slow_pairs(rest, cluster, final)


def _min_measured(all_measured: list) -> dict:
    """Conservative measured figures of a group: the minimum of every number every GPU has (also inside nested
    mappings such as gemm_tflops per dtype); figures some GPUs lack are dropped rather than guessed."""
    if not all_measured or not all(all_measured):
        return {}
    out: dict = {}
    for key in all_measured[0]:
        vals = [m.get(key) for m in all_measured]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = min(vals)
        elif all(isinstance(v, dict) for v in vals):
            nested = _min_measured(vals)
            if nested:
                out[key] = nested
    return out


def _min_gpu(gpus: list[GPUSpec]) -> GPUSpec:
    types = Counter(g.type for g in gpus)
    dtypes = {d for g in gpus for d in g.tflops}
    tflops = {}
    for d in sorted(dtypes):
        vals = [g.tflops.get(d) for g in gpus]
        tflops[d] = None if any(v is None for v in vals) else min(vals)
    measured = _min_measured([g.measured for g in gpus])
    return GPUSpec(
        type=types.most_common(1)[0][0],
        tflops=tflops,
        memory_gib=min(g.memory_gib for g in gpus),
        memory_bandwidth_gbps=min(g.memory_bandwidth_gbps for g in gpus),
        intra_node_bandwidth_gbps=min(g.intra_node_bandwidth_gbps for g in gpus),
        measured=measured,
    )


def build_islands(cluster: ClusterSpec, tolerances: IslandTolerances | None = None, *,
                  dtype: str = "bf16") -> IslandSet:
    """Group the cluster's GPUs into islands satisfying constraints (1)-(3)."""
    tol = tolerances or IslandTolerances()
    parts = _split_node(cluster, tol, dtype)
    # Stronger parts first so the first island is the fastest (ties keep file order).
    order = sorted(range(len(parts)), key=lambda i: (-compute_tflops(parts[i].gpus[0][1], dtype),
                                                     -parts[i].gpus[0][1].memory_gib, i))
    groups: list[list[_Part]] = []
    for i in order:
        part = parts[i]
        for grp in groups:
            if _compatible(grp, part, tol, dtype):
                grp.append(part)
                break
        else:
            groups.append([part])
    groups = _refine_by_links(groups, cluster)
    for grp in groups:
        grp.sort(key=lambda p: (p.node_index, p.gpus[0][0].local_index))

    islands: list[Island] = []
    base_count = Counter(_min_gpu([g for p in grp for _, g in p.gpus]).type for grp in groups)
    seen: Counter = Counter()
    for grp in groups:
        gpus = [g for p in grp for _, g in p.gpus]
        rep = _min_gpu(gpus)
        seen[rep.type] += 1
        name = rep.type if base_count[rep.type] == 1 else f"{rep.type}-{seen[rep.type]}"
        nodes = tuple(p.node for p in grp)
        link = None
        if len(nodes) > 1:
            links = [cluster.link(a, b) for k, a in enumerate(nodes) for b in nodes[k + 1:]]
            link = LinkSpec(min(l.bandwidth_gbps for l in links), max(l.latency_us for l in links))
        islands.append(Island(name=name, nodes=nodes, gpus=tuple(r for p in grp for r, _ in p.gpus),
                              gpus_per_node=len(grp[0].gpus), gpu=rep, inter_node_link=link))
    separations = _explain(islands, cluster, tol, dtype)
    return IslandSet(tuple(islands), tuple(separations), tol)


def _explain(islands: list[Island], cluster: ClusterSpec, tol: IslandTolerances, dtype: str) -> list[Separation]:
    out = []
    for i, a in enumerate(islands):
        for b in islands[i + 1:]:
            ga, gb = cluster.gpu(a.gpus[0]), cluster.gpu(b.gpus[0])
            fail = _pair_failure(ga, gb, tol, dtype)
            if fail is None and a.gpus_per_node != b.gpus_per_node:
                fail = ("(1) GPUs per node", f"{a.name} has {a.gpus_per_node} GPUs per node, {b.name} has "
                                             f"{b.gpus_per_node} (R1: an island's nodes hold equally many GPUs)")
            if fail is None and set(a.nodes) & set(b.nodes):
                fail = ("(1) GPUs per node", "parts of the same node cannot join one island twice")
            if fail is None:
                cross = max(((cluster.link(x, y), x, y) for x in a.nodes for y in b.nodes),
                            key=lambda t: t[0].bandwidth_gbps)
                inner = [cluster.link(x, y).bandwidth_gbps for n in (a.nodes, b.nodes)
                         for k, x in enumerate(n) for y in n[k + 1:]]
                slow = min(((cluster.link(x, y), x, y) for x in a.nodes for y in b.nodes),
                           key=lambda t: t[0].bandwidth_gbps)
                detail = (f"link {slow[1]}<->{slow[2]} is {slow[0].bandwidth_gbps:g} GB/s, slower than links "
                          f"leaving the merged island (up to {max(inner + [cross[0].bandwidth_gbps]):g} GB/s)")
                fail = ("(3) inter-node", detail)
            out.append(Separation(a.name, b.name, fail[0], fail[1]))
    return out


def format_islands_table(iset: IslandSet, dtype: str = "bf16") -> str:
    """Human-readable table of islands and why they are apart."""
    rows = [("island", "gpu", "nodes", "gpus", "TFLOP/s", "mem GiB", "intra GB/s", "inter GB/s")]
    for isl in iset.islands:
        d = isl.to_dict(dtype)
        rows.append((isl.name, isl.gpu.type, ",".join(isl.nodes), f"{isl.num_nodes}x{isl.gpus_per_node}",
                     f"{d['compute_tflops']:g}", f"{isl.gpu.memory_gib:g}", f"{isl.gpu.intra_node_bandwidth_gbps:g}",
                     "-" if isl.inter_node_link is None else f"{isl.inter_node_link.bandwidth_gbps:g}"))
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    eps = iset.tolerances
    lines.insert(0, f"islands (eps_c={eps.compute:g}, eps_m={eps.memory:g}, eps_i={eps.interconnect:g}):")
    if iset.separations:
        lines.append("")
        lines.append("why apart:")
        for s in iset.separations:
            lines.append(f"  {s.island_a} / {s.island_b}: {s.constraint}: {s.detail}")
    return "\n".join(lines)
