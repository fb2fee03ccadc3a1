"""GPU islands (paper §4): groups of similar GPUs that a homogeneous parallelizer can treat as one cluster.

An island I satisfies, with tolerances eps = (eps_c, eps_m, eps_i, eps_n) and r_x = 1 + eps_x:
  (1) max(c)/min(c) <= r_c and max(m)/min(m) <= r_m over its GPUs, and all its nodes hold equally many of its
      GPUs (R1);
  (2) max(b)/min(b) <= r_i over the intra-node bandwidths b of its GPUs;
  (3) inter-node proximity: for nodes u != v of I and any node w holding none of I's GPUs,
      e(u, w) / e(u, v) <= r_n -- links leaving an island are no faster than its own links (the paper's (3) is
      eps_n = 0; a tolerance keeps measured, noisy figures of one fabric from splitting islands at random);
  (4) inter-node parity (beyond the paper): max/min of e(u, v) over node pairs of I <= r_n, so an island never
      spans two fabrics joined by a slow link: its homogeneous parallelizer sees one inter-node bandwidth.
A GPU g'' outside I on a node of I is reached over a link of I (or inside its node), not a link leaving I, so (3)
quantifies over nodes without GPUs of I.

Construction. Each node's GPUs are split into parts of alike GPUs (first fit, in index order). Nodes with the
same fabrics, the same GPUs and no pair override are interchangeable for every constraint above, so they are
grouped into *units*; a *block* is one part position across a unit's nodes. Links are tabulated once between
units (U x U arrays): U counts distinct (fabric memberships, node kind) plus nodes with pair overrides, not
nodes, so fabric-described clusters cost near-linear time in nodes (benchmarks/bench_islands.py). Then:
  a. every block whose unit is valid alone is an island; a unit that is not (a link leaving it is faster than
     its own) is cut into one-node units, and one node's part is always valid;
  b. block pairs are visited by bandwidth between them, fastest first (ties: strongest GPUs, then file order),
     leaving out pairs no island could hold (same node, other GPU count, figures out of tolerance); the islands
     holding the two blocks are merged when their union satisfies (1)-(4) and R1; passes repeat until one pass
     merges nothing.
Why it terminates: every merge removes one island, so there are at most B - 1 merges over B blocks, and a pass
without a merge ends the loop (at most B passes of finitely many pairs).
Why (1)-(4) hold: every island of step a is valid, and a merge happens only after the union is checked against
(1)-(4) and R1. (3) and (4) depend on nothing but the island's own node set and the fixed link table -- "outside"
is every node not in the island, whatever islands those nodes end in -- so later merges of other islands cannot
invalidate an island that was checked. (The earlier construction checked split-off pieces against a stale
outside and so returned islands violating (3).)
Which maximality: pairwise. The last pass visited, for every two islands, a pair of their blocks and found the
union invalid -- or left the pair out because the two blocks alone already violate (1), (2) or R1 or share a node,
and so does any union holding them. So no union of two returned islands is an island, and ``separations`` names,
for every pair, the first constraint their union violates (in the order (1), (2), R1, (4), (3)): the explanation
is the proof, and ``build_islands`` asserts it. It is not a minimum number of islands (a larger set could still be valid).
Deterministic: nodes in file order, GPUs in index order, no iteration over hashed sets.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from tangram_launch.errors import SpecError
from tangram_launch.specs.cluster import ClusterSpec, GPUSpec, GpuRef, LinkSpec, NodeHostMemory, math_mode
from tangram_launch.specs.gemm_sweep import SWEEP_KEY, slowest_sweep


@dataclass(frozen=True)
class IslandTolerances:
    """eps = (eps_c, eps_m, eps_i, eps_n).

    Defaults: identical GPUs measure within a few per cent of each other (profiler noise, clocks), while GPU
    generations differ by >= 1.5x in compute (V100 125 vs A100 312 TFLOP/s) and memory variants by >= 1.17x
    (H100 80 vs NVL 94 GiB); NVLink and PCIe differ by >= 4x. So 15 % / 10 % / 25 % keep twins together and
    generations and memory variants apart. Node-to-node fabrics differ by >= 2x (25 GbE 3.1, 100 GbE 12.5,
    InfiniBand HDR 25, NDR 50 GB/s) while one fabric's measured pairs spread by a few per cent (~10 % under
    load): eps_n = 25 % keeps a fabric's nodes together and splits fabrics joined by slower links.
    """

    compute: float = 0.15
    memory: float = 0.10
    interconnect: float = 0.25
    network: float = 0.25  # eps_n: inter-node proximity (3) and parity (4)

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "interconnect", "network"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise SpecError("tolerance must be a number >= 0", field=f"tolerances.{name}", value=v)


def compute_tflops(gpu: GPUSpec, dtype: str = "bf16") -> float:
    """Compute capacity c_g: measured GEMM throughput when profiled, else the dense peak; falls back to fp16/fp32
    for GPUs without the dtype (T4/V100 have no bf16) so islands are defined on every cluster; tf32 is priced in
    the GPU's math mode (TF32 where it has it, else FP32)."""
    measured = gpu.measured.get("gemm_tflops") if gpu.measured else None
    for d in (math_mode(gpu, dtype), "fp16", "fp32"):
        if isinstance(measured, dict) and measured.get(d):
            return float(measured[d])
        if gpu.tflops.get(d):
            return float(gpu.tflops[d])
    raise SpecError("GPU has no throughput figure", field="tflops", value=dict(gpu.tflops))


