"""Floors at one micro-batch size b: under any plan's closed form and predicted iteration (SizeFloor, size_floor:
a size whose floor cannot beat the best plan so far is skipped), and what the rest of any pipeline holding a
slice/island pair adds at least (outside_s, front_s, score_extra_s: taken off the bounds a pair's query carries).
planner/bounds.py lists them with why each is safe and the test that checks it."""
from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, NamedTuple, Sequence

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.parallelizers.base import Parallelizer, SliceQuery
from tangram_launch.planner import bounds
from tangram_launch.planner.allocation import LinkModel
from tangram_launch.planner.bounds import least_links
from tangram_launch.planner.interleave import MAX_VIRTUAL_STAGES, most_virtual_stages
from tangram_launch.planner.pair_floors import PairFloors, capacities, spread_behind_s
from tangram_launch.planner.slices import Pair, dtype_problem

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import Island
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec


class SizeFloor(NamedTuple):
    """Floors at one micro-batch size: under any plan's latency, and under the fill of any set of layers."""

    latency_s: float  # under the closed form
    score_s: float  # under the predicted iteration (m x the slowest stage at least)
    prefix_s: tuple[float, ...]  # prefix_s[i]: least forward + backward seconds of layers [0, i), any island/grid
    embedding_s: float
    head_s: float
    pairs: PairFloors | None = None  # per pair: under any pipeline holding it (pair_floors.py)
    # per island the least link into it and out of it at this size (least_links_at), where the driver gave them
    links: tuple[dict[int, float], dict[int, float]] | None = None
    # (closed form, predicted iteration) floors from where the layers run (spread_floors_s), tighter than the two
    # above with few micro-batches; only for skipping the size: the driver orders sizes by latency_s
    spread_s: tuple[float, float] = (0.0, 0.0)

    def beyond(self, latency_bound_s: float, score_bound_s: float) -> bool:
        """Whether no plan at this size can beat either bound (as SliceQuery.beyond_bound)."""
        return bounds.beyond(max(self.latency_s, self.spread_s[0]), max(self.score_s, self.spread_s[1]),
                             bounds.slack_cut(latency_bound_s), bounds.slack_cut(score_bound_s))

    def outside_s(self, start: int, stop: int) -> float:
        """Least fill of the layers (and embedding, head) outside [start, stop): what the rest of any pipeline
        holding this slice adds to its fill at least."""
        p = self.prefix_s
        out = p[start] + p[-1] - p[stop]
        if start > 0:
            out += self.embedding_s
        if stop < len(p) - 1:
            out += self.head_s
        return out


def least_links_at(links: LinkModel, present: Sequence[int]) -> tuple[dict[int, float], dict[int, float]]:
    """Per island of ``present``, the least one-way link into it and out of it from another, at the micro-batch
    size of ``links`` (bounds.least_links; 0 where there is no other)."""
    return least_links(links.island_matrix(), present, default=0.0)


