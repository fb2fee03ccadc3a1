"""Pipeline composition (paper §5.2): the dynamic-programming kernel, pure (tuples in, tables out).

The kernel knows nothing of models or GPUs. Its input is a list of ``Option`` (one slice plan each: the layers it
covers, its island, how many pipeline stages it holds, its cost per micro-batch, and the number of following
stages at which it still fits in memory), a matrix of one-way p2p times between islands, the layer count L and the
number of micro-batches m. Its output is the sequence of options (front to back) with the lowest 1F1B latency

    latency = (m - 1) * period + fill + tail                      (Narayanan et al. 2021, §2.2, 1F1B)
    period  = max(slowest stage, slowest inter-stage link)        per micro-batch in the steady state
    fill    = sum(stage fwd+bwd) + 2 * sum(inter-stage links)     one micro-batch through the pipeline and back
    tail    = max over stages of (DP gradient sync + optimizer step)

subject to: the options cover [0, L) contiguously, each island is used at most once, and every option fits in
memory at its pipeline position (``stages_after <= max_after``).

The algorithm follows the paper: (1) take a bound B on the slowest stage from the ranked bottlenecks of all slice
plans; (2) build sequences from the BACK of the pipeline, adding options in front, memoising per state the best
(fill, tail) of the sequences that reach it, and discarding a sequence when it becomes infeasible (an option no
longer fits with the stages behind it) or unbalanced (an option or link slower than B); (3) compare the best full
sequence with the best global plan; (4) relax B until the latency cannot improve any more. At B = the optimum's
period the DP finds a plan with fill + tail no larger than the optimum's, so trying every candidate bound is exact
(``reference.py`` checks it by brute force). Three things make it fast without losing exactness: the bounds are
visited by interval bisection, skipping every interval whose latency floor ((m - 1) x its smallest bound + the
least fill + tail at its largest) cannot beat the best plan; inside a DP run, a partial sequence is dropped as soon
as its cheapest completion cannot beat the best plan; and the best single-island plan seeds the search.
``bound_step`` > 0 trades exactness for fewer DP runs by merging bounds within a relative step.

The closed form is the search's objective, and exact for it. The Plan reports the 1F1B event simulation, which
also charges the inter-island p2p where it lies on the steady state's cycle (stage k's backward waits for the
round trip to stage k + 1: ((t_k + t_k+1) / 2 + p) per micro-batch can exceed the slowest stage), so the two can
rank close plans the other way. A driver that passes ``score`` (the iteration the Plan would report for a
sequence: the simulation, or the interleaved schedule where faster) gets the plan with the least score among the
DP's winners at the bounds the exact closed-form search visits (one per bound, each scored once): the closed
form's optimum is among them, so the score never gets worse than it was. With ``score_band`` a bound's winner or
a partial sequence is pruned only when its closed form cannot beat the larger of the best score and the least
closed form found, so every plan whose closed form lies below the best score is a candidate too (more DP runs).

The state includes the set of islands used, so the exact search grows as 2^K with K islands (the paper's K is
2-6). ``island_order`` restricts pipelines to one order of islands (islands may be skipped): the set drops out of
the state and the cost becomes polynomial in K; the planner tries a few orders when K is large.
"""
from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from tangram_launch.costmodel.pipeline import pipeline_latency_s

_FILL_TAIL_AFTER = operator.itemgetter(0, 1, 2)  # sort keys of DP entries (C-level: _pareto sorts millions)
_AFTER = operator.itemgetter(2)
_COMPACT_AT = 4096  # entries gathered for one DP state before they are reduced to their Pareto front


class Option(NamedTuple):
    """One slice plan as the kernel sees it (seconds per micro-batch unless said otherwise)."""

    start: int  # first layer covered
    stop: int  # one past the last layer covered
    island: int  # island index; bit ``1 << island`` in used-island masks
    num_stages: int  # pipeline stages inside the slice plan
    # fits iff min(stages after its last stage, m - 1) <= max_after; -1: never. Memory saturates once m micro-batches
    # are in flight (1F1B: the stage at position p of S holds min(S - p, m)), so m - 1 or more following stages all
    # cost the same; SlicePlan.max_stages_after gives exactly this number.
    max_after: int
    time_s: float  # sum of its stages' forward+backward + 2 x its internal p2p
    bottleneck_s: float  # its slowest stage or internal p2p link
    tail_s: float  # max over its stages of dp_sync_s + optimizer_s (per iteration)