@dataclass(frozen=True)
class Island:
    name: str
    nodes: tuple[str, ...]
    gpus: tuple[GpuRef, ...]
    gpus_per_node: int
    gpu: GPUSpec  # conservative representative: element-wise minimum of its GPUs' figures
    inter_node_link: LinkSpec | None  # slowest link between its nodes; None on one node
    # its node with the least host RAM per GPU (offloaded optimizer state must fit there); None: none gives it
    host_memory: NodeHostMemory | None = None
    # slowest link from its nodes to any node outside it: what a collective with a stage on another island crosses
    # (the tied-embedding gradients between the first and the last stage); None: the island holds every node
    egress_link: LinkSpec | None = None

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
            "intra_node_bandwidth_GBps": self.gpu.intra_node_bandwidth_GBps,
            "inter_node_bandwidth_GBps": self.inter_node_link.bandwidth_GBps if self.inter_node_link else None,
            # the node an offloaded optimizer's host state is checked against (costmodel/host_memory.py); None: unknown
            "host_memory": None if self.host_memory is None else {
                "node": self.host_memory.node, "host_memory_gib": self.host_memory.host_memory_gib,
                "gib_per_gpu": round(self.host_memory.gib_per_gpu, 3)},
            "gpus": [str(g) for g in self.gpus],
        }


@dataclass(frozen=True)
class Separation:
    """Why two islands were not merged: the first constraint that fails between them, with the numbers."""

    island_a: str
    island_b: str
    constraint: str  # "(1) compute" | "(1) memory" | "(1) GPUs per node" | "(2) intra-node" | "(3) inter-node"
    #                  | "(4) inter-node parity"
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
                           "interconnect": self.tolerances.interconnect, "network": self.tolerances.network},
            "islands": [i.to_dict(dtype) for i in self.islands],
            "separations": [s.to_dict() for s in self.separations],
        }


# --- GPU figures ------------------------------------------------------------------------------------------------
_FIGURES = (("(1) compute", "TFLOP/s", "compute"), ("(1) memory", "GiB", "memory"),
            ("(2) intra-node", "GB/s intra-node", "interconnect"))


@dataclass(frozen=True)
class _Span:
    """Least and greatest value of one figure over a set of GPUs, with the GPU type holding each."""

    lo: float
    lo_type: str
    hi: float
    hi_type: str

    def join(self, other: "_Span") -> "_Span":
        lo = self if self.lo <= other.lo else other
        hi = self if self.hi >= other.hi else other
        return _Span(lo.lo, lo.lo_type, hi.hi, hi.hi_type)