def size_floor(b: int, *, model: "ModelSpec", training: "TrainingSpec", islands: Sequence["Island"],
               caps: RuntimeCapabilities, par: Parallelizer | None,
               links: tuple[dict[int, float], dict[int, float]] | None = None) -> SizeFloor:
    """Floors at micro-batch size b from the parallelizer's compute floors (``compute_floors``; all 0 for a
    parallelizer without them): every layer runs on some stage of n GPUs for at least its floor time, so the
    slowest of the stages takes at least the model's GPU-seconds over the usable GPUs' capacity (the period P of
    pair_floors.Capacity.period_s: GPUs, each island's counted at its slowdown against the least floors, the
    embedding and head at theirs), and one micro-batch through the pipeline at least the sum of the layers' floors:

        closed form >= (m - 1) x P + sum(seconds floors)
        predicted iteration >= max(m x P, sum(seconds floors))

    (the second term: bounds.chain_score_floor_s; with few micro-batches it skips sizes the first lets through).
    Where the parallelizer has bottleneck floors (``bottleneck_floors``: memory makes the stages in front recompute),
    P is at least the slowest stage of any placement of the L layers over the islands (spread_behind_s: every
    island but the last with a stage behind it).
    """
    L = model.num_layers
    none = SizeFloor(0.0, 0.0, (0.0,) * (L + 1), 0.0, 0.0, links=links)
    if not hasattr(par, "compute_floors"):
        return none
    best: dict[str, tuple[float, float]] = {}
    per_island: dict[int, dict[str, tuple[float, float]]] = {}
    bottlenecks: dict[int, dict[int, list[float]]] = {}  # island -> D -> par.bottleneck_floors
    for k, isl in enumerate(islands):
        if dtype_problem(isl, training.dtype) is not None:
            continue
        q = SliceQuery(model=model, training=training, layers=(0, L), island=isl, microbatch_sequences=b,
                       capabilities=caps, max_stages=caps.max_stages)
        floors = par.compute_floors(q)
        if not floors:
            continue
        per_island[k] = floors
        if hasattr(par, "bottleneck_floors"):
            tables = par.bottleneck_floors(q)
            if tables:
                bottlenecks[k] = tables
        for kind, (gs, ts) in floors.items():
            old = best.get(kind, (math.inf, math.inf))
            best[kind] = (min(old[0], gs), min(old[1], ts))
    kinds = [model.layer_kind(i) for i in range(L)]
    needed = {*kinds, "embedding", "head"}
    gpus = {k: islands[k].num_gpus for k in per_island}
    if not sum(gpus.values()) or any(k not in best for k in needed):
        return none
    layers_gs = sum(best[k][0] for k in kinds)
    edges_gs = best["embedding"][0] + best["head"][0]
    prefix = (0.0, *itertools.accumulate(best[k][1] for k in kinds))
    fill_s = prefix[-1] + best["embedding"][1] + best["head"][1]
    m = training.global_batch // b
    # per-pair floors need every island's floors for every kind (an island left out would lower the others' GPUs).
    # Every runtime: under deepspeed (no TP) queries are cheap, but every divisor of the global batch is a size, and
    # the pairs skipped at sizes far from the best plan's save their composition too. A skipped pair's every pipeline
    # has a closed form and a predicted iteration that cannot beat the bounds. (The Pareto composer takes every plan
    # whose score floor can beat the best score as a candidate: every example plan is the same with and without it.)
    pairs = (PairFloors(kinds, per_island, gpus, m, links, bottlenecks)
             if all(needed <= f.keys() for f in per_island.values()) else None)
    period_s = capacities(kinds, per_island, gpus).period_s(layers_gs, edges_gs)  # >= GPU-seconds / their GPUs
    if len(bottlenecks) == len(per_island):  # the slowest stage of the L layers over the islands, memory-bound
        period_s = max(period_s, spread_behind_s(list(bottlenecks.values()), L)[L])
    spread = (0.0, 0.0)
    if pairs is not None:  # (every island's floors for every kind: no island left out of the spread)
        latency_s, score_s = spread_floors_s({k: _least_per_layer(f, set(kinds)) for k, f in per_island.items()},
                                             gpus, L, m)
        spread = (latency_s + best["embedding"][1] + best["head"][1], score_s)
    return SizeFloor((m - 1) * period_s + fill_s, bounds.chain_score_floor_s(m * period_s, fill_s), prefix,
                     best["embedding"][1], best["head"][1], pairs, links, spread)


def _least_per_layer(floors: dict[str, tuple[float, float]], kinds: set[str]) -> tuple[float, float]:
    """(GPU-seconds, seconds) floors of any one layer on an island: the least over the layer kinds of its floors."""
    return min(floors[k][0] for k in kinds), min(floors[k][1] for k in kinds)