class Metrics(NamedTuple):
    latency_s: float
    period_s: float
    fill_s: float
    tail_s: float
    links_s: tuple[float, ...]  # one-way p2p between consecutive options, front to back


@dataclass(frozen=True)
class Composition:
    options: tuple[int, ...]  # indices into the option list, front (layer 0) to back
    metrics: Metrics
    bound_s: float  # the bottleneck bound at which the DP found it
    score_s: float | None = None  # the driver's score (simulated latency) it was chosen by; None: the closed form

    @property
    def latency_s(self) -> float:
        return self.metrics.latency_s

    @property
    def objective_s(self) -> float:
        """What the search ranked it by: the score where the driver gave one, else the closed form."""
        return self.metrics.latency_s if self.score_s is None else self.score_s


@dataclass
class ComposeStats:
    dp_runs: int = 0
    states: int = 0
    candidates: int = 0
    trace: list = field(default_factory=list)  # (bound_s, best latency_s at that bound or None)
    scored: list = field(default_factory=list)  # every composition a score was computed for (score given)
    best_closed_s: float = float("inf")  # the least closed-form latency of any composition found
    # the last option set's preparation (_prepare), for the next call on the same set: above five islands the
    # driver composes one set in up to a few hundred island orders (orders.py), and preparing it is most of a call
    prepared: tuple | None = field(default=None, repr=False, compare=False)

    def threshold_s(self, best_score_s: float | None, band: bool = False) -> float:
        """What a driver passes on as ``incumbent_s`` once it holds a plan scored ``best_score_s``: the least
        closed form found (the closed-form search prunes as without a score); with ``band``, the larger of that
        and the best score, so every plan whose closed form beats the best score is searched too."""
        if best_score_s is None:
            return float("inf")
        return max(best_score_s, self.best_closed_s) if band else self.best_closed_s


def evaluate(seq: Sequence[int], options: Sequence[Option], link_s: Sequence[Sequence[float]],
             num_microbatches: int) -> Metrics | None:
    """Latency of a front-to-back sequence of options; None if some option does not fit at its position."""
    after = 0
    for oi in reversed(seq):
        if options[oi].max_after < min(after, num_microbatches - 1):
            return None
        after += options[oi].num_stages
    links = tuple(link_s[options[a].island][options[b].island] for a, b in zip(seq, seq[1:]))
    period = max([options[oi].bottleneck_s for oi in seq] + list(links))
    fill = sum(options[oi].time_s for oi in seq) + 2.0 * sum(links)
    tail = max(options[oi].tail_s for oi in seq)
    return Metrics(pipeline_latency_s(num_microbatches, period, fill, tail), period, fill, tail, links)


def _pareto(entries: list) -> list:
    """Entries not dominated in (fill_s, tail_s, after): lower is better in each (fewer stages behind leave more
    memory for the options in front). Returned sorted by ``after`` so that the entries an option fits in front of
    form a prefix.

    Entries are visited by increasing fill; a staircase of the kept (after, tail) points, after ascending and tail
    strictly descending, answers "is there a kept entry with after <= and tail <=" by one bisection.
    """
    if len(entries) == 1:
        return entries
    entries.sort(key=_FILL_TAIL_AFTER)
    kept: list = []
    stair_after: list[int] = []
    stair_tail: list[float] = []
    for e in entries:
        after, tail = e[2], e[1]
        i = bisect.bisect_right(stair_after, after)
        if i and stair_tail[i - 1] <= tail:
            continue
        kept.append(e)
        # drop staircase points that e dominates (after >= e's, tail >= e's), then insert e
        k = i
        while k < len(stair_after) and stair_tail[k] >= tail:
            k += 1
        stair_after[i:k] = [after]
        stair_tail[i:k] = [tail]
    kept.sort(key=_AFTER)
    return kept


