"""Stage-boundary p2p: the one-way time of one micro-batch's activations (or their gradients) from a stage to the next.

A micro-batch of B sequences is split over a stage's DP replicas (replica d holds sequences [d B/dp, (d + 1) B/dp)),
and inside a replica over its CP x TP ranks by token (sequence parallelism and Megatron's scatter-gather: rank
c tp + t holds token part c tp + t of tp cp). Rank order is plan.py's: tp fastest, then cp, then dp. Each sending
GPU sends each receiving GPU the rows both hold, so

- a boundary between two stages of the same grid is GPU i -> GPU i: DP replicas on n node pairs move in parallel,
  and 8 replicas on 8 node pairs take what 1 replica takes on 1 pair;
- across nodes, a node's network interface carries every transfer of the GPUs it hosts, out and in (each at its
  node pair's bandwidth): 8 replicas sharing one node's interface take 8x;
- inside a node, each GPU's own NVLink/PCIe link carries its transfers (and bounds its share of the network ones).

The time is the slowest network interface or GPU link, plus the latency of the slowest-starting link used. The
composer, the reference, hand-written plans and the parallelizers' stage-internal p2p all call ``boundary_s``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd
from typing import Hashable, Protocol, Sequence


@dataclass(frozen=True)
class Port:
    """One side of a boundary: a stage's grid and the node of each of its ranks (rank order)."""

    tp: int
    cp: int
    dp: int
    nodes: tuple[Hashable, ...]

    def __post_init__(self) -> None:
        if len(self.nodes) != self.tp * self.cp * self.dp:
            raise ValueError(f"a port of tp={self.tp} cp={self.cp} dp={self.dp} needs {self.tp * self.cp * self.dp} "
                             f"ranks' nodes, got {len(self.nodes)}")


class Network(Protocol):
    """The links a boundary may use (bytes/s one way, seconds)."""

    def link(self, a: Hashable, b: Hashable) -> tuple[float, float]:
        """Node a -> node b (a != b): (bandwidth, latency) of the pair, each node's interface carrying it."""

    def intra(self, node: Hashable) -> tuple[float, float]:
        """(bandwidth, latency) of one GPU's own NVLink/PCIe link inside ``node``."""


@dataclass(frozen=True)
class UniformNetwork:
    """Every node pair on one link, every GPU on one intra-node link (a parallelizer's view of its island)."""

    inter_bytes_per_s: float | None  # None: a one-node island
    inter_latency_s: float
    intra_bytes_per_s: float
    intra_latency_s: float

    def link(self, a: Hashable, b: Hashable) -> tuple[float, float]:
        if self.inter_bytes_per_s is None:
            return self.intra_bytes_per_s, self.intra_latency_s
        return self.inter_bytes_per_s, self.inter_latency_s

    def intra(self, node: Hashable) -> tuple[float, float]:
        return self.intra_bytes_per_s, self.intra_latency_s


@lru_cache(maxsize=4096)
def overlaps(n_a: int, n_b: int) -> tuple[tuple[int, int, float], ...]:
    """(i, j, fraction): where part i of n_a equal parts of [0, 1) meets part j of n_b (fraction of the whole)."""
    whole = n_a * n_b // gcd(n_a, n_b)
    step_a, step_b = whole // n_a, whole // n_b
    out = []
    i = j = pos = 0
    while i < n_a and j < n_b:
        end = min((i + 1) * step_a, (j + 1) * step_b)
        out.append((i, j, (end - pos) / whole))
        pos = end
        i += end == (i + 1) * step_a
        j += end == (j + 1) * step_b
    return tuple(out)


def shard_traffic(sender: Port, receiver: Port) -> list[tuple[int, int, float]]:
    """(sending rank, receiving rank, fraction of the micro-batch's boundary bytes) for every pair that moves any."""
    w_a, w_b = sender.tp * sender.cp, receiver.tp * receiver.cp
    tokens = overlaps(w_a, w_b)
    return [(d * w_a + s, e * w_b + r, f_seq * f_tok)
            for d, e, f_seq in overlaps(sender.dp, receiver.dp) for s, r, f_tok in tokens]


def boundary_s(nbytes: float, sender: Port, receiver: Port, net: Network) -> float:
    """One-way seconds of ``nbytes`` (the whole micro-batch's boundary activations) from ``sender`` to ``receiver``
    (the module docstring): max(slowest network interface, slowest GPU link) + the largest latency among the links
    used; within one node, the slowest GPU link + the intra-node latency."""
    if nbytes <= 0:
        return 0.0
    nic_out: dict = {}  # node -> seconds its interface sends
    nic_in: dict = {}
    gpu_out: dict = {}  # sending rank -> seconds on its own link
    gpu_in: dict = {}
    intra_latency_s = inter_latency_s = 0.0
    for i, j, frac in shard_traffic(sender, receiver):
        b = nbytes * frac
        u, v = sender.nodes[i], receiver.nodes[j]
        bw_u, lat_u = net.intra(u)
        bw_v, _lat = net.intra(v)
        gpu_out[i] = gpu_out.get(i, 0.0) + b / bw_u
        gpu_in[j] = gpu_in.get(j, 0.0) + b / bw_v
        if u == v:
            intra_latency_s = max(intra_latency_s, lat_u)
            continue
        bw, lat = net.link(u, v)
        inter_latency_s = max(inter_latency_s, lat)
        nic_out[u] = nic_out.get(u, 0.0) + b / bw
        nic_in[v] = nic_in.get(v, 0.0) + b / bw
    busy = max(max(gpu_out.values()), max(gpu_in.values()),
               max(nic_out.values(), default=0.0), max(nic_in.values(), default=0.0))
    latency_s = inter_latency_s if nic_out else intra_latency_s
    return busy + latency_s


def boundary_floor_s(nbytes: float, nodes_a: int, nodes_b: int, bandwidth: float, latency_s: float) -> float:
    """A floor under ``boundary_s`` for any two stages on disjoint node sets of ``nodes_a`` and ``nodes_b`` nodes,
    whose pairs reach at most ``bandwidth`` and start after ``latency_s`` at least: every byte leaves through some
    sending node's interface and enters through some receiving node's, so the busiest takes at least its even share.
    """
    if nbytes <= 0:
        return 0.0
    return nbytes / (min(nodes_a, nodes_b) * bandwidth) + latency_s


@lru_cache(maxsize=65536)
def uniform_boundary_s(nbytes: float, stage_gpus: int, gpus_per_node: int, same_node: bool,
                       net: UniformNetwork) -> float:
    """boundary_s between two stages of one grid of ``stage_gpus`` ranks laid node by node on ``gpus_per_node``-GPU
    nodes: in one node, or the sender's nodes followed by the receiver's (a slice plan's consecutive stages)."""
    if same_node or net.inter_bytes_per_s is None:
        nodes: tuple = (0,) * stage_gpus
        sender = receiver = Port(1, 1, stage_gpus, nodes)
    else:
        sender = Port(1, 1, stage_gpus, tuple(("a", k // gpus_per_node) for k in range(stage_gpus)))
        receiver = Port(1, 1, stage_gpus, tuple(("b", k // gpus_per_node) for k in range(stage_gpus)))
    return boundary_s(nbytes, sender, receiver, net)