def _gpu_spans(gpu: GPUSpec, dtype: str) -> tuple[_Span, _Span, _Span]:
    figs = (compute_tflops(gpu, dtype), gpu.memory_gib, gpu.intra_node_bandwidth_GBps)
    return tuple(_Span(float(v), gpu.type, float(v), gpu.type) for v in figs)  # type: ignore[return-value]


def _join(a: tuple[_Span, ...], b: tuple[_Span, ...]) -> tuple[_Span, ...]:
    return tuple(x.join(y) for x, y in zip(a, b))


def _figure_failure(a: tuple[_Span, ...], b: tuple[_Span, ...], tol: IslandTolerances) -> tuple[str, str] | None:
    """First of (1) compute, (1) memory, (2) intra-node that GPU sets a and b (each within tolerance) violate
    together. max/min over the union is the worst pair, so this equals checking every pair of GPUs."""
    for (constraint, unit, name), x, y in zip(_FIGURES, a, b):
        limit = 1 + getattr(tol, name)
        ratio = max(x.hi, y.hi) / min(x.lo, y.lo)
        if ratio > limit:
            # a and b are each within tolerance, so the extremes come from different sides
            (ta, va), (tb, vb) = ((x.hi_type, x.hi), (y.lo_type, y.lo)) if x.hi >= y.hi else \
                ((x.lo_type, x.lo), (y.hi_type, y.hi))
            return constraint, f"{ta} {va:g} vs {tb} {vb:g} {unit}: ratio {ratio:.2f} > {limit:g}"
    return None


@dataclass
class _Part:
    """GPUs of one node that are alike: local indices and their figure spans."""

    local: list[int]
    spans: tuple[_Span, ...]


def _node_parts(gpus: tuple[GPUSpec, ...], tol: IslandTolerances, dtype: str, cache: dict) -> list[_Part]:
    """First fit in index order: a GPU joins the first part of its node it is within tolerance of."""
    def spans_of(g: GPUSpec) -> tuple[_Span, ...]:
        hit = cache.get(id(g))
        if hit is None:
            hit = cache[id(g)] = (g, _gpu_spans(g, dtype))  # keep g alive so its id stays unique
        return hit[1]

    if all(g is gpus[0] for g in gpus):  # 'gpu: x, count: n' nodes share one GPUSpec: one part, no comparisons
        return [_Part(list(range(len(gpus))), spans_of(gpus[0]))]
    parts: list[_Part] = []
    for li, g in enumerate(gpus):
        spans = spans_of(g)
        for p in parts:
            if _figure_failure(p.spans, spans, tol) is None:
                p.local.append(li)
                p.spans = _join(p.spans, spans)
                break
        else:
            parts.append(_Part([li], spans))
    return parts