def _dp_at_bound(options: Sequence[Option], by_stop: Sequence[Sequence[tuple]], link_s: Sequence[Sequence[float]],
                 num_layers: int, n_cap: int, saturated: int, bound: float, required: int,
                 max_stages: int | None, stats: ComposeStats, prune: tuple | None = None,
                 rank: Sequence[int] | None = None, at_bound: dict | None = None
                 ) -> tuple[tuple[int, ...], float] | None:
    """Best (fill + tail) sequence whose every option and link is <= ``bound``, with its fill + tail; None if no
    sequence covers [0, L) -- or none that can beat ``prune``'s latency.

    prune = (m - 1, period_lb, prefix, beat): a sequence built so far is dropped when even the cheapest completion
    cannot beat ``beat``: (m - 1) x max(period_lb, pre_period[start], its new option's bottleneck and link) + its
    fill + pre_fill[start] + max(its tail, pre_tail[start]), where pre_fill[j] / pre_period[j] / pre_tail[j] are the
    least fill / period / tail of any cover of
    [0, j) by the islands still free in front of it (ignoring memory and that each is used once): those not in the
    sequence, or in island-order mode those ranked before its front. ``prefix(mask)`` gives them (_PrefixBounds).

    rank: islands must appear front to back in increasing rank (polynomial mode): an island in front of island f
    needs rank < rank[f], which already keeps islands distinct, so the key keeps only the required islands' bits.

    by_stop[j] = [(island, island bit, option indices ending at j on that island sorted by bottleneck, their
    bottlenecks)]. tables[j] maps the sequences covering layers [j, L) by
      key   = (used: bitmask of islands in the sequence,
               front: island of the sequence's first option, -1 for the empty sequence at j = L)
    to the Pareto front (see _pareto) of
      entry = (fill_s, tail_s,
               after: stages in the sequence, capped at n_cap (beyond it no option's memory check changes),
               option index added in front, parent key in tables[option.stop], parent position in that front)
    """
    at_bound = {} if at_bound is None else at_bound  # _at_bound's answers, kept by the caller across bounds
    tables: list[dict] = [dict() for _ in range(num_layers + 1)]
    tables[num_layers][(0, -1)] = [(0.0, 0.0, 0, -1, None, -1)]
    stats.dp_runs += 1
    keep = -1 if rank is None else required  # bits of "used" that the key remembers
    if prune is not None:
        m1, period_lb, prefix, beat = prune
        floor_terms = (m1, period_lb, prefix)
        slack = 1e-9 * abs(beat)  # the skip sums in another order than the check: never skip what the check keeps
        if rank is not None:  # island k's option may have in front only islands ranked before k
            before = [sum(1 << i for i in range(len(rank)) if rank[i] < rank[k]) for k in range(len(rank))]
    for j in range(num_layers, 0, -1):
        layer = tables[j]
        if not layer:
            continue
        groups = []
        for island, bit, idx, bns in by_stop[j]:
            n = bisect.bisect_right(bns, bound)
            if n:
                groups.append((island, bit, *_at_bound(options, idx, n, saturated, at_bound), (id(idx), n)))
        if not groups:
            continue
        for key in list(layer):
            front = _pareto(layer[key])
            layer[key] = front
            if not front:
                continue
            stats.states += len(front)
            afters = [e[2] if e[2] < saturated else saturated for e in front]  # following stages costing memory
            if prune is not None:  # least fill + tail and least fill of the first k entries, at k - 1
                least_ft = list(itertools.accumulate([e[0] + e[1] for e in front], min))
                least_f = list(itertools.accumulate([e[0] for e in front], min))
            used, f = key
            for island, bit, idx, prune_bns, gkey in groups:
                if used & bit:
                    continue
                link = 0.0
                if f >= 0:
                    if rank is not None and rank[island] >= rank[f]:
                        continue
                    link = link_s[island][f]
                    if link > bound:
                        continue
                tkey = ((used | bit) & keep, island)
                if prune is not None:
                    # what may cover the layers in front of this island's option, and the options by their floor
                    # against it: those whose floor + 2 x link + the least fill + tail behind reach the incumbent
                    # are skipped whole (the check below would fail for every entry)
                    mask = (~(used | bit) if rank is None else before[island]) & prefix.islands
                    pre_fill, pre_period, pre_tail = prefix(mask)
                    idx, prune_bns, floors = _by_floor(options, idx, prune_bns, gkey, mask, floor_terms, at_bound)
                    cut = bisect.bisect_left(floors, beat - least_ft[-1] - 2.0 * link + slack)
                    idx, prune_bns = idx[:cut], prune_bns[:cut]
                for oi, prune_bn in zip(idx, prune_bns):
                    o = options[oi]
                    fits = bisect.bisect_right(afters, o.max_after)  # entries it fits in front of: a prefix
                    if not fits:
                        continue
                    add = o.time_s + 2.0 * link
                    tail = o.tail_s
                    ns = o.num_stages
                    if prune is not None:
                        floor = (m1 * max(period_lb, pre_period[o.start], prune_bn, link)
                                 + pre_fill[o.start] + add)
                        tail_lb = max(tail, pre_tail[o.start])
                        lf = least_f[fits - 1] + tail_lb
                        if floor + (lf if lf > least_ft[fits - 1] else least_ft[fits - 1]) >= beat:
                            continue  # no entry it fits in front of can beat: the check below fails for each
                    tgt = tables[o.start].get(tkey)
                    if tgt is None:
                        tgt = tables[o.start][tkey] = []
                    elif len(tgt) > _COMPACT_AT:  # keep memory bounded: not yet expanded, so nothing points here
                        tgt[:] = _pareto(tgt)
                    # entries come by increasing "after": once one whose tail is under the option's has been
                    # extended, a later one with no less fill yields an entry that one beats (its tail becomes
                    # the option's or stays larger; fill and after are no smaller), so it is not extended
                    least = float("inf")
                    for pos in range(fits):
                        e = front[pos]
                        if e[0] >= least:
                            continue
                        n2 = e[2] + ns
                        if max_stages is not None and n2 > max_stages:
                            continue
                        if prune is not None and floor + e[0] + (e[1] if e[1] > tail_lb else tail_lb) >= beat:
                            continue
                        if e[1] <= tail:
                            least = e[0]
                        tgt.append((e[0] + add, e[1] if e[1] > tail else tail, n2 if n2 < n_cap else n_cap,
                                    oi, key, pos))
    best = None
    for key, entries in tables[0].items():
        if key[0] & required != required:
            continue
        for e in entries:
            if best is None or e[0] + e[1] < best[0] + best[1]:
                best = e
    if best is None:
        return None
    value = best[0] + best[1]
    seq = []
    e = best
    while e[3] >= 0:
        seq.append(e[3])
        e = tables[options[e[3]].stop][e[4]][e[5]]
    return tuple(seq), value


