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
from tangram_launch.planner.pair_floors import PairFloors, capacities
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

    def beyond(self, latency_bound_s: float, score_bound_s: float) -> bool:
        """Whether no plan at this size can beat either bound (as SliceQuery.beyond_bound)."""
        return bounds.beyond(self.latency_s, self.score_s, bounds.slack_cut(latency_bound_s),
                             bounds.slack_cut(score_bound_s))

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

    (the second term: bounds.chain_score_floor_s; with few micro-batches it skips sizes the first lets through)
    """
    L = model.num_layers
    none = SizeFloor(0.0, 0.0, (0.0,) * (L + 1), 0.0, 0.0, links=links)
    if not hasattr(par, "compute_floors"):
        return none
    best: dict[str, tuple[float, float]] = {}
    per_island: dict[int, dict[str, tuple[float, float]]] = {}
    for k, isl in enumerate(islands):
        if dtype_problem(isl, training.dtype) is not None:
            continue
        q = SliceQuery(model=model, training=training, layers=(0, L), island=isl, microbatch_sequences=b,
                       capabilities=caps, max_stages=caps.max_stages)
        floors = par.compute_floors(q)
        if not floors:
            continue
        per_island[k] = floors
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
    pairs = (PairFloors(kinds, per_island, gpus, m, links)
             if all(needed <= f.keys() for f in per_island.values()) else None)
    period_s = capacities(kinds, per_island, gpus).period_s(layers_gs, edges_gs)  # >= GPU-seconds / their GPUs
    return SizeFloor((m - 1) * period_s + fill_s, bounds.chain_score_floor_s(m * period_s, fill_s), prefix,
                     best["embedding"][1],
                     best["head"][1], pairs, links)


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