# --- link table between units -------------------------------------------------------------------------------------
class _Links:
    """Node-to-node links tabulated between units (sets of interchangeable nodes).

    ``bw[G, H]``: bandwidth between any node of G and any node of H (G != H), and between two nodes of G on the
    diagonal (unused for one-node units); ``lat`` likewise. The same choice as ``ClusterSpec.link``: a pair
    override, else the fastest shared fabric (ties: lower latency), else the default.
    """

    def __init__(self, cluster: ClusterSpec, unit_nodes: list[list[int]], unit_fabrics: list[tuple[int, ...]],
                 node_unit: list[int]) -> None:
        n_units = len(unit_nodes)
        self.unit_nodes = unit_nodes
        self.names = cluster.node_names
        self.size = np.array([len(u) for u in unit_nodes])
        bw = np.full((n_units, n_units), float(cluster.default_link.bandwidth_GBps))
        lat = np.full((n_units, n_units), float(cluster.default_link.latency_us))
        members: list[list[int]] = [[] for _ in cluster.fabrics]
        for g, fabs in enumerate(unit_fabrics):
            for f in fabs:
                members[f].append(g)
        # slowest first, so the fastest shared fabric is written last (stable sort: ties keep file order, and
        # equal keys carry equal figures)
        order = sorted(range(len(cluster.fabrics)), key=lambda f: (cluster.fabrics[f].link.bandwidth_GBps,
                                                                   -cluster.fabrics[f].link.latency_us))
        for f in order:
            if members[f]:
                idx = np.ix_(members[f], members[f])
                bw[idx] = cluster.fabrics[f].link.bandwidth_GBps
                lat[idx] = cluster.fabrics[f].link.latency_us
        index = {name: i for i, name in enumerate(self.names)}
        for pair, link in cluster.pair_links.items():
            a, b = (node_unit[index[x]] for x in pair)
            bw[a, b] = bw[b, a] = link.bandwidth_GBps
            lat[a, b] = lat[b, a] = link.latency_us
        one = self.size == 1
        self.bw = bw
        self.lat = lat
        self.inner_bw = bw.copy()  # for minima over an island's own links: no diagonal on one-node units
        self.inner_bw[one, one] = np.inf
        self.inner_lat = lat.copy()
        self.inner_lat[one, one] = -np.inf

    def node(self, unit: int, k: int = 0) -> str:
        return self.names[self.unit_nodes[unit][k]]

    def own_link(self, units: np.ndarray) -> LinkSpec | None:
        """Slowest bandwidth and greatest latency over the links between the nodes of these units."""
        if self.size[units].sum() < 2:
            return None
        return LinkSpec(float(self.inner_bw[units[:, None], units].min()),
                        float(self.inner_lat[units[:, None], units].max()))

    def egress_link(self, units: np.ndarray) -> LinkSpec | None:
        """Slowest bandwidth and greatest latency over the links from a node of these units to any other node."""
        others = np.setdiff1d(np.arange(len(self.unit_nodes)), units)
        if not others.size:
            return None
        return LinkSpec(float(self.bw[units[:, None], others].min()), float(self.lat[units[:, None], others].max()))

    def own_span(self, g: int) -> tuple[tuple[float, int, int], tuple[float, int, int]]:
        """(slowest, fastest) link among unit g's own nodes, each with the unit pair it lies on; for one node the
        empty span (inf, -inf)."""
        if self.size[g] < 2:
            return (np.inf, g, g), (-np.inf, g, g)
        v = float(self.bw[g, g])
        return (v, g, g), (v, g, g)

    def cross_span(self, a: np.ndarray, b: np.ndarray) -> tuple[tuple[float, int, int], tuple[float, int, int]]:
        """(slowest, fastest) link between a node of units a and a node of units b, with the unit pair."""
        if a.size == 1 and b.size == 1:  # the common case while merging: one value, no array
            v = float(self.bw[a[0], b[0]])
            return (v, int(a[0]), int(b[0])), (v, int(a[0]), int(b[0]))
        sub = self.bw[a[:, None], b]
        i, j = np.unravel_index(int(np.argmin(sub)), sub.shape)
        k, m = np.unravel_index(int(np.argmax(sub)), sub.shape)
        return (float(sub[i, j]), int(a[i]), int(b[j])), (float(sub[k, m]), int(a[k]), int(b[m]))

    def pair_name(self, g: int, h: int) -> str:
        return f"{self.node(g)}<->{self.node(h, 1 if g == h else 0)}"

    def proximity_failure(self, units: np.ndarray, inside: np.ndarray, tol: IslandTolerances) -> tuple[str, str] | None:
        """(3) for the island on these units (``inside``: their mask): no node's link to a node outside is more
        than 1 + eps_n times faster than its slowest link inside. None when it holds."""
        if self.size[units].sum() < 2:
            return None  # one node: (3) quantifies over pairs of its nodes
        outside = np.flatnonzero(~inside)
        if not outside.size:
            return None
        limit = 1 + tol.network
        own = self.inner_bw[units[:, None], units]
        own_min = own.min(axis=1)  # each unit's slowest link inside
        leaving = self.bw[units[:, None], outside]
        out_max = leaving.max(axis=1)
        ratio = out_max / own_min
        k = int(np.argmax(ratio))
        if ratio[k] <= limit:
            return None
        g = int(units[k])
        w = int(outside[int(np.argmax(leaving[k]))])
        h = int(units[int(np.argmin(own[k]))])
        return "(3) inter-node", (f"{self.pair_name(g, w)} leaves the island at {out_max[k]:g} GB/s, faster than "
                                  f"{self.pair_name(g, h)} inside at {own_min[k]:g} GB/s: ratio {ratio[k]:.2f} > "
                                  f"{limit:g}")