def _at_bound(options: Sequence[Option], idx: list[int], n: int, saturated: int,
              cache: dict) -> tuple[list[int], list[float]]:
    """The first n options of a (stop, island) group (those under the bound; idx is sorted by bottleneck) that no
    other of them on the same layers beats on time, tail, stages and room for following stages, each with the
    least bottleneck of the options it beats (itself included).

    Under a bound the bottleneck decides admission only: at any bound the options kept reach the same least
    fill + tail (a beaten option's place is taken by one with no more time, tail and stages and no less room), so
    the optimum is found at its own period as before. The inner prune estimates a sequence's period from its
    options' bottlenecks; a kept option is judged with the least bottleneck of those it stands for, so that it is
    never pruned where one of them would not be (a run that prunes everything at a bound still proves that no
    smaller bound can do better)."""
    key = (id(idx), n)
    hit = cache.get(key)
    if hit is not None and hit[0] is idx:
        return hit[1]
    ranked = cache.get(id(idx))  # the whole group by (time, tail, stages, room, bottleneck), sorted once
    if ranked is None or ranked[0] is not idx:
        rows = []
        for pos, oi in enumerate(idx):
            o = options[oi]
            room = o.max_after if o.max_after < saturated else saturated
            rows.append((o.time_s, o.tail_s, o.num_stages, -room, o.bottleneck_s, pos, oi, o.start))
        rows.sort()  # pos breaks ties: the order a stable sort of the first n would give
        ranked = cache[id(idx)] = (idx, rows)
    kept: list[int] = []
    crit: list[list] = []  # per kept option: tail, stages, room, least bottleneck it stands for
    by_start: dict[int, list[list]] = {}  # the group's options end at one layer on one island: same start compares
    for _, tail_s, stages, neg_room, bn, pos, oi, start in ranked[1]:
        if pos >= n:
            continue
        same = by_start.get(start)
        if same is None:
            same = by_start[start] = []
        for c in same:
            if c[0] <= tail_s and c[1] <= stages and c[2] <= neg_room:
                if bn < c[3]:
                    c[3] = bn
                break
        else:
            kept.append(oi)
            c = [tail_s, stages, neg_room, bn]
            crit.append(c)
            same.append(c)
    bns = [options[oi].bottleneck_s for oi in kept]
    order = sorted(range(len(kept)), key=bns.__getitem__)
    out = ([kept[k] for k in order], [crit[k][3] for k in order])
    cache[key] = (idx, out)
    return out


