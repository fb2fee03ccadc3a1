"""Floors under a compatibility class's best closed form, so the driver composes classes most promising first and
skips those that cannot beat the plan found so far (uniform-grid runtimes: Megatron splits its options into one
class per (tp, dp, cp); composing a class costs a preparation and at least one DP run, and most classes fail).

``bounds.lower_bound`` relaxes a pipeline to a cover of [0, L) that may use one island many times, so its period
is that of the fastest island's shortest slices, far under the plans of a cluster of unlike islands. Here the
relaxation keeps what makes a class expensive: each island holds one contiguous option (compose.py's used-island
mask), so the islands' slices must add up to L layers. Per island and slice length n, take the least bottleneck and
the least time of its options of that length (any start, ignoring memory, links and stage caps); then

    closed form >= (m - 1) x P* + F + least tail

P*: the least bound P at which distinct islands' lengths with bottleneck <= P can sum to L (a reachable-sums
bitset, bisected over the candidate bottlenecks); F: the least sum of times over distinct islands' lengths summing
to L (a min-plus knapsack over islands). Both are relaxations of every composition the class admits, so the floor
never exceeds its closed-form optimum (tests/test_planner_classes.py checks it against compose.reference).
"""
from __future__ import annotations

import math
from typing import Callable, Hashable, Iterable, Sequence

from tangram_launch.planner.compose import Option

_ROUNDING = 1e-9  # the floor is summed in another order than compose.evaluate's latency: keep it strictly under


def group_minima(fields: Iterable[tuple], groups: Iterable[Hashable]) -> dict[Hashable, list[float]]:
    """Per class, the least bottleneck, time and tail of options of one island and length, given as their Option
    fields after (start, stop, island); those that fit nowhere or whose class is None are left out. The same for
    every pair whose options come from one answer's templates: a driver computes it once per answer."""
    out: dict[Hashable, list[float]] = {}
    for (_stages, max_after, time_s, bottleneck_s, tail_s), g in zip(fields, groups):
        if max_after < 0 or g is None:
            continue
        cur = out.get(g)
        if cur is None:
            out[g] = [bottleneck_s, time_s, tail_s]
        else:
            if bottleneck_s < cur[0]:
                cur[0] = bottleneck_s
            if time_s < cur[1]:
                cur[1] = time_s
            if tail_s < cur[2]:
                cur[2] = tail_s
    return out


def option_minima(options: Sequence[Option], groups: Sequence[Hashable],
                  num_layers: int) -> list[tuple[dict, int, int]]:
    """What class_floors_s reads of some options: per (island, length), group_minima of the options there (those
    outside [0, L) left out), as (minima, island, length). Minima of parts are the minima of their union."""
    by_place: dict[tuple[int, int], tuple[list, list]] = {}
    for o, g in zip(options, groups):
        if 0 <= o.start < o.stop <= num_layers:
            fields, gs = by_place.setdefault((o.island, o.stop - o.start), ([], []))
            fields.append(o[3:])
            gs.append(g)
    return [(group_minima(fields, gs), island, n) for (island, n), (fields, gs) in by_place.items()]