# --- construction ------------------------------------------------------------------------------------------------
@dataclass
class _Group:
    """An island under construction: its blocks, units (as a mask too), GPU spans, GPUs per node, and the span
    of its own links (slowest, fastest; each with a unit pair that carries it)."""

    blocks: list[int]
    units: np.ndarray
    inside: np.ndarray
    spans: tuple[_Span, ...]
    per_node: int
    link_lo: tuple[float, int, int]
    link_hi: tuple[float, int, int]
    name: str = ""
    unit_set: frozenset = frozenset()  # the units again, for disjointness; derived in __post_init__

    def __post_init__(self) -> None:
        self.unit_set = frozenset(self.units.tolist())


def _union_links(a: _Group, b: _Group, links: _Links) -> tuple[tuple[float, int, int], tuple[float, int, int]]:
    lo, hi = links.cross_span(a.units, b.units)
    return min(a.link_lo, b.link_lo, lo, key=lambda t: t[0]), max(a.link_hi, b.link_hi, hi, key=lambda t: t[0])


def _union_failure(a: _Group, b: _Group, links: _Links, tol: IslandTolerances) -> tuple[str, str] | None:
    """The first constraint the union of two islands violates, in the order (1), (2), R1, (4), (3): parity is
    cheap from the two islands' link spans and the links between them, proximity needs every link leaving."""
    fail = _figure_failure(a.spans, b.spans, tol)
    if fail is not None:
        return fail
    if a.per_node != b.per_node:
        return "(1) GPUs per node", (f"{a.name} has {a.per_node} GPUs per node, {b.name} has {b.per_node} "
                                     f"(R1: an island's nodes hold equally many GPUs)")
    if not a.unit_set.isdisjoint(b.unit_set):
        return "(1) GPUs per node", "parts of the same node cannot join one island twice"
    lo, hi = _union_links(a, b, links)
    limit = 1 + tol.network
    if hi[0] / lo[0] > limit:
        return "(4) inter-node parity", (f"its links would range from {lo[0]:g} GB/s ({links.pair_name(*lo[1:])}) "
                                          f"to {hi[0]:g} GB/s ({links.pair_name(*hi[1:])}): ratio "
                                          f"{hi[0] / lo[0]:.2f} > {limit:g}")
    return links.proximity_failure(np.concatenate([a.units, b.units]), a.inside | b.inside, tol)


def _merge(a: _Group, b: _Group, links: _Links) -> _Group:
    lo, hi = _union_links(a, b, links)
    return _Group(a.blocks + b.blocks, np.concatenate([a.units, b.units]), a.inside | b.inside,
                  _join(a.spans, b.spans), a.per_node, lo, hi)


_TIME_SUFFIXES = ("_s", "_ms", "_us", "_ns")  # measured durations: larger is slower


def _min_measured(all_measured: list, *, times: bool = False) -> dict:
    """Conservative measured figures of a group: of every number every GPU has (also inside nested mappings such
    as gemm_tflops per dtype), the slowest: the minimum of a rate, the maximum of a duration (keys ending in _s,
    _ms, _us, _ns, such as layer_forward_s or collective_latency_us: the fastest GPU's layer time would cost the whole
    island at its speed); figures some GPUs lack are dropped rather than guessed."""
    if not all_measured or not all(all_measured):
        return {}
    out: dict = {}
    for key in all_measured[0]:
        vals = [m.get(key) for m in all_measured]
        is_time = times or str(key).endswith(_TIME_SUFFIXES)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = max(vals) if is_time else min(vals)
        elif key == SWEEP_KEY and all(isinstance(v, dict) for v in vals):  # rows [m, n, k, TFLOP/s] per dtype
            out[key] = slowest_sweep(vals)
        elif all(isinstance(v, dict) for v in vals):
            nested = _min_measured(vals, times=is_time)
            if nested:
                out[key] = nested
    return out