def _by_floor(options: Sequence[Option], idx: list[int], bns: list[float], gkey: tuple, mask: int,
              floor_terms: tuple, cache: dict) -> tuple[list[int], list[float], list[float]]:
    """A group's options under a bound (from _at_bound) by increasing floor when the layers in front are covered by
    the islands in ``mask``: (m - 1) x max(period_lb, pre_period[start], bottleneck) + pre_fill[start] + time,
    the prune's floor without the link and the entry behind."""
    key = ("floor", gkey, mask)
    hit = cache.get(key)
    if hit is not None and hit[0] is idx:
        return hit[1]
    m1, period_lb, prefix = floor_terms
    pre_fill, pre_period, _ = prefix(mask)
    # m = 1 has no steady state (and 0 x an unreachable prefix's inf period would be nan, which breaks the sort)
    rows = sorted(((m1 * max(period_lb, pre_period[options[oi].start], bn) if m1 else 0.0)
                   + pre_fill[options[oi].start] + options[oi].time_s, k) for k, (oi, bn) in enumerate(zip(idx, bns)))
    out = ([idx[k] for _, k in rows], [bns[k] for _, k in rows], [g for g, _ in rows])
    cache[key] = (idx, out)
    return out


def _best_cover(options: Sequence[Option], idx: Sequence[int], num_layers: int, combine) -> float:
    """Best value over covers of [0, L) by options (ignoring islands, memory and links), built from the back:
    best[i] = min over options starting at i of combine(option, best[option.stop])."""
    best = [float("inf")] * (num_layers + 1)
    best[num_layers] = 0.0
    by_start: dict[int, list[int]] = {}
    for oi in idx:
        by_start.setdefault(options[oi].start, []).append(oi)
    for i in range(num_layers - 1, -1, -1):
        for oi in by_start.get(i, ()):
            o = options[oi]
            v = combine(o, best[o.stop])
            if v < best[i]:
                best[i] = v
    return best[0]


def _fill_lower_bound(options: Sequence[Option], idx: Sequence[int], num_layers: int) -> float:
    """Least fill of any cover of [0, L), ignoring islands, memory and links: a lower bound for every plan."""
    return _best_cover(options, idx, num_layers, lambda o, rest: o.time_s + rest)


def _minmax_bottleneck(options: Sequence[Option], idx: Sequence[int], num_layers: int) -> float:
    """Least possible period of any cover of [0, L) (ignoring islands, memory and links): no bound below it can
    be feasible."""
    return _best_cover(options, idx, num_layers, lambda o, rest: max(o.bottleneck_s, rest))


def _prefix_bounds(options: Sequence[Option], idx: Sequence[int], num_layers: int) -> tuple[list, list, list]:
    """pre_fill[j], pre_period[j], pre_tail[j]: least fill, least period and least tail of any cover of [0, j) by
    these options (ignoring that an island is used once, and memory)."""
    fill = [float("inf")] * (num_layers + 1)
    period = [float("inf")] * (num_layers + 1)
    tail = [float("inf")] * (num_layers + 1)
    fill[0] = period[0] = tail[0] = 0.0
    by_stop: dict[int, list[int]] = {}
    for oi in idx:
        by_stop.setdefault(options[oi].stop, []).append(oi)
    for j in range(1, num_layers + 1):
        best_fill = best_period = best_tail = float("inf")
        for oi in by_stop.get(j, ()):
            start, _, _, _, _, time_s, bn, tail_s = options[oi]
            v = fill[start] + time_s
            if v < best_fill:
                best_fill = v
            v = period[start] if period[start] > bn else bn
            if v < best_period:
                best_period = v
            v = tail[start] if tail[start] > tail_s else tail_s
            if v < best_tail:
                best_tail = v
        fill[j], period[j], tail[j] = best_fill, best_period, best_tail
    return fill, period, tail


