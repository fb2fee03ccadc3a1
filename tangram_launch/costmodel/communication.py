"""Collective and point-to-point communication times with the nccl-tests bus-bandwidth conventions.

nccl-tests (NVIDIA, doc/PERFORMANCE.md) defines, for a buffer of S bytes over n ranks, the algorithm bandwidth
algbw = S / t and the bus bandwidth busbw = algbw x factor, where factor is what a ring moves over the slowest link:

    all-reduce                 2 (n - 1) / n      (reduce-scatter then all-gather)
    reduce-scatter, all-gather (n - 1) / n        (S = the whole gathered buffer)
    all-to-all                 (n - 1) / n        (S = one rank's send buffer)
    send/recv, broadcast       1

busbw is then independent of n and equals the link bandwidth a perfect ring achieves, so the time of a collective
is t = S x factor / busbw (+ a latency term alpha per ring step). ``busbw`` comes from the profiler when measured
(``allreduce_busbw_gbps``, and a reduce-scatter's or all-gather's own where the profile timed it: gloo runs them well
below its all-reduce's), otherwise from the link's nominal bandwidth x an efficiency (efficiency.py).

Which link a group uses follows the plan's rank order inside a stage (plan.py: TP fastest, then CP, then DP, whole
stages tiling the island's GPUs node by node). A group whose ranks sit on one node uses the intra-node link; a group
spanning nodes is hierarchical: its members on one node talk over NVLink/PCIe, and the nodes over the island's
inter-node link, one network interface per node shared by all groups of the stage that cross it at the same time.

Hierarchical collectives. The bytes pass both levels, chunk after chunk (NCCL pipelines its rings and trees), so the
slower level sets the rate: a group of m members on each of M nodes, k groups per node, moves S x factor(n) over
min(intra busbw, NIC / k). A node's members need the same gathered buffer, so the interface carries it once per node
(the ring enters and leaves each node once), not once per GPU. The fixed cost follows NCCL's own latency model: of a
ring's steps, those crossing nodes (M - 1 per pass; two passes for an all-reduce) pay the inter-node latency, the
others the intra-node one.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tangram_launch.costmodel import boundary
from tangram_launch.costmodel.efficiency import GBPS, NET_EFFICIENCY, DeviceModel

ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
ALL_TO_ALL = "all_to_all"
SEND_RECV = "send_recv"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of a collective over ``n`` ranks."""
    if n <= 1:
        return 0.0
    if op == ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in (REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL):
        return (n - 1) / n
    if op == SEND_RECV:
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def ring_steps(op: str, n: int) -> int:
    """Steps of a ring collective over ``n`` ranks (two passes for an all-reduce)."""
    if n <= 1:
        return 0
    if op == ALL_REDUCE:
        return 2 * (n - 1)
    if op == SEND_RECV:
        return 1
    return n - 1


def inter_node_steps(op: str, nodes: int) -> int:
    """Steps of a ring collective that cross a node boundary, for a group spread over ``nodes`` nodes."""
    return ring_steps(op, nodes) if op != SEND_RECV else int(nodes > 1)


@dataclass(frozen=True)
class GroupLink:
    """The link a communication group sees: bus bandwidth (bytes/s), per-step latency, whether it leaves the node.
    A group spanning nodes pays ``latency_s`` (the network's) on the steps that cross nodes and
    ``intra_latency_s`` on the others (module docstring)."""

    busbw: float
    latency_s: float
    inter_node: bool = False
    nodes: int = 1
    wait_s: float = 0.0  # measured cost of one call after a layer's compute on every member (0: not measured)
    intra_latency_s: float = 0.0
    # a reduce-scatter's and an all-gather's own bus bandwidth where measured (0: ``busbw``), bytes/s
    reduce_scatter_busbw: float = 0.0
    all_gather_busbw: float = 0.0

    def busbw_of(self, op: str) -> float:
        """The bus bandwidth ``op`` runs at on this link."""
        own = {REDUCE_SCATTER: self.reduce_scatter_busbw, ALL_GATHER: self.all_gather_busbw}.get(op, 0.0)
        return own or self.busbw

    def step_latency_s(self, op: str, n: int) -> float:
        """The fixed cost of one collective over ``n`` ranks: its ring steps, each at its own level's latency."""
        steps = ring_steps(op, n)
        if not self.inter_node:
            return steps * self.latency_s
        crossing = min(steps, inter_node_steps(op, self.nodes))
        return crossing * self.latency_s + (steps - crossing) * self.intra_latency_s

    def call_s(self, op: str, n: int) -> float:
        """What one call costs whatever its size: its ring steps' latency, or the measured cost per call after
        compute where that is larger (collective_s)."""
        return max(self.step_latency_s(op, n), self.wait_s)

    def describe(self) -> str:
        where = f"{self.nodes} nodes" if self.inter_node else "intra-node"
        return f"{where}, {self.busbw / GBPS:.1f} GB/s bus bandwidth"