def _min_gpu(gpus: list[GPUSpec]) -> GPUSpec:
    types = Counter(g.type for g in gpus)
    gpus = list({id(g): g for g in gpus}.values())  # nodes given as 'gpu: x, count: n' share one GPUSpec
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
        memory_bandwidth_GBps=min(g.memory_bandwidth_GBps for g in gpus),
        intra_node_bandwidth_GBps=min(g.intra_node_bandwidth_GBps for g in gpus),
        measured=measured,
    )


def _make_units(cluster: ClusterSpec, node_parts: list[list[_Part]], cache: dict, tol: IslandTolerances) -> _Links:
    """Group interchangeable nodes (same fabrics, same GPUs, no pair override) into units and tabulate their
    links; a unit that is not an island by itself (a link leaving it is faster than its own) is cut into nodes."""
    node_fabrics: list[list[int]] = [[] for _ in cluster.nodes]
    index = {name: i for i, name in enumerate(cluster.node_names)}
    for f, fabric in enumerate(cluster.fabrics):
        for name in fabric.nodes:
            node_fabrics[index[name]].append(f)
    overridden = {index[x] for pair in cluster.pair_links for x in pair}

    def key(i: int, alone: set[int]) -> tuple:
        if i in alone or i in overridden:
            return ("node", i)
        gpus = cluster.nodes[i].gpus
        distinct = gpus[:1] if all(g is gpus[0] for g in gpus) else gpus
        figures = tuple((g.type,) + tuple(s.lo for s in cache[id(g)][1]) for g in distinct)
        return ("kind", tuple(node_fabrics[i]), len(gpus), figures)

    def tabulate(alone: set[int]) -> _Links:
        keys: dict[tuple, int] = {}
        node_unit = [keys.setdefault(key(i, alone), len(keys)) for i in range(len(cluster.nodes))]
        unit_nodes: list[list[int]] = [[] for _ in keys]
        for i, g in enumerate(node_unit):
            unit_nodes[g].append(i)
        return _Links(cluster, unit_nodes, [tuple(node_fabrics[nodes[0]]) for nodes in unit_nodes], node_unit)

    links = tabulate(set())
    alone: set[int] = set()
    for g, nodes in enumerate(links.unit_nodes):
        if len(nodes) > 1:
            inside = np.zeros(len(links.unit_nodes), dtype=bool)
            inside[g] = True
            if links.proximity_failure(np.array([g]), inside, tol) is not None:
                alone.update(nodes)
    return tabulate(alone) if alone else links


def _candidate_pairs(groups: list[_Group], links: _Links, tol: IslandTolerances) -> list[tuple[int, int]]:
    """Block pairs (indices into the one-block ``groups``) by bandwidth between them, fastest first, then by
    block order. Left out: pairs no island can hold -- same node, other GPUs per node, or figures out of
    tolerance (any island holding both blocks holds their GPUs); islands holding them are apart anyway."""
    block_unit = np.array([int(g.units[0]) for g in groups], dtype=np.int64)
    first, second = np.triu_indices(len(groups), 1)
    keep = block_unit[first] != block_unit[second]
    per_node = np.array([g.per_node for g in groups])
    keep &= per_node[first] == per_node[second]
    for k, (_, _, name) in enumerate(_FIGURES):
        lo = np.array([g.spans[k].lo for g in groups])
        hi = np.array([g.spans[k].hi for g in groups])
        keep &= np.maximum(hi[first], hi[second]) / np.minimum(lo[first], lo[second]) <= 1 + getattr(tol, name)
    first, second = first[keep], second[keep]
    order = np.lexsort((second, first, -links.bw[block_unit[first], block_unit[second]]))
    return list(zip(first[order].tolist(), second[order].tolist()))