class _PrefixBounds:
    """_prefix_bounds over the options of a set of islands, per set (a bit mask), computed on first use: the layers
    in front of an option can be covered only by the islands the sequence behind it leaves free, and when the fast
    island is already behind, that cover is much slower than the least over all islands."""

    def __init__(self, options: Sequence[Option], idx: Sequence[int], num_layers: int):
        self._options = options
        self._num_layers = num_layers
        self._by_island: dict[int, list[int]] = {}
        for oi in idx:
            self._by_island.setdefault(options[oi].island, []).append(oi)
        self.islands = sum(1 << k for k in self._by_island)  # the islands with options, as a mask
        self._cache: dict[int, tuple[list, list, list]] = {}

    def __call__(self, mask: int) -> tuple[list, list, list]:
        mask &= self.islands
        hit = self._cache.get(mask)
        if hit is None:
            sub = [oi for k, lst in sorted(self._by_island.items()) if mask >> k & 1 for oi in lst]
            hit = self._cache[mask] = _prefix_bounds(self._options, sub, self._num_layers)
        return hit


def lower_bound(options: Sequence[Option], num_layers: int, num_microbatches: int,
                allowed_mask: int | None = None) -> float:
    """A cheap lower bound on the latency of any plan from these options: (m - 1) x the least period of any cover
    + the least fill of any cover (both ignoring islands and memory). Lets a driver try the most promising option
    sets first and skip those that cannot beat a plan already found."""
    idx = [i for i, o in enumerate(options)
           if (allowed_mask is None or allowed_mask >> o.island & 1) and o.max_after >= 0
           and 0 <= o.start < o.stop <= num_layers]
    if not idx:
        return float("inf")
    return ((num_microbatches - 1) * _minmax_bottleneck(options, idx, num_layers)
            + _fill_lower_bound(options, idx, num_layers))


def _undominated(options: Sequence[Option], idx: Sequence[int], saturated: int) -> list[int]:
    """Drop options that another option on the same layers and island beats in every respect: bottleneck, time,
    tail, stages and room for following stages. Such an option is never needed at any bound."""
    by_pair: dict[tuple[int, int, int], list[int]] = {}
    for oi in idx:
        o = options[oi]
        by_pair.setdefault((o.start, o.stop, o.island), []).append(oi)
    out = []
    for lst in by_pair.values():
        # by (bottleneck, time, tail), ties in list order (a stable sort), so an option's dominators come first
        order = sorted(((o.bottleneck_s, o.time_s, o.tail_s), pos, oi)
                       for pos, oi in enumerate(lst) for o in (options[oi],))
        kept: list[tuple] = []  # kept options' (time, tail, stages, room), unpacked once: this loop is hot
        for (_, time_s, tail_s), _, oi in order:
            o = options[oi]
            stages, room = o.num_stages, min(o.max_after, saturated)
            for k_time, k_tail, k_stages, k_room in kept:
                if k_time <= time_s and k_tail <= tail_s and k_stages <= stages and k_room >= room:
                    break
            else:
                kept.append((time_s, tail_s, stages, room))
                out.append(oi)
    return out