def collective_s(op: str, nbytes: float, n: int, link: GroupLink) -> float:
    """Time of one collective on ``nbytes`` (nccl-tests buffer size) over ``n`` ranks: S x factor / busbw + alpha
    per ring step at its level's latency, or the link's measured cost per call after compute where that is larger
    (``GroupLink.wait_s``: in a training step every collective follows some compute, and the members arrive at
    different times)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return nbytes * bus_factor(op, n) / link.busbw_of(op) + link.call_s(op, n)


@lru_cache(maxsize=4096)
def group_span(stride: int, size: int, stage_gpus: int, gpus_per_node: int) -> tuple[int, int, int]:
    """(nodes spanned, members per node, groups sharing a node's NIC) of a group of ``size`` ranks ``stride``
    apart, inside a stage of ``stage_gpus`` ranks laid node by node over ``gpus_per_node``-GPU nodes."""
    nodes: dict[int, int] = {}
    for k in range(size):
        node = (k * stride) // gpus_per_node
        nodes[node] = nodes.get(node, 0) + 1
    members = max(nodes.values())
    on_node = min(stage_gpus, gpus_per_node)  # ranks of this stage on one node
    return len(nodes), members, max(1, on_node // members)


def group_link(stride: int, size: int, *, stage_gpus: int, gpus_per_node: int, dev: DeviceModel,
               inter_bandwidth_GBps: float | None, inter_latency_us: float = 0.0) -> GroupLink:
    """The link of a TP/CP/DP/EP group (see the module docstring)."""
    nodes, _members, sharing = group_span(stride, size, stage_gpus, gpus_per_node)
    if nodes <= 1 or inter_bandwidth_GBps is None:
        return GroupLink(dev.intra_busbw, dev.intra_latency_s, wait_s=dev.collective_wait_s,
                         reduce_scatter_busbw=dev.reduce_scatter_busbw, all_gather_busbw=dev.all_gather_busbw)
    net = inter_bandwidth_GBps * GBPS * NET_EFFICIENCY / sharing
    rs, ag = (min(b, net) if b else 0.0 for b in (dev.reduce_scatter_busbw, dev.all_gather_busbw))
    return GroupLink(min(dev.intra_busbw, net), inter_latency_us * 1e-6, True, nodes,
                     intra_latency_s=dev.intra_latency_s, reduce_scatter_busbw=rs, all_gather_busbw=ag)


def p2p_stage_s(nbytes: float, *, stage_gpus: int, gpus_per_node: int, same_node: bool, dev: DeviceModel,
                inter_bandwidth_GBps: float | None, inter_latency_us: float = 0.0) -> float:
    """Send one micro-batch's activations (``nbytes`` in all) from one stage to the next inside an island: the
    stage-boundary p2p of costmodel/boundary.py for two stages of one grid laid node by node (each GPU sends its
    shard; inside a node over its own link, across nodes through the node's network interface)."""
    net = boundary.UniformNetwork(
        inter_bandwidth_GBps * GBPS * NET_EFFICIENCY if inter_bandwidth_GBps is not None else None,
        inter_latency_us * 1e-6, dev.intra_busbw, dev.intra_latency_s)
    return boundary.uniform_boundary_s(nbytes, stage_gpus, gpus_per_node, same_node, net)