def _merge_until_stable(groups: list[_Group], pairs: list[tuple[int, int]], links: _Links,
                        tol: IslandTolerances) -> list[_Group]:
    """Step b: merge the islands holding each pair's blocks when their union is an island; repeat until a pass
    merges nothing. Returns the final islands in block order (block k starts as ``groups[k]``)."""
    groups = list(groups)
    owner = list(range(len(groups)))  # block -> index of the island holding it (indices are never reused)
    merged = True
    while merged:
        merged = False
        seen: set[tuple[int, int]] = set()  # island pairs already compared in this pass
        for x, y in pairs:
            a, b = owner[x], owner[y]
            if a == b or (a, b) in seen:
                continue
            seen.add((a, b))
            seen.add((b, a))
            if _union_failure(groups[a], groups[b], links, tol) is None:
                groups.append(_merge(groups[a], groups[b], links))
                for blk in groups[-1].blocks:
                    owner[blk] = len(groups) - 1
                merged = True
    final = sorted(set(owner), key=lambda gid: min(groups[gid].blocks))
    return [groups[gid] for gid in final]


def build_islands(cluster: ClusterSpec, tolerances: IslandTolerances | None = None, *,
                  dtype: str = "bf16") -> IslandSet:
    """Group the cluster's GPUs into islands satisfying (1)-(4); see the module docstring for the proofs."""
    tol = tolerances or IslandTolerances()
    cache: dict = {}
    node_parts = [_node_parts(node.gpus, tol, dtype, cache) for node in cluster.nodes]
    links = _make_units(cluster, node_parts, cache, tol)

    # blocks: part position p across a unit's nodes, strongest first (ties: file order); step a
    blocks = [(g, p) for g, nodes in enumerate(links.unit_nodes) for p in range(len(node_parts[nodes[0]]))]

    def strength(block: tuple[int, int]) -> tuple:
        node = links.unit_nodes[block[0]][0]
        first = cluster.nodes[node].gpus[node_parts[node][block[1]].local[0]]
        return (-compute_tflops(first, dtype), -first.memory_gib, node, block[1])

    blocks.sort(key=strength)
    groups: list[_Group] = []
    for k, (g, p) in enumerate(blocks):
        inside = np.zeros(len(links.unit_nodes), dtype=bool)
        inside[g] = True
        part = node_parts[links.unit_nodes[g][0]][p]
        groups.append(_Group([k], np.array([g]), inside, part.spans, len(part.local), *links.own_span(g)))
    kept = _merge_until_stable(groups, _candidate_pairs(groups, links, tol), links, tol)

    members_of = [sorted((node, blocks[k][1]) for k in grp.blocks for node in links.unit_nodes[blocks[k][0]])
                  for grp in kept]
    reps = [_min_gpu([cluster.nodes[i].gpus[li] for i, p in m for li in node_parts[i][p].local]) for m in members_of]
    base_count = Counter(rep.type for rep in reps)
    seen_type: Counter = Counter()
    islands: list[Island] = []
    for grp, members, rep in zip(kept, members_of, reps):
        seen_type[rep.type] += 1
        grp.name = rep.type if base_count[rep.type] == 1 else f"{rep.type}-{seen_type[rep.type]}"
        nodes = tuple(cluster.nodes[i].name for i, _ in members)
        gpus = tuple(GpuRef(cluster.nodes[i].name, li) for i, p in members for li in node_parts[i][p].local)
        islands.append(Island(name=grp.name, nodes=nodes, gpus=gpus, gpus_per_node=grp.per_node, gpu=rep,
                              inter_node_link=links.own_link(grp.units),
                              host_memory=least_host_memory(cluster, [i for i, _ in members]),
                              egress_link=links.egress_link(grp.units)))
    separations = []
    for i, a in enumerate(kept):
        for b in kept[i + 1:]:
            fail = _union_failure(a, b, links, tol)
            assert fail is not None, f"islands {a.name} and {b.name} could be merged: construction not maximal"
            separations.append(Separation(a.name, b.name, fail[0], fail[1]))
    return IslandSet(tuple(islands), tuple(separations), tol)