def _prepare(options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int, saturated: int,
             allowed_mask: int, max_stages: int | None, bound_step: float) -> tuple | None:
    """What compose needs of an option set before any DP run, whatever the island order: the usable undominated
    options, grouped by stop and island; the candidate bounds; the cap on stages after; and the lower bounds
    (least fill, least period, and both per prefix). None: no option is usable."""
    idx = [i for i, o in enumerate(options)
           if allowed_mask >> o.island & 1 and o.max_after >= 0 and 0 <= o.start < o.stop <= num_layers]
    idx = _undominated(options, idx, saturated)
    if not idx:
        return None
    grouped: dict[tuple[int, int], list[int]] = {}
    for oi in sorted(idx, key=lambda i: options[i].bottleneck_s):
        grouped.setdefault((options[oi].stop, options[oi].island), []).append(oi)
    by_stop: list[list[tuple]] = [[] for _ in range(num_layers + 1)]
    for (stop, island), lst in sorted(grouped.items()):
        by_stop[stop].append((island, 1 << island, lst, [options[oi].bottleneck_s for oi in lst]))
    islands = sorted({options[oi].island for oi in idx})
    cands = sorted({options[oi].bottleneck_s for oi in idx}
                   | {link_s[a][b] for a in islands for b in islands if a != b})
    if bound_step > 0:  # keep the top of each group of bounds within a relative step: fewer DP runs, not exact
        tops = []
        for c in cands:
            if tops and c <= tops[-1][0] * (1.0 + bound_step):
                tops[-1][1] = c
            else:
                tops.append([c, c])
        cands = [t[1] for t in tops]
    if max_stages is None:
        # "after" matters only through the memory checks: beyond the largest finite threshold nothing changes
        finite = [options[oi].max_after for oi in idx if options[oi].max_after < saturated]
        n_cap = min(saturated, 1 + max(finite, default=-1))
    else:
        n_cap = max(saturated, max_stages)
    fill_lb = _fill_lower_bound(options, idx, num_layers)
    period_lb = _minmax_bottleneck(options, idx, num_layers)
    prefix = _PrefixBounds(options, idx, num_layers)
    # _at_bound's answers for this set's groups, shared by every call that reuses the preparation
    at_bound: dict = {}
    return idx, by_stop, cands, n_cap, fill_lb, period_lb, prefix, at_bound


