"""Where a slice plan's stages sit on its island, and what moving activations between stages costs.

GPU assignment is deterministic: an island is used by at most one slice plan, whose stages take the island's GPUs
in node order; each TP group (``tp`` consecutive ranks, plan.py's rank order) is placed inside one node, on the
first node with ``tp`` free GPUs. Because the assignment depends on the slice plan alone, the composer can cost the
p2p transfers inside a slice plan exactly before it knows the rest of the pipeline.

p2p between slice plans, per micro-batch and direction (activations forward, their gradients backward; links are
full duplex), is costmodel/boundary.py's ``boundary_s`` of the two stages at the boundary, on their GPUs: each DP
replica's rows (each TP/CP rank's share) over its own node pair, a node's network interface shared by the ranks it
hosts, NVLink/PCIe inside a node (``LinkModel.stage_s``). The composer's island matrix holds a floor under it
(``LinkModel.island_matrix``: the least any two stages of the two islands can take), which its pruning needs; the
Plan, the score the search ranks by, and hand-written plans use the exact boundary. p2p between the stages *inside*
a slice plan is the parallelizer's to cost (it knows how its stages tile the island) and is part of its stage times.
"""
from __future__ import annotations

import itertools

from typing import TYPE_CHECKING, Iterable, Sequence

from tangram_launch.costmodel import boundary
from tangram_launch.costmodel.efficiency import GBPS, NET_EFFICIENCY, intra_link
from tangram_launch.specs.cluster import ClusterSpec, GpuRef

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.capabilities import StageShape
    from tangram_launch.islands import Island


def allocate_gpus(island: "Island", shapes: Sequence["StageShape"],
                  taken: set | None = None) -> list[tuple[GpuRef, ...]] | None:
    """GPUs for each stage (in rank order: tp fastest, then cp, then dp), or None if they do not fit the island.

    ``taken``: GPUs already given to earlier stages (updated), for an island holding several slice plans' stages.
    """
    free: dict[str, list[GpuRef]] = {}
    for g in island.gpus:
        if taken is None or g not in taken:
            free.setdefault(g.node, []).append(g)
    order = list(free)
    first = 0  # nodes before this one are full
    out: list[tuple[GpuRef, ...]] = []
    for sh in shapes:
        stage: list[GpuRef] = []
        for _ in range(sh.dp * sh.cp):
            while first < len(order) and not free[order[first]]:
                first += 1
            node = next((order[i] for i in range(first, len(order)) if len(free[order[i]]) >= sh.tp), None)
            if node is None:
                return None
            stage.extend(free[node][:sh.tp])
            del free[node][:sh.tp]
        out.append(tuple(stage))
    if taken is not None:
        taken.update(g for stage in out for g in stage)
    return out


def node_sizes(island: "Island") -> tuple[int, ...]:
    """The island's GPUs per node (node order)."""
    counts: dict[str, int] = {}
    for g in island.gpus:
        counts[g.node] = counts.get(g.node, 0) + 1
    return tuple(counts.values())


def fits_island(island: "Island", shapes: Sequence["StageShape"], sizes: Sequence[int] | None = None) -> bool:
    """Whether ``allocate_gpus`` would place these stages on an empty island. Fast when every TP size divides
    every node's GPU count (``sizes``, from node_sizes): TP groups then tile the nodes and only the count matters."""
    need = sum(sh.tp * sh.dp * sh.cp for sh in shapes)
    if need > island.num_gpus:
        return False
    sizes = node_sizes(island) if sizes is None else sizes
    if all(n % tp == 0 for tp in {sh.tp for sh in shapes} for n in set(sizes)):
        return True
    return allocate_gpus(island, shapes) is not None


def activation_bytes(micro_batch_sequences: int, seq_len: int, hidden_size: int, dtype_bytes: int) -> float:
    """One micro-batch's hidden states between two stages: b x s x h values."""
    return float(micro_batch_sequences) * seq_len * hidden_size * dtype_bytes