def least_host_memory(cluster: ClusterSpec, node_indices) -> NodeHostMemory | None:
    """Of the given nodes, the one with the least host RAM per GPU (a stage may be placed on any of them); None
    where none gives its host memory. A node without the figure is not checked (unknown is not small)."""
    known = [h for i in dict.fromkeys(node_indices) if (h := cluster.nodes[i].host_memory()) is not None]
    return min(known, key=lambda h: h.gib_per_gpu) if known else None


def _host_cell(host: NodeHostMemory | None) -> str:
    """The islands table's host-memory cell: GiB per GPU of the tightest node, and which node ('-': unknown)."""
    return "-" if host is None else f"{host.gib_per_gpu:.4g} ({host.node})"


def node_ranges(names: tuple[str, ...]) -> str:
    """Node names as ranges: h100-0 ... h100-63 -> h100-[0-63]; names without a trailing number stay as they are.
    Groups keep the order of their first node; numbers with leading zeros are not merged."""
    groups: dict[str, list[int]] = {}
    order: list[tuple[str, str | None]] = []
    for name in names:
        m = re.fullmatch(r"(.*?)(0|[1-9][0-9]*)", name)
        if m is None:
            order.append((name, None))
            continue
        prefix = m.group(1)
        if prefix not in groups:
            groups[prefix] = []
            order.append((prefix, prefix))
        groups[prefix].append(int(m.group(2)))
    out = []
    for text, prefix in order:
        if prefix is None:
            out.append(text)
            continue
        nums = sorted(groups[prefix])
        if len(nums) == 1:
            out.append(f"{prefix}{nums[0]}")
            continue
        spans, start = [], nums[0]
        for prev, cur in zip(nums, nums[1:] + [None]):
            if cur != prev + 1 if cur is not None else True:
                spans.append(f"{start}" if start == prev else f"{start}-{prev}")
                start = cur
        out.append(f"{prefix}[{','.join(spans)}]")
    return ",".join(out)


def format_islands_table(iset: IslandSet, dtype: str = "bf16", *, max_reasons: int = 40) -> str:
    """Human-readable table of islands and why they are apart. Past ``max_reasons`` island pairs, the reasons are
    counted by constraint with one example each (``--format json`` lists every pair)."""
    # host RAM per GPU of the island's tightest node, where the cluster file gives any (what offload must fit in)
    host = any(isl.host_memory is not None for isl in iset.islands)
    rows = [("island", "gpu", "nodes", "gpus", "TFLOP/s", "mem GiB", "intra GB/s", "inter GB/s")
            + (("host GiB/GPU",) if host else ())]
    for isl in iset.islands:
        d = isl.to_dict(dtype)
        rows.append((isl.name, isl.gpu.type, node_ranges(isl.nodes), f"{isl.num_nodes}x{isl.gpus_per_node}",
                     f"{d['compute_tflops']:g}", f"{isl.gpu.memory_gib:g}", f"{isl.gpu.intra_node_bandwidth_GBps:g}",
                     "-" if isl.inter_node_link is None else f"{isl.inter_node_link.bandwidth_GBps:g}")
                    + ((_host_cell(isl.host_memory),) if host else ()))
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    eps = iset.tolerances
    lines.insert(0, f"islands (eps_c={eps.compute:g}, eps_m={eps.memory:g}, eps_i={eps.interconnect:g}, "
                    f"eps_n={eps.network:g}):")
    if iset.separations:
        lines.append("")
        seps = iset.separations
        if len(seps) <= max_reasons:
            lines.append("why apart:")
            lines.extend(f"  {s.island_a} / {s.island_b}: {s.constraint}: {s.detail}" for s in seps)
        else:
            lines.append(f"why apart ({len(seps)} island pairs; --format json lists each):")
            by_constraint: dict[str, list[Separation]] = {}
            for s in seps:
                by_constraint.setdefault(s.constraint, []).append(s)
            for constraint, group in by_constraint.items():
                s = group[0]
                lines.append(f"  {constraint}: {len(group)} pairs, e.g. {s.island_a} / {s.island_b}: {s.detail}")
    return "\n".join(lines)