def compose(options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int, num_microbatches: int,
            *, allowed_mask: int | None = None, required_mask: int = 0, max_stages: int | None = None,
            bound_step: float = 0.0, incumbent_s: float = float("inf"), island_order: Sequence[int] | None = None,
            stats: ComposeStats | None = None,
            score: Callable[[tuple[int, ...], Metrics], float] | None = None,
            score_band: bool = False,
            score_floor: Callable[[tuple[int, ...], Metrics], float] | None = None,
            score_incumbent_s: float = float("inf")) -> Composition | None:
    """The lowest-latency sequence of options (see the module docstring), or None when none is feasible.

    ``allowed_mask``: islands that may be used (default all); ``required_mask``: islands every sequence must use
    (to price an island the best plan leaves out); ``max_stages``: the runtime's cap on pipeline stages;
    ``incumbent_s``: a latency already achieved elsewhere (another micro-batch size): the search stops as soon
    as it cannot beat it, and returns None if it never does; ``island_order``: only pipelines whose islands
    appear in this order (front to back, islands may be skipped) -- the state then drops the set of used islands,
    so the cost grows polynomially with the number of islands (exact among such pipelines); ``score``: the
    latency to choose by (what the Plan reports; see the module docstring), computed once per bound's winner;
    ``incumbent_s`` then prunes closed forms only (the least score among the winners is returned, whatever it
    is); ``score_band``: prune against the larger of the best score and the least closed form instead (more DP
    runs: every plan whose closed form beats the best score is a candidate), and ``incumbent_s`` is a score;
    ``score_floor``: a cheap floor under ``score`` (a winner whose floor cannot beat the best score here or
    ``score_incumbent_s``, the best found elsewhere, is not scored: a simulation costs milliseconds and an island-order
    search meets tens of thousands of winners).
    """
    stats = stats if stats is not None else ComposeStats()
    m = num_microbatches
    saturated = m - 1
    if allowed_mask is None:
        allowed_mask = (1 << (1 + max((o.island for o in options), default=0))) - 1
    key = (id(options), len(options), id(link_s), allowed_mask, num_layers, saturated, max_stages, bound_step)
    prep = stats.prepared
    if prep is None or prep[0] != key or prep[1] is not options or prep[2] is not link_s:
        prep = stats.prepared = (key, options, link_s, _prepare(options, link_s, num_layers, saturated, allowed_mask,
                                                                max_stages, bound_step))
    if prep[3] is None:
        return None
    idx, by_stop, cands, n_cap, fill_lb, period_lb, prefix, at_bound = prep[3]
    stats.candidates += len(cands)
    if period_lb == float("inf"):
        return None  # no cover of [0, L) at all
    if (m - 1) * period_lb + max(period_lb, fill_lb) >= incumbent_s:
        return None  # cannot beat the incumbent: not even one DP run
    cands = cands[bisect.bisect_left(cands, period_lb):]  # smaller bounds admit no cover at all
    rank = None
    if island_order is not None:
        rank = [len(island_order)] * (1 + max(max(island_order), max(options[oi].island for oi in idx)))
        for r, k in enumerate(island_order):
            rank[k] = r

    best: Composition | None = None
    closed_s = float("inf")  # the least closed form found here (with a score, best need not have it)
    memo: dict[float, tuple[tuple[int, ...], float] | None] = {}

    band = score is not None and score_band
    gate_s = incumbent_s if score is None or band else float("inf")  # what a returned plan must beat

    def beat_s() -> float:
        """Prune what cannot beat this (closed-form units): the incumbent, or the least closed form found (the
        best plan's, without a score); with ``score_band`` the larger of that and the best score."""
        if band:
            return min(incumbent_s, max(best.objective_s, closed_s) if best else float("inf"))
        return min(incumbent_s, closed_s)

    def consider(seq: tuple[int, ...], metrics: Metrics, bound: float) -> None:
        """Keep ``seq`` if it beats the best plan so far (by score where there is one)."""
        nonlocal best, closed_s
        closed_s = min(closed_s, metrics.latency_s)
        stats.best_closed_s = min(stats.best_closed_s, metrics.latency_s)
        comp = Composition(seq, metrics, bound)
        if score is not None:
            if score_floor is not None and score_floor(seq, metrics) >= min(
                    score_incumbent_s, best.objective_s if best is not None else float("inf")):
                return  # cannot beat the best score: not simulated
            comp = Composition(seq, metrics, bound, score(seq, metrics))
            stats.scored.append(comp)
        if comp.objective_s < gate_s and (best is None or comp.objective_s < best.objective_s):
            best = comp

    def run(bound: float) -> tuple[tuple[int, ...], float] | None:
        """The DP at one bound (once per bound); its plan is compared with the best global plan (3)."""
        if bound in memo:
            return memo[bound]
        beat = beat_s()
        prune = (m - 1, period_lb, prefix, beat) if beat < float("inf") else None
        found = memo[bound] = _dp_at_bound(options, by_stop, link_s, num_layers, n_cap, saturated, bound,
                                           required_mask, max_stages, stats, prune, rank, at_bound)
        metrics = evaluate(found[0], options, link_s, m) if found else None
        stats.trace.append((bound, metrics.latency_s if metrics else None))
        if metrics is not None and (score is not None or best is None or metrics.latency_s < best.latency_s):
            consider(found[0], metrics, bound)
        return found

    # a plan of one option (a whole-model slice plan on one island) needs no DP; it seeds the best plan so that
    # the DP runs can prune against it from the start
    for oi in idx:
        o = options[oi]
        if o.start == 0 and o.stop == num_layers and required_mask & ~(1 << o.island) == 0 \
                and (max_stages is None or o.num_stages <= max_stages):
            metrics = evaluate((oi,), options, link_s, m)
            if metrics is not None and (score is not None or metrics.latency_s < incumbent_s):
                consider((oi,), metrics, o.bottleneck_s)
    # (1) the loosest bound gives a first plan and F(max) = the least fill + tail of any plan
    loosest = run(cands[-1])
    if loosest is None:
        return best
    # (2)-(4) relax the bound from the smallest candidate up. F(B), the least fill + tail with every stage and link
    # <= B, falls as B grows, so every plan whose period lies in (cands[lo - 1], cands[hi]] takes at least
    # (m - 1) * cands[lo] + max(cands[lo], F(cands[hi])): an interval of bounds whose floor cannot beat the best
    # plan (or the incumbent) is skipped whole; otherwise its middle bound is tried and both halves follow, the
    # lower first. An infeasible middle bound makes every smaller one infeasible. This tries the bounds the
    # paper's one-by-one relaxation would, minus those that provably cannot improve the latency.
    stack = [(0, len(cands) - 1, loosest[1])]  # (lo, hi, F(cands[hi])); cands[hi] has been tried
    while stack:
        lo, hi, f_hi = stack.pop()
        beat = beat_s()
        if lo == hi or (m - 1) * cands[lo] + max(cands[lo], f_hi, fill_lb) >= beat:
            continue
        mid = (lo + hi) // 2
        found = run(cands[mid])
        stack.append((mid + 1, hi, f_hi))
        if found is not None:
            stack.append((lo, mid, found[1]))
    if best is not None and best.objective_s >= gate_s:
        return None
    return best