def spread_floors_s(per_layer: dict[int, tuple[float, float]], gpus: dict[int, int], num_layers: int,
                    num_microbatches: int) -> tuple[float, float]:
    """Floors under the closed form and the predicted iteration of any plan, from where its layers run (embedding,
    head, links and tail left out): ``per_layer[k]``: (GPU-seconds, seconds) floors of any layer on island k,
    ``gpus[k]``: its GPUs.

    A plan that runs x_k of the L layers on island k has a slowest stage of at least P(x) = max_k x_k gs_k / G_k
    (the stages on island k hold its x_k layers on at most G_k GPUs, and the slowest of several stages takes at
    least their GPU-seconds over their GPUs) and its stages' seconds sum to at least F(x) = sum_k x_k ts_k. So its
    closed form is at least (m - 1) P(x) + F(x) and its predicted iteration at least max(m P(x), F(x)) (the slowest
    stage's m micro-batches; micro-batch 0 through every layer: bounds.chain_score_floor_s). Both are at least
    their least over every fractional x (sum x_k = L, x_k >= 0). For a period P the least F is the fractional
    knapsack: the islands by seconds per layer, each filled to its P G_k / gs_k layers; F(P) is convex and piecewise
    linear, with its breaks where the islands so far hold exactly L, so the closed form's least is at one of them,
    and max(m P, F(P)) (F decreasing) is least where they cross, bisected. The spread floor of size_floor couples
    what the capacity floor (all GPUs busy) and the fill floor (every layer on its fastest island) take apart: with
    few micro-batches the plan cannot both spread over slow islands and keep the fill of the fastest one."""
    L, m = num_layers, num_microbatches
    if not per_layer or any(gs <= 0.0 or gpus[k] <= 0 for k, (gs, _ts) in per_layer.items()):
        return 0.0, 0.0  # (a layer of no GPU-seconds bounds no period: no floor)
    order = sorted(per_layer, key=lambda k: (per_layer[k][1], k))  # cheapest fill per layer first
    rate = {k: gpus[k] / per_layer[k][0] for k in order}  # layers per second of period

    def fill_s(period_s: float) -> float:  # F(P): the least seconds of L layers where the period is P
        left, out = float(L), 0.0
        for k in order:
            x = min(left, period_s * rate[k])
            out += x * per_layer[k][1]
            left -= x
            if left <= 0.0:
                return out
        return out if left <= 1e-9 * L else math.inf  # (at a break the last island fills L up to rounding)

    total = 0.0
    breaks = []
    for k in order:
        total += rate[k]
        breaks.append(L / total)  # the islands so far hold exactly L layers at this period
    least = min(breaks)  # (every island busy: the least period at which L layers fit at all)
    latency = min((m - 1) * p + fill_s(p) for p in breaks if p >= least)
    lo, hi = least, max(breaks)  # m P - F(P) rises with P: below lo it is under 0 only if it is at lo
    if m * lo >= fill_s(lo):
        score = m * lo
    else:
        if m * hi < fill_s(hi):
            hi = fill_s(hi) / m  # F(P) is constant beyond the last break
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if m * mid < fill_s(mid):
                lo = mid
            else:
                hi = mid
        score = min(m * lo, fill_s(hi))  # under max(m P, F(P)) everywhere (F decreasing)
    return latency * (1.0 - 1e-9), score * (1.0 - 1e-9)


def outside_s(floor: SizeFloor, pair: Pair, into: dict[int, float], out_of: dict[int, float],
              num_layers: int) -> float:
    """The least fill that the rest of any pipeline holding ``pair`` adds: the least seconds of the layers outside
    its slice, on the other islands where the pair floors have them (else on any island), and, where the slice
    does not start at layer 0 (end at L), the least link into its island (out of it; bounds.least_links), twice
    (compose counts each boundary's link forward and backward). The same for every pair of its
    redundancy class (as long, the same layer kinds, the same edges), whose answer this query's is."""
    a, z = pair.layers
    k = pair.island
    out = floor.outside_s(a, z)
    if floor.pairs is not None:
        rest = floor.pairs.outside_s(k, a, z)
        if rest is not None and rest > out:
            out = rest
    if a > 0:
        out += 2.0 * into[k]
    if z < num_layers:
        out += 2.0 * out_of[k]
    return out


def front_s(floor: SizeFloor, pair: Pair, into: dict[int, float]) -> float:
    """The least fill in front of ``pair``'s slice in any pipeline holding it: the least seconds of layers
    [0, start) and the embedding, on the other islands where the pair floors have them (else on any island), and
    the least link into its island, twice (0 for a slice at layer 0). It grows with the start, and a redundancy
    class's representative is its pair of the least start (slices.build_pairs keeps the first), so it holds for
    every pair whose plans the representative's answer gives."""
    a, k = pair.layers[0], pair.island
    if a == 0:
        return 0.0
    out = floor.prefix_s[a] + floor.embedding_s
    if floor.pairs is not None:
        rest = floor.pairs.front_s(k, a)
        if rest is not None and rest > out:
            out = rest
    return out + 2.0 * into[k]


def score_extra_s(front_fill_s: float, outside_fill_s: float, num_layers: int = MAX_VIRTUAL_STAGES) -> float:
    """What any predicted iteration of a pipeline holding a slice plan of ``num_layers`` layers adds to m x its
    slowest stage + its tail, at least: the plain 1F1B runs that stage's m micro-batches after the first one's
    forward reached it and before the last one's backward left the stages in front (bounds.plain_1f1b_floor_s:
    + the fill in front); interleaved with v chunks, 1/v of that fill (interleaved_schedule.interleaved_floor_s),
    where v is at most MAX_VIRTUAL_STAGES and the fewest layers of any stage (interleave.choose_virtual_stages), so
    at most the slice's layers: a slice of one layer cannot interleave. The closed form adds both. A query's score
    bound is lowered by it, as its closed-form bound is by the fill outside (``outside_fill_s``, which a score need not
    add: a slice's slowest stage at the front of an interleaved pipeline never idles)."""
    v = most_virtual_stages(num_layers)
    return front_fill_s if v < 2 else front_fill_s / v