class ClusterNetwork:
    """boundary.Network over a cluster spec: node pairs at their link's bandwidth x NET_EFFICIENCY (what NCCL
    achieves of line rate), each GPU on its NVLink/PCIe link (efficiency.intra_link: measured where profiled)."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        self._intra = {n.name: min((intra_link(g) for g in n.gpus), key=lambda x: x[0]) for n in cluster.nodes}
        self._links: dict[tuple[str, str], tuple[float, float]] = {}

    def link(self, a: str, b: str) -> tuple[float, float]:
        hit = self._links.get((a, b))
        if hit is None:
            spec = self.cluster.link(a, b)
            hit = self._links[(a, b)] = (spec.bandwidth_GBps * GBPS * NET_EFFICIENCY, spec.latency_us * 1e-6)
        return hit

    def intra(self, node: str) -> tuple[float, float]:
        return self._intra[node]


class LinkModel:
    """One-way p2p time of one micro-batch's activations at a stage boundary (exact), or between islands (floor)."""

    def __init__(self, cluster: ClusterSpec, islands: Sequence["Island"], act_bytes: float, *,
                 like: "LinkModel | None" = None) -> None:
        """``like``: another micro-batch size's model of the same cluster and islands, whose parts that do not
        depend on the activation bytes (the network, the fabric classes, each node pair's links) this one shares
        instead of building them again (the size loop asks for one model per divisor of the batch)."""
        if like is not None and (like.cluster is not cluster or like.islands != list(islands)):
            raise ValueError("like= must model the same cluster and islands")
        self.cluster = cluster
        self.islands = list(islands)
        self.act_bytes = act_bytes
        self.net = ClusterNetwork(cluster) if like is None else like.net
        self._cache: dict[tuple[frozenset, frozenset], float] = {}
        self._stage_cache: dict[tuple, float] = {}
        # node set pair -> _pair_terms (no activation bytes in them: shared with ``like``)
        self._terms: dict[tuple[frozenset, frozenset], tuple] = {} if like is None else like._terms
        self._fabrics_of: dict[str, frozenset] | None = None  # node -> indices of its fabrics (_special)
        self._node_gpus = {n.name: n.num_gpus for n in cluster.nodes}  # (ClusterSpec.node searches the list)
        self._overridden: frozenset = frozenset()

    def stage_s(self, shape_a: "StageShape", gpus_a: Sequence[GpuRef], shape_b: "StageShape",
                gpus_b: Sequence[GpuRef]) -> float:
        """boundary.boundary_s from a stage of ``shape_a`` on ``gpus_a`` (rank order) to one of ``shape_b``."""
        a = boundary.Port(shape_a.tp, shape_a.cp, shape_a.dp, tuple(g.node for g in gpus_a))
        b = boundary.Port(shape_b.tp, shape_b.cp, shape_b.dp, tuple(g.node for g in gpus_b))
        key = (a, b)
        hit = self._stage_cache.get(key)
        if hit is None:
            hit = self._stage_cache[key] = boundary.boundary_s(self.act_bytes, a, b, self.net)
        return hit

    def nodes_s(self, nodes_a: Iterable[str], nodes_b: Iterable[str]) -> float:
        """A floor under stage_s for any stage on nodes of ``nodes_a`` and any on nodes of ``nodes_b``
        (boundary.boundary_floor_s over their fastest link; through each GPU's own link where they share a node)."""
        key = (frozenset(nodes_a), frozenset(nodes_b))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._floor_s(*key)
        return hit

    def _floor_s(self, nodes_a: frozenset, nodes_b: frozenset) -> float:
        key = (nodes_a, nodes_b)
        terms = self._terms.get(key)
        if terms is None:
            terms = self._terms[key] = self._pair_terms(nodes_a, nodes_b)
        least_gpus, intra_bw, link_bw, latency_s = terms
        # each byte leaves through some sending GPU's own link and enters through a receiving GPU's
        busy = self.act_bytes / (least_gpus * intra_bw)
        if link_bw is not None:  # no node in both sets
            busy = max(busy, boundary.boundary_floor_s(self.act_bytes, len(nodes_a), len(nodes_b), link_bw, 0.0))
        return busy + latency_s

    def _pair_terms(self, nodes_a: frozenset, nodes_b: frozenset) -> tuple[int, float, float | None, float]:
        """What _floor_s reads of two node sets besides the activation bytes: the fewer GPUs of the two, the fastest
        GPU link among their nodes, the fastest link between them (None where they share a node) and the least
        latency (the same for every micro-batch size: LinkModel's ``like`` shares them)."""
        links = self.pair_links(nodes_a, nodes_b)
        gpus_a = sum(self._node_gpus[n] for n in nodes_a)
        gpus_b = sum(self._node_gpus[n] for n in nodes_b)
        shared = nodes_a & nodes_b
        intra = [self.net.intra(n) for n in nodes_a | nodes_b]
        link_bw = None if shared else max(bw for bw, _lat in links)
        latencies = [lat for _bw, lat in links] + [self.net.intra(n)[1] for n in shared]
        return min(gpus_a, gpus_b), max(bw for bw, _lat in intra), link_bw, min(latencies)

    def pair_links(self, nodes_a: frozenset, nodes_b: frozenset) -> set[tuple[float, float]]:
        """The (bandwidth, latency) of every link between a node of ``nodes_a`` and another node of ``nodes_b``,
        from one representative pair per class of alike pairs: nodes in the same fabrics with no pair override reach
        each other over the same link (ClusterSpec.link), so two pools of 512 nodes cost a few fabric-set pairs
        instead of 262,144 link lookups."""
        special = self._special()
        out: set[tuple[float, float]] = set()
        plain_a: dict[frozenset, str] = {}
        plain_b: dict[frozenset, str] = {}
        for nodes, plain in ((nodes_a, plain_a), (nodes_b, plain_b)):
            for n in nodes:
                if n in special:  # a pair override: each of its pairs apart
                    for o in (nodes_b if plain is plain_a else nodes_a):
                        if o != n:
                            out.add(self.net.link(n, o))
                else:
                    plain.setdefault(self._fabrics_of[n], n)
        for fa, a in plain_a.items():
            for fb, b in plain_b.items():
                if a != b:
                    out.add(self.net.link(a, b))
                else:  # the representatives coincide: another node of the class on either side stands for them
                    other = next((x for x in itertools.chain(nodes_b, nodes_a) if x != a and x not in special
                                  and self._fabrics_of[x] == fb), None)
                    if other is not None:  # (a is in both sets: other pairs with it across them)
                        out.add(self.net.link(a, other))
        return out

    def _special(self) -> frozenset:
        """Nodes named in a pair override; and, once, each node's set of fabrics (the classes pair_links uses)."""
        if self._fabrics_of is None:
            self._fabrics_of = {n.name: frozenset(i for i, f in enumerate(self.cluster.fabrics) if n.name in f.nodes)
                                for n in self.cluster.nodes}
            self._overridden = frozenset(x for pair in self.cluster.pair_links for x in pair)
        return self._overridden

    def island_s(self, a: int, b: int) -> float:
        return self.nodes_s(self.islands[a].nodes, self.islands[b].nodes)

    def island_matrix(self) -> tuple[tuple[float, ...], ...]:
        k = len(self.islands)
        return tuple(tuple(self.island_s(a, b) if a != b else 0.0 for b in range(k)) for a in range(k))