def class_floors_s(options: Sequence[Option], groups: Sequence[Hashable], num_layers: int,
                   num_microbatches: int, score_floors: dict | None = None,
                   interleaved_floors: tuple[dict, int] | None = None, *,
                   minima: Iterable[tuple[dict, int, int]] | None = None,
                   class_of: Callable[[Hashable], Hashable] | None = None) -> dict[Hashable, float]:
    """Per compatibility class (``groups[i]`` is option i's), a floor under the closed-form latency of any
    composition of its options (inf: none covers [0, L) with distinct islands). One pass over the options.
    ``score_floors``, if given, receives per class m x P* + least tail: under any predicted iteration (the slowest
    stage runs m micro-batches, plain or interleaved, then the tail), which a schedule's score can reach where the
    closed form does not. ``interleaved_floors`` = (dict, V) receives per class a floor under the interleaved
    iteration with 2..V virtual stages, max(m x P*, F*) + least tail: every rank runs its m micro-batches, and
    micro-batch 0 passes every stage both ways (interleaved_schedule.interleaved_floor_s; not the closed form
    m x P + (F - P) / v, which a slow first stage undercuts). An option whose class is None counts in none.

    ``minima``: the options as option_minima's (minima, island, length) parts (a driver's, per pair), their minima
    keyed by groups that ``class_of`` maps to the classes (None: in none); the options are then not read."""
    L = num_layers
    if minima is None:
        minima = option_minima(options, groups, L)
    least: dict[tuple, list[float]] = {}  # (class, island, length) -> [least bottleneck, least time]
    tails: dict[Hashable, float] = {}
    for per_group, island, n in minima:
        for g, (bottleneck_s, time_s, tail_s) in per_group.items():
            c = g if class_of is None else class_of(g)
            if c is None:
                continue
            if tail_s < tails.get(c, math.inf):
                tails[c] = tail_s
            cur = least.get((c, island, n))
            if cur is None:
                least[c, island, n] = [bottleneck_s, time_s]
            else:
                if bottleneck_s < cur[0]:
                    cur[0] = bottleneck_s
                if time_s < cur[1]:
                    cur[1] = time_s
    per_class: dict[Hashable, dict[int, list[tuple[int, list[float]]]]] = {}
    for (g, island, n), v in least.items():
        per_class.setdefault(g, {}).setdefault(island, []).append((n, v))
    out = dict.fromkeys(groups, math.inf)
    for g, islands in per_class.items():
        lengths = [sorted(by_len) for _k, by_len in sorted(islands.items())]
        period = _least_period(lengths, L)
        fill = _least_fill(lengths, L) if period < math.inf else math.inf
        if period < math.inf:
            out[g] = ((num_microbatches - 1) * period + fill + tails[g]) * (1.0 - _ROUNDING)
        if score_floors is not None:
            score_floors[g] = (num_microbatches * period + tails[g]) * (1.0 - _ROUNDING)
        if interleaved_floors is not None:
            floors = interleaved_floors[0]
            floors[g] = (max(num_microbatches * period, fill) + tails[g]) * (1.0 - _ROUNDING)
    return out


def _reaches(islands: list[list[tuple[int, list[float]]]], L: int, bound: float) -> bool:
    """Whether distinct islands' lengths whose least bottleneck is <= bound can sum to exactly L: bit s of
    ``reach`` says the islands so far can cover s layers."""
    mask = (1 << (L + 1)) - 1
    reach = 1
    for lengths in islands:
        new = reach
        for n, (bn, _t) in lengths:
            if bn <= bound:
                new |= reach << n
        reach = new & mask
        if reach >> L & 1:
            return True
    return False


def _least_period(islands: list[list[tuple[int, list[float]]]], L: int) -> float:
    """The least candidate bottleneck at which the islands can cover L layers (inf: never). Feasibility grows
    with the bound, so the candidates are bisected."""
    cands = sorted({v[0] for lengths in islands for _n, v in lengths})
    if not _reaches(islands, L, cands[-1]):
        return math.inf
    lo, hi = 0, len(cands) - 1  # cands[hi] reaches
    while lo < hi:
        mid = (lo + hi) // 2
        if _reaches(islands, L, cands[mid]):
            hi = mid
        else:
            lo = mid + 1
    return cands[hi]


def _least_fill(islands: list[list[tuple[int, list[float]]]], L: int) -> float:
    """The least sum of slice times over distinct islands whose slice lengths sum to L: best[s] is the least time
    of covering s layers with the islands so far (each used at most once)."""
    best = [math.inf] * (L + 1)
    best[0] = 0.0
    for lengths in islands:
        new = best[:]
        for n, (_bn, t) in lengths:
            for s in range(L - n + 1):
                v = best[s] + t
                if v < new[s + n]:
                    new[s + n] = v
        best = new
    return best[L]


def stage_totals(options: Sequence[Option], idx: Sequence[int], num_layers: int, most: int) -> set[int]:
    """The stage counts, up to ``most``, of the covers of [0, L) by options of ``idx`` on distinct islands (ignoring
    where the slices start, links and memory: a relaxation, so every pipeline of these options has its stage count
    among them). A one-grid class's pipelines interleave only where the stages divide the micro-batches
    (capabilities.schedule_problems): none of them can where no such count is among these."""
    L = num_layers
    per_island: dict[int, set[tuple[int, int]]] = {}
    for oi in idx:
        o = options[oi]
        if o.max_after >= 0 and 0 <= o.start < o.stop <= L and o.num_stages <= most:
            per_island.setdefault(o.island, set()).add((o.stop - o.start, o.num_stages))
    mask = (1 << (L + 1)) - 1
    reach = {0: 1}  # stages so far -> bit n: the islands so far can cover n layers in that many stages
    for k in sorted(per_island):
        new = dict(reach)
        for n, stages in per_island[k]:
            for total, bits in reach.items():
                t = total + stages
                if t <= most:
                    b = (bits << n) & mask
                    if b:
                        new[t] = new.get(t, 0) | b
        reach = new
    return {total for total, bits in reach.items() if bits >> L & 1}
