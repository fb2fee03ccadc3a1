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

The paper relaxes a bound B on the slowest stage from the ranked bottlenecks of all slice plans, running a DP per
bound that memoises the best (fill, tail) per state and discards unbalanced (> B) or infeasible sequences. This
kernel runs one DP instead: sequences are built from the BACK of the pipeline, adding options in front, and each
state keeps the Pareto front of (fill, tail, stages behind, period) -- the period is a dimension of the front
rather than a bound, so one pass holds the least fill + tail at every period, i.e. what every bound of the
paper's relaxation would find. A partial sequence is dropped as soon as its cheapest completion cannot beat the
best plan: (m - 1) x max(its period, the least period of the layers in front) + its fill + the least fill in front
+ its tail, where "in front" is covered only by the islands the sequence leaves free, each once (exact: a plan that
beats the bound is represented at every step by an entry with no more fill, tail, stages or period). The bound comes
first from the single-island plans and a quick plan (the same DP keeping two entries per state), so the exact pass
prunes hard from its first layer. ``bound_step`` > 0 compares periods by bucket on a geometric grid (fewer
entries, not exact: at most (m - 1) x bound_step x the period slower). ``reference.py`` checks it by brute force;
``bounds.py`` holds every floor it prunes by, with why each is safe.

Reading order: compose (the entry: prepare the option set, then _Search's steps: single-island plans, the quick
plan, the exact pass, the complete pass where the score interleaves, each offering plans to the best so far), _dp
(one pass: _state_front, _expand_state, _add_options, _option_score_floor, _add_entries, _candidates over Entry
tuples; _entries_at_once and _hopeful_at_once: the same steps in numpy for big states and groups; _seen and
_uncovered: the entries and options it leaves out before pareto_front would drop what they make). dominance.py
holds what stands for what (a state's Pareto front, the options another covers or beats), front_classes.py the
islands a merged state keys together.

The closed form is the search's objective, and exact for it. The Plan reports the 1F1B event simulation, which
also charges the inter-island p2p where it lies on the steady state's cycle (stage k's backward waits for the
round trip to stage k + 1: ((t_k + t_k+1) / 2 + p) per micro-batch can exceed the slowest stage), so the two can
rank close plans the other way. A driver that passes ``score`` (the iteration the Plan would report for a
sequence: the simulation, or the interleaved schedule where faster) gets the plan with the least score among the
candidates: the complete plans the exact pass keeps (non-dominated in fill, tail, stages and period within their
state, so they include what the paper's DP finds at every bound) whose closed form can beat the best closed form,
or whose score floor (m x period + tail, under any score: interleaving can put a score well below the closed
form) can beat the best score; the closed form's optimum is always among them. With ``score_band`` the closed
forms are pruned against the larger of the best score and the least closed form instead. Where the score can be an
interleaved simulation (``score_schedules`` holding "interleaved") no dominance orders it: it reads each stage's
time, needs the stage count to divide m and gives a chunk one layer at least, so a sequence with more fill, stages
or period, or an option another beats in all the DP sees, can score less. There a complete pass follows over the
sequences that can interleave (no dominance, no option standing for another; only the score floors prune, against
the best score the exact pass found): the plan's score is no more than any composition's interleaved score. Where
the score can be the plain simulation the complete pass covers every sequence (plain_complete.py). With merged
fronts (the driver's search over many islands) there is no complete pass: without dominance it would enumerate
every island set's sequences.

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

import numpy as np

from tangram_launch.costmodel.pipeline import pipeline_latency_s
from tangram_launch.costmodel.interleaved_schedule import FLOOR_ROUNDING
from tangram_launch.planner.bounds import FitPrefixBounds, PrefixBounds, cycles_s, front_link_s, round_trips_s, \
    score_floor_terms
from tangram_launch.planner.dominance import covered_rooms, pareto_front
from tangram_launch.planner.front_classes import front_classes, merged_states  # (merged_states: for the driver)
from tangram_launch.planner.plain_complete import behind_path_s, behind_paths_s, own_stages_s, plain_counts

_AFTER = operator.itemgetter(2)
_BEAM = 2  # entries per state in the quick plan's DP
# the fitting fronts (bounds.FitPrefixBounds) are read in front of a state of this many entries or more: their covers
# cost a binary search per set of free islands and layer, which a state of few entries does not pay back
_FIT_AT = 16
_INF = float("inf")
SCORE_ANY = ("any",)  # compose's score may be anything: its floor is bounds.score_floor_terms's with w = 0
# stage times in the DP's cycle floors are taken this much lower: a slice plan's numbers sum forward and backward
# once, the simulation reads them apart (an ulp's difference must not prune a plan that ties)
_EDGE_SHRINK = 1.0 - 1e-9
_COMPACT_AT = 4096  # entries gathered for one DP state before they are reduced to their Pareto front
_NO_FLOOR = (0.0,) * 8  # an _Offer's floor fields where nothing prunes (never read)
# an option goes in front of this many entries or more of a state at once, in numpy (_entries_at_once): the same
# floats in the same order as _add_entries' loop, whose per-entry cost dominates the complete pass's big states
_VECTOR_AT = 48


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
    bound_s: float  # its period: the bottleneck bound at which the paper's relaxation finds it
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
    dp_runs: int = 0  # DP passes (a quick one and an exact one per call)
    states: int = 0  # DP entries expanded
    candidates: int = 0  # plans offered from the exact passes' fronts
    trace: list = field(default_factory=list)  # (period_s, latency_s) of every plan offered, in order
    scored: list = field(default_factory=list)  # every composition a score was computed for (score given)
    best_closed_s: float = float("inf")  # the least closed-form latency of any composition found
    # the last option set's preparation (_prepare), for the next call on the same set: above five islands the
    # driver composes one set in up to a few hundred island orders (orders.py), and preparing it is most of a call
    prepared: PreparedSet | None = field(default=None, repr=False, compare=False)

    def threshold_s(self, best_score_s: float | None, band: bool = False) -> float:
        """What a driver passes on as ``incumbent_s`` once it holds a plan scored ``best_score_s``: the least
        closed form found (the closed-form search prunes as without a score); with ``band``, the larger of that
        and the best score, so every plan whose closed form beats the best score is searched too."""
        if best_score_s is None:
            return float("inf")
        return max(best_score_s, self.best_closed_s) if band else self.best_closed_s


def evaluate(seq: Sequence[int], options: Sequence[Option], link_s: Sequence[Sequence[float]],
             num_microbatches: int, *, links_s: Sequence[float] | None = None) -> Metrics | None:
    """Latency of a front-to-back sequence of options; None if some option does not fit at its position.
    ``links_s``: the p2p at each boundary where known exactly (build.Candidates.boundaries_s), else link_s's."""
    after = 0
    for oi in reversed(seq):
        if options[oi].max_after < min(after, num_microbatches - 1):
            return None
        after += options[oi].num_stages
    links = tuple(links_s) if links_s is not None else tuple(
        link_s[options[a].island][options[b].island] for a, b in zip(seq, seq[1:]))
    period = max([options[oi].bottleneck_s for oi in seq] + list(links))
    fill = sum(options[oi].time_s for oi in seq) + 2.0 * sum(links)
    tail = max(options[oi].tail_s for oi in seq)
    return Metrics(pipeline_latency_s(num_microbatches, period, fill, tail), period, fill, tail, links)


def _by_floor(options: Sequence[Option], idx: list[int], mask: int | None, floor_terms: tuple,
              cache: dict) -> tuple[list[int], list[float], list[int]]:
    """A (stop, island) group's options by increasing floor when the layers in front are covered by the islands
    in ``mask``: (m - 1) x max(period_lb, pre_period[start], bottleneck) + pre_fill[start] + time, the prune's
    floor without the link and the sequence behind (so the DP cuts a group's hopeless tail by one bisection);
    mask None: in their own order. Third, per option in that order, covered_rooms."""
    key = (id(idx), mask)
    hit = cache.get(key)
    if hit is not None and hit[0] is idx:
        return hit[1]
    if mask is None:
        out = (idx, [], covered_rooms(options, idx))
    else:
        m1, period_lb, prefix, link_s = floor_terms
        pre_fill, pre_period, _, _ = prefix(mask)
        lk = front_link_s(link_s, mask, options[idx[0]].island, cache)
        if len(idx) >= _VECTOR_AT:
            out = _by_floor_at_once(options, idx, (m1, period_lb, pre_fill, pre_period, lk), floor_terms, cache)
            cache[key] = (idx, out)
            return out
        # m = 1 has no steady state (and 0 x an unreachable prefix's inf period would be nan, which breaks the sort)
        rows = sorted(((m1 * max(period_lb, pre_period[o.start], o.bottleneck_s, lk if o.start else 0.0) if m1
                        else 0.0) + pre_fill[o.start] + (2.0 * lk if o.start else 0.0) + o.time_s, k)
                      for k, oi in enumerate(idx) for o in (options[oi],))
        # an option's floor is no less than that of an earlier option of its layers with no more time and
        # bottleneck, so the covering options stay in front of it (ties keep idx's order): the rooms carry over
        rooms = _by_floor(options, idx, None, floor_terms, cache)[2]
        out = ([idx[k] for _, k in rows], [g for g, _ in rows], [rooms[k] for _, k in rows])
    cache[key] = (idx, out)
    return out


def _by_floor_at_once(options: Sequence[Option], idx: list[int], terms: tuple, floor_terms: tuple,
                      cache: dict) -> tuple[list[int], list[float], list[int]]:
    """_by_floor's answer for a group of many options, in numpy: each option's floor by the same float operations
    in the same order, and a stable sort by it (ties in idx's order, as sorting (floor, position) pairs)."""
    m1, period_lb, pre_fill, pre_period, lk = terms
    key = ("floor columns", id(idx))
    hit = cache.get(key)
    if hit is None or hit[0] is not idx:  # the group's columns, once per prepared set
        n = len(idx)
        hit = cache[key] = (idx, np.asarray(idx, dtype=np.int64),
                            np.fromiter((options[oi].start for oi in idx), dtype=np.int64, count=n),
                            np.fromiter((options[oi].bottleneck_s for oi in idx), dtype=np.float64, count=n),
                            np.fromiter((options[oi].time_s for oi in idx), dtype=np.float64, count=n),
                            np.asarray(_by_floor(options, idx, None, floor_terms, cache)[2], dtype=np.int64))
    _, at, start, bn, time_s, rooms = hit
    on = start > 0
    floor = np.zeros(len(idx))  # m = 1 has no steady state (and 0 x an unreachable prefix's inf period is nan)
    if m1:
        slowest = np.maximum(np.maximum(np.maximum(period_lb, np.asarray(pre_period, dtype=np.float64)[start]), bn),
                             np.where(on, lk, 0.0))
        floor = m1 * slowest
    floor = floor + np.asarray(pre_fill, dtype=np.float64)[start] + np.where(on, 2.0 * lk, 0.0) + time_s
    order = np.argsort(floor, kind="stable")
    return at[order].tolist(), floor[order].tolist(), rooms[order].tolist()


def _uncovered(options: Sequence[Option], idx: list[int], floor_terms: tuple,
               cache: dict) -> tuple[list[int], list[int]]:
    """A group's options in their own order and their covered rooms (_by_floor's), without the options covered
    wherever they fit: an earlier option covers one in front of the entries with at most its room (covered_rooms)
    stages behind, and one fits in front of those with at most its max_after, so where the room is no less
    _add_options offers it in front of no entry (its ``lo`` >= ``fits``); cached beside _by_floor's. Not for a
    complete pass, where no option covers another."""
    key = ("uncovered", id(idx))
    hit = cache.get(key)
    if hit is not None and hit[0] is idx:
        return hit[1]
    order, _, rooms = _by_floor(options, idx, None, floor_terms, cache)
    keep = [k for k, (oi, room) in enumerate(zip(order, rooms)) if room < options[oi].max_after]
    out = ([order[k] for k in keep], [rooms[k] for k in keep])
    cache[key] = (idx, out)
    return out


class Entry(NamedTuple):
    """One DP entry: a sequence covering [j, L), by what its completion reads. The DP builds entries as plain
    tuples of these fields in this order (its hottest line) and reads them by position or by unpacking."""

    fill_s: float
    tail_s: float
    after: int  # stages in the sequence, capped at the pass's n_cap
    period_s: float  # its slowest stage or link
    option: int  # the option added in front (index into options); -1: the empty sequence at j = L
    parent: tuple | None  # its parent's key in tables[option.stop]
    pos: int  # its parent's position in that key's front
    plain_s: float  # max over its options o of m x o's bottleneck + the fill in front of o within the sequence


class Candidate(NamedTuple):
    """A complete sequence the DP returns (fill, tail, period of its closed form; the option indices front to back)."""

    fill_s: float
    tail_s: float
    period_s: float
    options: tuple[int, ...]


class Prepared(NamedTuple):
    """What compose needs of an option set before any DP run, whatever the island order (_prepare)."""

    idx: list[int]  # the usable options
    by_stop: list[list[tuple]]  # per stop j: (island, 1 << island, that group's option indices), by island
    n_cap: int  # "after" is capped here: beyond it no memory check changes
    fill_lb: float  # least fill of any cover of [0, L)
    period_lb: float  # least period of any cover of [0, L)
    prefix: "PrefixBounds"  # per prefix and set of islands
    cache: dict  # the groups' orders by floor and the least links in front (_by_floor, front_link_s)
    cls: list[int]  # front_classes over every island with options
    stage_lb: float  # least slowest stage of any cover of [0, L), without links
    single: list[int]  # the options covering [0, L) (plans of one option), in idx's order
    rows: np.ndarray | None = None  # the options as Candidates.option_rows, where the caller gave them


class PreparedSet(NamedTuple):
    """ComposeStats.prepared: the last option set's preparation and what identifies that set."""

    key: tuple
    options: Sequence[Option]
    link_s: Sequence[Sequence[float]]
    prepared: Prepared | None


class _Front(NamedTuple):
    """One DP state's Pareto front (sorted by ``after``) and its running minima over the first k entries, at k - 1:
    what an option's floor reads of the entries it fits in front of (a prefix of the front)."""

    entries: list
    afters: list[int]  # following stages costing memory, capped at m - 1
    least_ft: list[float]  # least fill + tail
    least_f: list[float]  # least fill
    least_a: list[float]  # least plain_s (least_f where the plain floor does not count)
    least_tf: list[float] | None  # least first-stage time of the entries' front options (edge_s)
    columns: tuple | None = None  # the entries' columns where _front_at_once made them (_front_columns)


class _Group(NamedTuple):
    """What the options of one (stop, island) group share in front of one DP state."""

    front_island: int  # the state's front island (-1: the empty sequence)
    link: float  # the link from this island into that front
    tkey: tuple  # the key of the entries it makes, in tables[start]
    lk: float  # the least link into this island from an island free in front of it
    pre_fill: list[float]  # the least of any cover of [0, start) by those free islands (PrefixBounds)
    pre_period: list[float]
    pre_tail: list[float]
    pre_stage: list[float]
    mask: int  # the islands free in front of it (0 where nothing prunes)


class _Offer(NamedTuple):
    """One option offered in front of a DP state (_add_options), with what its entries are judged by: the floors of
    any completion in front of the option (zeros where nothing prunes, never read). The DP builds offers as plain
    tuples of these fields in this order (building this type costs measurably more in the hot loop) and unpacks
    them."""

    option: int  # index into options
    lo: int  # the first entry it goes in front of (those before, an earlier option covers: covered_rooms)
    fits: int  # one past the last entry it fits in front of
    start: int  # its first layer
    num_stages: int
    tail_s: float
    add_s: float  # the fill it adds: its time and the link into the state's front, both ways
    period_s: float  # the period it adds: its bottleneck or that link
    m_bottleneck_s: float  # m x its bottleneck
    per_lb: float  # least period of any completion
    base: float  # least fill in front of the option and the option's own (with its link)
    in_front: float  # base less the option's own
    tail_lb: float  # least tail
    ps: float  # m x the least slowest stage (under any score)
    trips_on: bool  # the boundaries it adds have a link or stages (plain floor's round trips)
    stage_s: float  # max(ps, m x its bottleneck + wo x in_front): the score floor's part but for the fill
    plain_only: bool  # the plain floor alone counts


class EdgeTimes(NamedTuple):
    """compose's ``edge_s`` as the DP's cycle floors read them, per option: its first and its last stage's forward +
    backward seconds, each taken _EDGE_SHRINK lower (once per compose call: every pass reads the same)."""

    first: list[float]
    last: list[float]

    @classmethod
    def of(cls, edge_s: Sequence[tuple[float, float]]) -> "EdgeTimes":
        return cls([e[0] * _EDGE_SHRINK for e in edge_s], [e[1] * _EDGE_SHRINK for e in edge_s])


class _Pass:
    """One DP pass over a prepared option set: the constants every step of _dp reads (see _dp for what they mean),
    and the tables. Bound once per pass; the steps copy what their loops read into locals."""

    __slots__ = ("options", "link_s", "num_layers", "m", "m1", "required", "beat", "score_beat", "stats", "rank",
                 "beam", "quantum", "prep", "merge", "cls", "plain", "only_plain", "w", "score_only",
                 "by_score", "keep", "prune", "floor_terms", "slack", "shrink", "before", "stage_cap", "trips",
                 "edged", "c1", "c0", "t_first", "t_last", "tables", "option_terms", "entry_terms", "complete",
                 "chunked", "hopeful", "fit", "fit_cuts", "arrays", "seen")

    def __init__(self, options: Sequence[Option], prep: Prepared, link_s: Sequence[Sequence[float]],
                 num_layers: int, num_microbatches: int, required: int, max_stages: int | None, beat: float,
                 stats: ComposeStats, rank: Sequence[int] | None, beam: int | None, quantum: float,
                 score_beat: float, fill_weight: float, schedules: tuple[str, ...], merge_fronts: bool,
                 edge_s: EdgeTimes | None, complete: bool = False) -> None:
        self.options, self.link_s, self.num_layers, self.required = options, link_s, num_layers, required
        # complete: no entry stands for another (no dominance), only the score floors prune (see _dp)
        self.complete = complete
        # per group: its options that can interleave (_interleavable); None where a plain score counts too (every
        # option can take part: plain_complete.py)
        self.chunked: dict | None = None if plain_counts(schedules) else {}
        self.hopeful: dict = {}  # per group and set of free islands in front: its options that may beat (_hopeful)
        if complete:
            beat = _INF
        # the score floors sum in another order than the simulations: a floor prunes only FLOOR_ROUNDING above it
        score_beat = score_beat / (1.0 - FLOOR_ROUNDING)
        self.beat, self.score_beat, self.stats, self.rank, self.beam = beat, score_beat, stats, rank, beam
        self.quantum, self.prep = quantum, prep
        self.merge = merge_fronts and rank is None
        self.cls = prep.cls if self.merge else range(len(prep.cls))
        m = self.m = num_microbatches
        self.m1 = m - 1
        self.plain, self.only_plain, self.w = score_floor_terms(schedules, fill_weight)
        # with a known score (its floor holds) and a best score to beat, an entry is kept only while its score floor
        # can beat it: the closed form is a proxy, and what the closed form alone would keep scores no better
        self.score_only = (self.plain or self.w > 0.0 or complete) and score_beat < _INF
        self.by_score = score_beat < _INF
        self.keep = -1 if rank is None else required  # bits of "used" that the key remembers
        self.prune = beat < _INF or self.score_only
        self.floor_terms = (self.m1, prep.period_lb, prep.prefix, link_s)
        # the skips sum in another order than the check: keep, not skip
        self.slack = 1e-9 * abs(beat) if beat < _INF else 0.0
        self.shrink = 1.0 / (1.0 + quantum)  # least period in an entry's bucket, relative to its own
        self.before = None
        if rank is not None:  # island k's option may have in front only islands ranked before k
            self.before = [sum(1 << i for i in range(len(rank)) if rank[i] < rank[k]) for k in range(len(rank))]
        self.stage_cap = max_stages if max_stages is not None else _INF
        self.edged = self.plain and edge_s is not None
        self.trips = self.c1 = self.c0 = self.t_first = self.t_last = None
        if self.plain:
            self.trips, self.c1, self.c0 = _trip_tables(prep, m, prep.n_cap + num_layers + 1)
        if self.edged:
            self.t_first, self.t_last = edge_s
        # where only the score floor judges: the covers in front by what fits in front of the stages behind
        self.fit = _fit_prefix(prep, options, link_s, num_layers, self.m1) if self.score_only and self.prune else None
        self.fit_cuts: dict = {}  # (mask, start) -> _fit_cut's
        self.arrays: tuple | None = None  # trips, c1, c0, t_first as numpy arrays (_pass_arrays)
        self.tables: list[dict] = [dict() for _ in range(num_layers + 1)]
        self.tables[num_layers][(0, -1)] = [(0.0, 0.0, 0, 0.0, -1, None, -1, 0.0)]
        self.seen: list[dict] = [dict() for _ in range(num_layers + 1)]  # per layer and state: _seen's
        # what _add_options and _add_entries read, per option, as one tuple each (one unpacking per call)
        self.option_terms = (options, m, self.m1, self.w, self.only_plain, self.plain, self.prune,
                             self.score_only, beat, self.edged, prep.period_lb, prep.stage_lb)
        self.entry_terms = (self.m1, beat, score_beat, self.score_only, self.shrink, self.plain, self.trips, self.c1,
                            self.c0, self.t_first, self.t_last, self.edged, self.stage_cap, prep.n_cap, quantum,
                            self.tables)


def _fit_prefix(prep: Prepared, options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int,
                saturated: int) -> FitPrefixBounds:
    """The prepared set's FitPrefixBounds (once per set, in its cache: every pass reads the same)."""
    hit = prep.cache.get("fit")
    if hit is None:
        hit = prep.cache["fit"] = FitPrefixBounds(options, prep.idx, num_layers, link_s, saturated, prep.rows,
                                                  prep.prefix)
    return hit


def _trip_tables(prep: Prepared, m: int, n: int) -> tuple[list[float], list[float], list[float]]:
    """The plain 1F1B floor's tables over the stages behind a boundary, n of them (once per prepared set and m, in
    its cache: every pass reads the same): trips[k] x a link = round_trips_s(link, k, m), the same product (a link
    is >= 0), and cycles_s(link, k, m, front, back) = trips[k] x link + c1[k] x back + c0[k] x front."""
    key = ("trips", m, n)
    hit = prep.cache.get(key)
    if hit is None:
        hit = prep.cache[key] = ([round_trips_s(1.0, k, m) for k in range(n)],
                                 [cycles_s(0.0, k, m, 0.0, 1.0) for k in range(n)],
                                 [cycles_s(0.0, k, m, 1.0, 0.0) for k in range(n)])
    return hit


def _dp(options: Sequence[Option], prep: Prepared, link_s: Sequence[Sequence[float]], num_layers: int,
        num_microbatches: int, required: int, max_stages: int | None, beat: float, stats: ComposeStats,
        rank: Sequence[int] | None = None, beam: int | None = None, quantum: float = 0.0,
        score_beat: float = float("inf"), fill_weight: float = 0.0,
        schedules: tuple[str, ...] = SCORE_ANY, merge_fronts: bool = False,
        edge_s: EdgeTimes | None = None, complete: bool = False) -> list[Candidate]:
    """Every sequence covering [0, L) that is not dominated (see pareto_front) and whose closed form can beat ``beat``.
    With ``beam``, each state keeps only that many entries, those of least (m - 1) x period + fill + tail (a quick
    plan, not exact).

    Sequences are built from the BACK of the pipeline, adding options in front; tables[j] maps the sequences
    covering [j, L) by
      key   = (used: bitmask of islands in the sequence (in island-order mode only the required ones),
               front: island of the sequence's first option, -1 for the empty sequence at j = L; with
               ``merge_fronts`` (not in island-order mode) its class, front_classes)
    to the Pareto front of their Entry tuples. The steps: _state_front (reduce a state to its front), _expand_state
    (each group of options that may go in front of it), _add_options (drop an option no completion of which can
    beat the bounds), _add_entries (the entries it makes, each judged by its own floor), _candidates (the complete
    sequences, read back through the parents). The floors are bounds.py's DP rows.
    Exact: a sequence that beats ``beat`` is represented at every step by an entry with no more of anything, whose
    completion with the same front part beats it too; with ``quantum`` the periods compare by bucket, and the prune
    judges an entry by the least period of its bucket.

    ``complete``: no entry or option stands for another (no Pareto front, no covered options), and (unless a plain score
    counts: plain_complete.py) only options whose stages hold 2 layers at least take part (_interleavable): every such
    sequence whose score floor can beat ``score_beat`` is returned (all of them while it is inf), ``beat`` is not read.
    Exact for any score the floors lie under, however it ranks sequences of equal fill, tail, stages and period: the
    interleaved simulation (the stages must divide m; a chunk's share of each stage) ranks them its own way."""
    run = _Pass(options, prep, link_s, num_layers, num_microbatches, required, max_stages, beat, stats, rank, beam,
                quantum, score_beat, fill_weight, schedules, merge_fronts, edge_s, complete)
    stats.dp_runs += 1
    tables, by_stop = run.tables, prep.by_stop
    for j in range(num_layers, 0, -1):
        layer = tables[j]
        groups = by_stop[j]
        run.seen[j] = {}  # (its states are complete: what goes in front of them goes into earlier layers)
        if not layer or not groups:
            continue
        for key in list(layer):
            front = _state_front(run, layer, key)
            if front is not None:
                _expand_state(run, key, front, groups)
    return _candidates(run)


def _front_of(entries: list, run: _Pass) -> list:
    """A state's entries as its front: their Pareto front (pareto_front), or in a complete pass every entry, sorted by
    ``after`` (no entry stands for another there)."""
    if run.complete:
        entries.sort(key=_AFTER)
        return entries
    return pareto_front(entries, run.quantum)


def _state_front(run: _Pass, layer: dict, key: tuple) -> _Front | None:
    """Reduce a state's entries to their Pareto front (the quick plan's beam: its best few), with the running
    minima its options' floors read; None when it holds nothing."""
    front = _front_of(layer[key], run)
    beam, m1 = run.beam, run.m1
    if beam is not None and len(front) > beam:
        front = sorted(front, key=lambda e: m1 * e[3] + e[0] + e[1])[:beam]
        front.sort(key=_AFTER)
    layer[key] = front
    if not front:
        return None
    run.stats.states += len(front)
    if len(front) >= _VECTOR_AT:
        return _front_at_once(run, key, front)
    saturated = m1
    afters = [e[2] if e[2] < saturated else saturated for e in front]  # following stages costing memory
    least_ft = least_f = least_a = least_tf = None
    if run.prune:
        least_ft = list(itertools.accumulate([e[0] + e[1] for e in front], min))
        least_f = list(itertools.accumulate([e[0] for e in front], min))
        least_a = list(itertools.accumulate([e[7] for e in front], min)) if run.plain else least_f
    if run.edged and key[1] >= 0:
        t_first = run.t_first
        least_tf = list(itertools.accumulate([t_first[e[4]] for e in front], min))
    return _Front(front, afters, least_ft, least_f, least_a, least_tf)


def _front_at_once(run: _Pass, key: tuple, front: list) -> _Front:
    """_state_front's stages behind and running minima of a big state (a complete pass's hold thousands of
    entries), in numpy over its entries' columns: min is exact in any order, so the same values. The columns go on
    to _add_entries (_entries_at_once reads them)."""
    cols = _front_columns(front)
    fill, tail, after, _, first, plain_s = cols
    afters = np.minimum(after, run.m1).tolist()  # following stages costing memory
    least_ft = least_f = least_a = least_tf = None
    if run.prune:
        least_ft = np.minimum.accumulate(fill + tail).tolist()
        least_f = np.minimum.accumulate(fill).tolist()
        least_a = np.minimum.accumulate(plain_s).tolist() if run.plain else least_f
    if run.edged and key[1] >= 0:
        least_tf = np.minimum.accumulate(_pass_arrays(run)[3][first]).tolist()
    return _Front(front, afters, least_ft, least_f, least_a, least_tf, cols)


def _expand_state(run: _Pass, key: tuple, front: _Front, groups: list[tuple]) -> None:
    """Put each (stop, island) group of options that may go in front of the state ``key`` in front of it."""
    options, link_s, rank, prep = run.options, run.link_s, run.rank, run.prep
    prefix, cache, prune = prep.prefix, prep.cache, run.prune
    used, f = key
    if f >= 0 and run.merge:  # the key holds the front's class: any entry's front island has the same links
        f = options[front.entries[0][4]].island  # from every island not in ``used``
    batches: list[tuple[_Group, list[_Offer]]] = []
    for island, bit, gidx in groups:
        if used & bit:
            continue
        link = 0.0
        if f >= 0:
            if rank is not None and rank[island] >= rank[f]:
                continue
            link = link_s[island][f]
        tkey = ((used | bit) & run.keep, run.cls[island])
        if prune:
            mask = (~(used | bit) if rank is None else run.before[island]) & prefix.islands
            pre = prefix(mask)
            lk = front_link_s(link_s, mask, island, cache)  # the least link in front of a later start
            group = _Group(f, link, tkey, lk, *pre, mask)
        else:
            group = _Group(f, link, tkey, 0.0, (), (), (), (), 0)
        if run.complete:  # an option no worse in what the DP sees can still score worse: none covers another
            if run.chunked is not None:
                gidx = _interleavable(options, gidx, run.chunked)
            covered = [-1] * len(gidx)
        elif prune and not run.by_score:  # (the score's floor does not follow this order: no cut, no sort)
            gidx, floors, covered = _by_floor(options, gidx, mask, run.floor_terms, cache)
            gidx = gidx[:bisect.bisect_left(floors, run.beat - front.least_ft[-1] - 2.0 * link + run.slack)]
        else:
            gidx, covered = _uncovered(options, gidx, run.floor_terms, cache)
        if run.score_only and gidx:  # (then only the score floor judges an option)
            gidx, covered = _hopeful(run, (options[gidx[0]].stop, island, mask), gidx, covered, group)
        offers = _add_options(run, front, group, gidx, covered)
        if offers:
            batches.append((group, offers))
    if batches:
        _add_entries(run, key, front, batches)


def _hopeful(run: _Pass, key: tuple, gidx: list[int], covered: list[int],
             group: _Group) -> tuple[list[int], list[int]]:
    """The options of a group (with their covered rooms) that _add_options can offer where only the score floor
    judges: those whose max(m x the slowest stage of any cover, m x their bottleneck) + their least tail is below
    ``score_beat``. Both of _option_score_floor's floors are at least that, whatever the state (its other terms add
    what is >= 0, and a float sum never falls as a term grows), so every option dropped here would fail its check
    in front of every entry; a run of options of one start goes at once where m x the slowest stage + the least
    tail of its front alone cannot beat. Once per group, set of free islands in front and pass (``key``), in the
    group's order."""
    hit = run.hopeful.get(key)
    if hit is None and len(gidx) >= _VECTOR_AT:
        hit = run.hopeful[key] = _hopeful_at_once(run, gidx, covered, group)
    elif hit is None:
        options, m, beat = run.options, run.m, run.score_beat
        stage_lb, pre_stage, pre_tail = run.prep.stage_lb, group.pre_stage, group.pre_tail
        kept, rooms = [], []
        at = dead = ps = pt = None
        for oi, room in zip(gidx, covered):
            start, _, _, _, _, _, bn, tail = options[oi]
            if start != at:  # (a group lists the options of one start together)
                at = start
                ps = m * (stage_lb if stage_lb > pre_stage[start] else pre_stage[start])  # as _add_options has it
                pt = pre_tail[start]
                dead = ps + pt >= beat
            if dead:
                continue
            mb = m * bn
            if (ps if ps > mb else mb) + (tail if tail > pt else pt) < beat:
                kept.append(oi)
                rooms.append(room)
        hit = run.hopeful[key] = (kept, rooms)
    return hit


def _hopeful_at_once(run: _Pass, gidx: list[int], covered: list[int], group: _Group) -> tuple[list, list]:
    """_hopeful's answer for a group of many options, in numpy: the same floats per option in the same order (its
    loop's test of a whole start, ps + pt, is the same for each option of that start)."""
    at, starts, bn, tail, rooms = _hopeful_columns(run, gidx, covered)
    m, beat, stage_lb = run.m, run.score_beat, run.prep.stage_lb
    pre_stage, pt = _cover_columns(run, group.pre_stage, group.pre_tail)
    pre_stage, pt = pre_stage[starts], pt[starts]
    ps = m * np.where(stage_lb > pre_stage, stage_lb, pre_stage)
    mb = m * bn
    keep = ~(ps + pt >= beat) & (np.where(ps > mb, ps, mb) + np.where(tail > pt, tail, pt) < beat)
    pos = np.flatnonzero(keep)
    return at[pos].tolist(), rooms[pos].tolist()


def _hopeful_columns(run: _Pass, gidx: list[int], covered: list[int]) -> tuple[np.ndarray, ...]:
    """A group's options (a list made once per prepared set or pass: _uncovered's, _interleavable's) as columns for
    _hopeful_at_once: the options, their start, bottleneck and tail, and their covered rooms (which come with the
    list); once a pass, from the prepared set's rows where the caller gave them (rows[i] is options[i])."""
    key = ("columns", id(gidx))
    hit = run.hopeful.get(key)
    if hit is None or hit[0] is not gidx:
        at, rows = np.array(gidx, dtype=np.int64), run.prep.rows
        if rows is not None:
            sub = rows[at]
            starts, bn, tail = sub[:, 0].astype(np.int64), sub[:, 6].copy(), sub[:, 7].copy()
        else:
            options = run.options
            starts = np.array([options[oi].start for oi in gidx], dtype=np.int64)
            bn = np.array([options[oi].bottleneck_s for oi in gidx], dtype=np.float64)
            tail = np.array([options[oi].tail_s for oi in gidx], dtype=np.float64)
        hit = run.hopeful[key] = (gidx, (at, starts, bn, tail, np.asarray(covered, dtype=np.int64)))
    return hit[1]


def _cover_columns(run: _Pass, *lists: list[float]) -> tuple[np.ndarray, ...]:
    """Lists of a cover of the layers in front (PrefixCovers': PrefixBounds keeps each set's, the same lists every
    time) as arrays, once per list and pass."""
    out = []
    for values in lists:
        key = ("cover", id(values))
        hit = run.hopeful.get(key)
        if hit is None or hit[0] is not values:
            hit = run.hopeful[key] = (values, np.asarray(values, dtype=np.float64))
        out.append(hit[1])
    return tuple(out)


def _interleavable(options: Sequence[Option], gidx: list[int], memo: dict) -> list[int]:
    """The options of a group whose stages hold 2 layers at least (a chunk per layer, 2 chunks at least: a pipeline
    holding any other cannot interleave); once per group and pass, in ``memo``."""
    hit = memo.get(id(gidx))
    if hit is None or hit[0] is not gidx:
        hit = memo[id(gidx)] = (gidx, [oi for oi in gidx if options[oi].stop - options[oi].start
                                        >= 2 * options[oi].num_stages])
    return hit[1]


def _add_options(run: _Pass, front: _Front, group: _Group, gidx: list[int], covered: list[int]) -> list[_Offer]:
    """Each option of a group in front of the entries it fits in front of, unless an earlier option covers them
    (covered_rooms) or no completion in front of any of them can beat the bounds: the closed form (m - 1) x period
    + fill + tail against ``beat``, else the score floor against ``score_beat`` (_option_score_floor). The option's
    floors go on to _add_entries in its _Offer, which judges each entry by them."""
    options, m, m1, w, only_plain, plain, prune, score_only, beat, edged, period_lb, stage_lb = run.option_terms
    afters, least_f, least_ft = front.afters, front.least_f, front.least_ft
    f, link, _tkey, lk, group_fill, group_period, group_tail, group_stage, mask = group
    fit = run.fit if len(afters) >= _FIT_AT else None
    offers = []
    for oi, room in zip(gidx, covered):
        start, stop, _, ns, max_after, time_s, bn, tail = options[oi]
        fits = bisect.bisect_right(afters, max_after)  # entries it fits in front of: a prefix
        if not fits:
            continue
        lo = bisect.bisect_right(afters, room) if room >= 0 else 0  # entries an earlier option covers
        if lo >= fits:
            continue
        if fit is not None and start:  # the fronts that fit in front of the fewest stages behind here, and no
            # entry with so many stages behind that nothing in front of it can beat the best score
            fits = _fit_end(run, mask, afters, lo, fits, ns, start)
            if lo >= fits:
                continue
            pre_fill, pre_period, pre_tail, pre_stage = fit(afters[lo] + ns)(mask)
        else:
            pre_fill, pre_period, pre_tail, pre_stage = group_fill, group_period, group_tail, group_stage
        add = time_s + 2.0 * link
        per = bn if bn > link else link  # the period it adds
        if prune:
            wo, plain_only = w, only_plain
            if w > 0.0:  # its least stage has at most q layers: v <= q chunks, none below 2
                q = (stop - start) // ns
                if q * w < 1.0:
                    if q >= 2:
                        wo = 1.0 / q
                    elif plain:
                        plain_only = True
            if start:
                per_lb = max(period_lb, pre_period[start], per, lk) if m1 else 0.0
                base = pre_fill[start] + add + 2.0 * lk
            else:
                per_lb = max(period_lb, pre_period[start], per) if m1 else 0.0
                base = pre_fill[start] + add
            in_front = base - add  # (as the floors below always summed it)
            if base == _INF:
                continue  # the islands free in front of it cannot cover [0, start)
            tail_lb = tail if tail > pre_tail[start] else pre_tail[start]
            # any stage's m micro-batches: the slowest of any cover, or of those in front
            ps = m * (stage_lb if stage_lb > pre_stage[start] else pre_stage[start])
            trips_on = plain and (link or start or (edged and f >= 0))  # a boundary with a link or stages
            stage_s = m * bn + wo * in_front  # its slowest stage after the front's chunks (1/v of each, v <= 1/wo)
            offer = (oi, lo, fits, start, ns, tail, add, per, m * bn, per_lb, base, in_front, tail_lb, ps, trips_on,
                     stage_s if stage_s > ps else ps, plain_only)  # an _Offer
            lf = least_f[fits - 1] + tail_lb
            lft = least_ft[fits - 1]
            if (score_only or m1 * per_lb + base + (lf if lf > lft else lft) >= beat) and \
                    _option_score_floor(run, front, group, offer) >= run.score_beat:
                continue  # no entry it fits in front of can beat: the check in _add_entries fails for each
            offers.append(offer)
        else:
            offers.append((oi, lo, fits, start, ns, tail, add, per, m * bn) + _NO_FLOOR)  # an _Offer
    return offers


def _fit_end(run: _Pass, mask: int, afters: list[int], lo: int, fits: int, ns: int, start: int) -> int:
    """One past the last entry of lo .. fits - 1 (by increasing stages behind) in front of which, with an option of
    ``ns`` stages at layer ``start``, some front of the islands of ``mask`` can still beat the best score: fewer
    stages behind than _fit_cut's."""
    key = (mask, start)
    n = run.fit_cuts.get(key)
    if n is None:
        n = run.fit_cuts[key] = _fit_cut(run, mask, start)
    return fits if n > run.m1 else bisect.bisect_left(afters, n - ns, lo, fits)


def _fit_cut(run: _Pass, mask: int, start: int) -> int:
    """The fewest stages behind a front of [0, start) by the islands of ``mask`` at which none that fits in front
    of them (FitPrefixBounds) can beat the best score: m x its slowest stage + its tail, under every score floor of
    _add_entries, grows with the stages behind (fewer options fit). m (saturated + 1): every front may beat it."""
    fit, m, stage_lb, beat = run.fit, run.m, run.prep.stage_lb, run.score_beat
    lo, hi = 0, run.m
    while lo < hi:
        n = (lo + hi) // 2
        covers = fit(n)(mask)
        stage = covers.stage_period_s[start]
        if covers.fill_s[start] == _INF or m * (stage if stage > stage_lb else stage_lb) + covers.tail_s[start] >= beat:
            hi = n
        else:
            lo = n + 1
    return lo


def _option_score_floor(run: _Pass, front: _Front, group: _Group, offer: _Offer) -> float:
    """The least score floor of an offer (_add_options) in front of any of the first ``fits`` entries of a state: the
    floor under any score (bounds.score_floor_terms), or (and) the plain 1F1B floor (bounds.py)."""
    oi, _, fits, start, ns, _, add, _, mb, per_lb, base, in_front, tail_lb, ps, _, stage_s, plain_only = offer
    sf = base + front.least_f[fits - 1]
    sf = (stage_s if stage_s > sf else sf) + tail_lb
    if not run.plain:
        return sf
    a = add + front.least_a[fits - 1]
    a = in_front + (a if a > mb else mb)
    a = ps if ps > a else a
    ne = front.entries[fits - 1][2]  # the most stages behind, of the entries it fits
    if ne < run.prep.n_cap:  # (exact below the cap)
        link, lk, edged = group.link, group.lk, run.edged
        r = run.trips[ne] * link  # round_trips_s(link, ne, m)
        if edged and group.front_island >= 0:  # + cycles_s's stage times (non-increasing in n)
            r += run.c1[ne] * front.least_tf[fits - 1] + run.c0[ne] * run.t_last[oi]
        # as _add_entries, for the least fill and the most stages behind
        r += in_front
        o = run.options[oi]
        v = in_front + behind_path_s(0.0, run.m, o[6], own_stages_s(o[5], o[6]), 2.0 * link + front.least_f[fits - 1],
                                     ne + ns - 1)
        a = v if v > a else a
        if start:
            r2 = run.trips[ne + ns] * lk  # round_trips_s(lk, ne + ns, m)
            if edged:
                r2 += run.c1[ne + ns] * run.t_first[oi]
            r = r2 if r2 > r else r
        a = r if r > a else a
    pf = a + tail_lb
    return pf if plain_only or pf < sf else sf


def _add_entries(run: _Pass, key: tuple, front: _Front, batches: list[tuple[_Group, list[_Offer]]]) -> None:
    """The entries each offered option makes in front of the state ``key`` (per group, its offers from
    _add_options), in front of entries lo .. fits - 1, each kept while its closed form can beat ``beat`` or (with a
    score) its score floor can beat ``score_beat``."""
    (m1, beat, score_beat, score_only, shrink, plain, trips, c1, c0, t_first, t_last, edged, stage_cap, n_cap, quantum,
     tables) = run.entry_terms
    entries, prune, dominate = front.entries, run.prune, not run.complete
    options, m = run.options, m1 + 1
    cols = front.columns  # the entries' columns, once an option goes in front of many of them (_front_columns)
    for group, offers in batches:
        tkey, link, lk, edged_front = group.tkey, group.link, group.lk, edged and group.front_island >= 0
        two_link = 2.0 * link
        for offer in offers:
            oi, lo, fits, start, ns, tail, add, per, mb, per_lb, base, in_front, tail_lb, ps, trips_on, stage_s, \
                plain_only = offer
            bn_o, own_o = options[oi][6], own_stages_s(options[oi][5], options[oi][6]) if plain else 0.0
            tgt, seen = None, _seen(run, start, tkey) if dominate else None
            if fits - lo >= _VECTOR_AT:
                cols = cols if cols is not None else _front_columns(entries)
                _offer_at_once(run, key, cols, group, offer, own_o, seen)
                continue
            # the least fill of the entries this option made in front of earlier entries with its own tail and period,
            # the least any can have: one dominates a later entry of no less fill, which pareto_front would drop
            made = _INF
            for pos in range(lo, fits):
                e = entries[pos]
                e0, e1, e2, e3 = e[0], e[1], e[2], e[3]
                n2 = e2 + ns
                if n2 > stage_cap:
                    continue
                nf = e0 + add
                nt = e1 if e1 > tail else tail
                np_ = e3 if e3 > per else per
                if made <= nf:
                    continue
                n2 = n2 if n2 < n_cap else n_cap
                if seen is not None:
                    stair = seen.get((nt, np_))
                    if stair is not None:
                        i = bisect.bisect_right(stair[0], n2)
                        if i and stair[1][i - 1] <= nf:
                            continue
                a = add + e[7]
                a = mb if a < mb else a
                if plain:  # the plain floor counts the stages behind (plain_complete)
                    a = behind_path_s(a, m, bn_o, own_o, two_link + e0, e2 + ns - 1 if e2 < n_cap else m)
                if prune:
                    p = e3 * shrink
                    p = per_lb if p < per_lb else p
                    t = e1 if e1 > tail_lb else tail_lb
                    if score_only or m1 * p + base + e0 + t >= beat:
                        sf = base + e0
                        sf = (stage_s if stage_s > sf else sf) + t
                        if plain:
                            pf = a + in_front
                            pf = ps if ps > pf else pf
                            if e2 < n_cap and trips_on:
                                r = trips[e2] * link
                                if edged_front:
                                    r += c1[e2] * t_first[e[4]] + c0[e2] * t_last[oi]
                                r += in_front  # + micro-batch 0's way to the boundary and the last one's way back
                                if start:
                                    r2 = trips[e2 + ns] * lk
                                    if edged:
                                        r2 += c1[e2 + ns] * t_first[oi]
                                    r = r2 if r2 > r else r
                                if r > pf:
                                    pf = r
                            pf += t
                            sf = pf if plain_only or pf < sf else sf
                        if sf >= score_beat:
                            continue
                if tgt is None:
                    tgt = _target(tables[start], tkey, dominate, quantum)
                tgt.append((nf, nt, n2, np_, oi, key, pos, a))  # an Entry
                if seen is not None:
                    _seen_add(seen, (nt, np_), n2, nf)
                    if nf < made and nt == tail and np_ == per:
                        made = nf


def _seen(run: _Pass, start: int, tkey: tuple) -> dict:
    """Of the entries put into the state ``tkey`` of tables[start] so far, per (tail, period): the least fill at
    each number of stages behind, as a staircase (stages behind ascending, fills strictly falling: _seen_add). An
    entry made with no less fill than one of the same tail and period and no more stages behind is dropped before
    its floors are computed. Sound, and the same front: pareto_front sorts by (fill, tail, after, period), stable,
    and keeps an entry unless one before it in that order (an equal one: appended before it) has no more of each
    (periods by bucket), so it drops this one (the earlier entry, or one of the front that drops that one, stays in
    the list: _target's compaction keeps its front), and an entry it would drop is dropped by the earlier one too.
    The state is filled before it is expanded (every start is below the layer expanded), which clears the table
    (_dp)."""
    seen = run.seen[start]
    hit = seen.get(tkey)
    if hit is None:
        hit = seen[tkey] = {}
    return hit


def _seen_add(seen: dict, same: tuple, after: int, fill: float) -> None:
    """Put an entry of ``after`` stages behind and ``fill`` into _seen's staircase ``same`` (one it does not
    dominate: every step at or below ``after`` has more fill), dropping the steps it dominates."""
    stair = seen.get(same)
    if stair is None:
        seen[same] = ([after], [fill])
        return
    afters, fills = stair
    i = bisect.bisect_right(afters, after)
    k = i
    while k < len(fills) and fills[k] >= fill:
        k += 1
    afters[i:k] = [after]
    fills[i:k] = [fill]


def _offer_at_once(run: _Pass, key: tuple, cols: tuple, group: _Group, offer: tuple, own_o: float,
                   seen: dict | None) -> None:
    """_entries_at_once's entries of one offer into their state, those _add_entries' loop would drop as dominated
    left out (in the loop's order: its running least fill and _seen change only where an entry goes in)."""
    made = _entries_at_once(run, key, cols, group, offer, own_o)
    if not made:
        return
    if seen is not None:
        made = _not_seen(made, seen, offer[5], offer[7])
    if made:
        _target(run.tables[offer[3]], group.tkey, seen is not None, run.quantum).extend(made)


def _not_seen(made: list, seen: dict, tail: float, per: float) -> list:
    """The entries of ``made`` (one offer's, in order, each passing its floors) that _add_entries' loop appends:
    not of a fill at least its running least (of those appended with the offer's tail and period) or at least
    _seen's."""
    kept = []
    least_own = _INF
    for e in made:
        nf = e[0]
        if least_own <= nf:
            continue
        same = (e[1], e[3])
        stair = seen.get(same)
        if stair is not None:
            i = bisect.bisect_right(stair[0], e[2])
            if i and stair[1][i - 1] <= nf:
                continue
        kept.append(e)
        _seen_add(seen, same, e[2], nf)
        if nf < least_own and e[1] == tail and e[3] == per:
            least_own = nf
    return kept


def _target(table: dict, tkey: tuple, dominate: bool, quantum: float) -> list:
    """The state an offer's entries go to, made if new; a big one reduced to its Pareto front first (where entries
    dominate), so memory stays bounded: it is not expanded yet and nothing points into it."""
    tgt = table.get(tkey)
    if tgt is None:
        tgt = table[tkey] = []
    elif dominate and len(tgt) > _COMPACT_AT:
        tgt[:] = pareto_front(tgt, quantum)
    return tgt


def _front_columns(entries: list) -> tuple[np.ndarray, ...]:
    """A state's entries' fill, tail, after, period, front option and plain_s as arrays (_entries_at_once)."""
    n = len(entries)
    return tuple(np.fromiter((e[k] for e in entries), dtype=np.int64 if k in (2, 4) else np.float64, count=n)
                 for k in (0, 1, 2, 3, 4, 7))


def _pass_arrays(run: _Pass) -> tuple:
    """The pass's plain-floor tables and first-stage times as arrays, for gathers by stages behind (once a pass)."""
    if run.arrays is None:
        run.arrays = tuple(np.asarray(v, dtype=np.float64) if v is not None else None
                           for v in (run.trips, run.c1, run.c0, run.t_first))
    return run.arrays


def _entries_at_once(run: _Pass, key: tuple, cols: tuple, group: _Group, offer: tuple, own_o: float) -> list:
    """The entries one offer makes in front of entries lo .. fits - 1 of a state, as _add_entries' loop makes them
    (the same float operations in the same order, elementwise, so the same values and the same entries kept), in
    numpy: a complete pass's states hold hundreds of entries. Those the loop drops as dominated (where entries
    dominate) are left to _not_seen, in order."""
    (m1, beat, score_beat, score_only, shrink, plain, _, _, _, _, t_last, edged, stage_cap, n_cap, _,
     _) = run.entry_terms
    oi, lo, fits, start, ns, tail, add, per, mb, per_lb, base, in_front, tail_lb, ps, trips_on, stage_s, \
        plain_only = offer
    m = m1 + 1
    e0, e1, e2, e3, e4, e7 = (c[lo:fits] for c in cols)
    n2 = e2 + ns
    nf = e0 + add
    nt = np.where(e1 > tail, e1, tail)
    np_ = np.where(e3 > per, e3, per)
    a = add + e7
    a = np.where(a < mb, mb, a)
    if plain:
        a = behind_paths_s(a, m, run.options[oi][6], own_o, 2.0 * group.link + e0, np.where(e2 < n_cap, e2 + ns - 1, m))
    ok = n2 <= stage_cap
    if run.prune:
        ok &= ~_entry_floor_fails(run, group, offer, (e0, e1, e2, e3, e4), a)
    ok &= nf < _INF  # (the loop's running least fill starts at inf: it skips an infinite fill)
    pos = np.flatnonzero(ok)
    if not len(pos):
        return []
    n2 = np.where(n2 < n_cap, n2, n_cap)
    return list(zip(nf[pos].tolist(), nt[pos].tolist(), n2[pos].tolist(), np_[pos].tolist(), itertools.repeat(oi),
                    itertools.repeat(key), (pos + lo).tolist(), a[pos].tolist()))


def _entry_floor_fails(run: _Pass, group: _Group, offer: tuple, cols: tuple, a: np.ndarray) -> np.ndarray:
    """Per entry, whether _add_entries' prune drops the offer's entry in front of it (the closed form cannot beat
    ``beat`` and the score floor cannot beat ``score_beat``), elementwise in its order of operations."""
    (m1, beat, score_beat, score_only, shrink, plain, _, _, _, _, t_last, edged, _, n_cap, _, _) = run.entry_terms
    oi, _, _, start, ns, _, _, _, _, per_lb, base, in_front, tail_lb, ps, trips_on, stage_s, plain_only = offer
    e0, e1, e2, e3, e4 = cols
    p = e3 * shrink
    p = np.where(p < per_lb, per_lb, p)
    t = np.where(e1 > tail_lb, e1, tail_lb)
    sf = base + e0
    sf = np.where(stage_s > sf, stage_s, sf) + t
    if plain:
        pf = a + in_front
        pf = np.where(ps > pf, ps, pf)
        if trips_on:
            trips, c1, c0, t_first = _pass_arrays(run)
            r = trips[e2] * group.link
            if edged and group.front_island >= 0:
                r = r + (c1[e2] * t_first[e4] + c0[e2] * t_last[oi])
            r = r + in_front
            if start:
                r2 = trips[e2 + ns] * group.lk
                if edged:
                    r2 = r2 + c1[e2 + ns] * t_first[oi]
                r = np.where(r2 > r, r2, r)
            pf = np.where((e2 < n_cap) & (r > pf), r, pf)
        pf = pf + t
        sf = pf if plain_only else np.where(pf < sf, pf, sf)
    fails = sf >= score_beat
    if not score_only:
        fails &= m1 * p + base + e0 + t >= beat
    return fails


def _candidates(run: _Pass) -> list[Candidate]:
    """The complete sequences in tables[0] that use every required island, each read back through its parents. In a
    complete pass whose score cannot be plain (run.chunked), not those whose stage count (an entry's ``after`` below
    the cap) does not divide m: they cannot interleave, and complete_pass keeps none that cannot. In one whose score
    can be either, not those that cannot interleave so and whose plain floor (plain_s + tail: bounds.plain_1f1b_floor_s
    of the sequence) cannot beat the best score: their score is the plain simulation, and the DP judged them by the
    lesser of that floor and the interleaved one."""
    options, required, tables = run.options, run.required, run.tables
    m = run.m if run.complete and run.chunked is not None else 0
    # (plain_only: the DP's floors were the plain one already)
    either = run.m if run.complete and run.plain and not run.only_plain and run.score_beat < _INF else 0
    n_cap = run.prep.n_cap
    out = []
    for key, entries in tables[0].items():
        if key[0] & required != required:
            continue
        for e in _front_of(entries, run):
            if m and e[2] < n_cap and m % e[2]:
                continue
            if either and e[2] < n_cap and (e[2] < 2 or either % e[2]) and e[7] + e[1] >= run.score_beat:
                continue
            seq = []
            fill, tail, period = e[0], e[1], e[3]
            while e[4] >= 0:
                seq.append(e[4])
                e = tables[options[e[4]].stop][e[5]][e[6]]
            out.append(Candidate(fill, tail, period, tuple(seq)))
    return out


def pick(items: Sequence, idx: Sequence[int]) -> tuple:
    """items[i] for i in idx, as a tuple: operator.itemgetter, one C call instead of a comprehension (a driver takes
    a class's thousands of options, edges or memo entries this way, per class and round)."""
    return operator.itemgetter(*idx)(items) if len(idx) > 1 else tuple(items[i] for i in idx)


def _prepare(options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int, saturated: int,
             allowed_mask: int, max_stages: int | None, rows: np.ndarray | None = None) -> Prepared | None:
    """What compose needs of an option set before any DP run, whatever the island order: the usable options
    (none stands for another: what the kernel sees of an option does not order the plain 1F1B simulation, and the
    parallelizer's answer is megatron.exact_front already), grouped by stop and island; the cap on stages after;
    the lower bounds (least fill and least period of any cover, and per prefix and set of islands); and a cache
    for the groups' orders by floor. None: no option is usable. ``rows``: the options as Candidates.option_rows,
    where the caller has them."""
    if rows is not None:  # the same test over the columns
        island = rows[:, 2].astype(np.int64)
        ok = (((allowed_mask >> island) & 1) == 1) & (rows[:, 4] >= 0) & (rows[:, 0] >= 0) & (
            rows[:, 0] < rows[:, 1]) & (rows[:, 1] <= num_layers)
        idx = np.flatnonzero(ok).tolist()
    else:
        idx = [i for i, o in enumerate(options)
               if allowed_mask >> o.island & 1 and o.max_after >= 0 and 0 <= o.start < o.stop <= num_layers]
    if not idx:
        return None
    if rows is not None:
        by_stop, most_after, single = _groups_of_rows(rows, idx, num_layers, saturated)
    else:
        by_stop, most_after, single = _groups(options, idx, num_layers, saturated)
    if max_stages is None:
        # "after" matters only through the memory checks: beyond the largest finite threshold nothing changes
        n_cap = min(saturated, 1 + most_after)
    else:
        n_cap = max(saturated, max_stages)
    prefix = PrefixBounds(options, idx, num_layers, link_s, rows)
    whole = prefix(prefix.islands)  # covers of [0, L) by every island: the DP's first prefix bound, computed once
    fill_lb, period_lb = whole.fill_s[num_layers], whole.period_s[num_layers]
    return Prepared(idx, by_stop, n_cap, fill_lb, period_lb, prefix, {}, front_classes(link_s, prefix.islands),
                    whole.stage_period_s[num_layers], single, rows)


def _groups(options: Sequence[Option], idx: list[int], num_layers: int,
            saturated: int) -> tuple[list[list[tuple]], int, list[int]]:
    """Prepared.by_stop of the options ``idx``; the largest max_after below ``saturated`` (-1: none); the options
    covering the whole model, in idx's order."""
    grouped: dict[tuple[int, int], list[int]] = {}
    for oi in idx:
        grouped.setdefault((options[oi].stop, options[oi].island), []).append(oi)
    by_stop: list[list[tuple]] = [[] for _ in range(num_layers + 1)]
    for (stop, island), lst in sorted(grouped.items()):
        by_stop[stop].append((island, 1 << island, lst))
    most_after = max((options[oi].max_after for oi in idx if options[oi].max_after < saturated), default=-1)
    return by_stop, most_after, [oi for oi in idx if options[oi].start == 0 and options[oi].stop == num_layers]


def _groups_of_rows(rows: np.ndarray, idx: list[int], num_layers: int,
                    saturated: int) -> tuple[list[list[tuple]], int, list[int]]:
    """_groups over the options' rows (``idx`` ascending, as _prepare's column test leaves it): a stable sort by
    (stop, island) keeps each group in idx's order, and the fields are small integers, exact as floats."""
    at = np.asarray(idx, dtype=np.intp)
    sub = rows[at]
    stop, island = sub[:, 1].astype(np.intp), sub[:, 2].astype(np.intp)
    key = stop * (int(island.max()) + 1) + island
    order = np.argsort(key, kind="stable")
    k = key[order]
    first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    ordered, ends = at[order].tolist(), first.tolist()[1:] + [len(k)]
    by_stop: list[list[tuple]] = [[] for _ in range(num_layers + 1)]
    for s, i, a, e in zip(stop[order][first].tolist(), island[order][first].tolist(), first.tolist(), ends):
        by_stop[s].append((i, 1 << i, ordered[a:e]))
    after = sub[:, 4]
    finite = after[after < saturated]
    most_after = int(finite.max()) if len(finite) else -1
    return by_stop, most_after, at[(sub[:, 0] == 0) & (stop == num_layers)].tolist()


class Scoring(NamedTuple):
    """How compose ranks candidates where the driver gives a score (see compose's keywords of the same names)."""

    score: Callable[[tuple[int, ...], Metrics], float] | None = None
    band: bool = False
    floor: Callable[[tuple[int, ...], Metrics], float] | None = None
    floor_fine: Callable[[tuple[int, ...], Metrics], float] | None = None
    incumbent_s: float = float("inf")
    fill_weight: float = 0.0
    schedules: tuple[str, ...] = SCORE_ANY
    floor_cut: Callable[[tuple[int, ...], Metrics, float], float] | None = None

    @property
    def complete(self) -> bool:
        """Whether the score can be an interleaved or a plain simulation, which no dominance of the DP orders: the
        search then ends with a complete pass (_Search.complete_pass; plain_complete.py)."""
        return self.score is not None and ("interleaved" in self.schedules or plain_counts(self.schedules))


class _Best(NamedTuple):
    """The best plan so far and the order of its offer (among equal objectives the first offered wins)."""

    comp: Composition
    k: int


class _Search:
    """One compose call's search: its inputs, the best plan so far, and the steps that offer plans to it (single-island
    plans, the quick plan, the exact pass's candidates)."""

    def __init__(self, options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int, m: int,
                 prep: Prepared, *, required_mask: int, max_stages: int | None, incumbent_s: float,
                 rank: list[int] | None, stats: ComposeStats, scoring: Scoring, merge_fronts: bool,
                 edge_s: Sequence[tuple[float, float]] | None) -> None:
        self.options, self.link_s, self.num_layers, self.m, self.prep = options, link_s, num_layers, m, prep
        self.required_mask, self.max_stages, self.incumbent_s, self.rank = required_mask, max_stages, incumbent_s, rank
        self.stats, self.scoring, self.merge_fronts = stats, scoring, merge_fronts
        self.edge_s = edge_s
        self.edges: EdgeTimes | None = None  # edge_s as the passes read it, made by the first that does
        self.best: _Best | None = None
        self.closed_s = float("inf")  # the least closed form found here (with a score, best need not have it)
        self.band = scoring.score is not None and scoring.band
        # what a returned plan must beat
        self.gate_s = incumbent_s if scoring.score is None or self.band else float("inf")
        self.offered: set = set()
        self.order = itertools.count()  # offers in order: among equal objectives the first offered wins

    # ------------------------------------------------------------------------------------------ what to beat
    def beat_s(self) -> float:
        """Prune what cannot beat this (closed-form units): the incumbent, or the least closed form found (the
        best plan's, without a score); with ``score_band`` the larger of that and the best score."""
        if self.band:
            best = self.best
            return min(self.incumbent_s, max(best.comp.objective_s, self.closed_s) if best else float("inf"))
        return min(self.incumbent_s, self.closed_s)

    def score_beat_s(self) -> float:
        """The score a candidate must beat (inf without a score): the best here or elsewhere."""
        if self.scoring.score is None:
            return float("inf")
        best = self.best
        return min(self.scoring.incumbent_s, best.comp.objective_s if best is not None else float("inf"))

    def may_win(self, floor: float, k: int) -> bool:
        """Whether the k-th offer, whose score floor is ``floor``, can still beat the best score (ties: by order)."""
        if floor >= self.scoring.incumbent_s:
            return False
        best = self.best
        return best is None or floor < best.comp.objective_s or (floor == best.comp.objective_s and k < best.k)

    # ------------------------------------------------------------------------------------------ offers
    def measured(self, seq: tuple[int, ...]) -> Metrics | None:
        """``seq``'s closed form, recorded (trace, least closed form); None if offered before or unfit."""
        if seq in self.offered:
            return None
        self.offered.add(seq)
        metrics = evaluate(seq, self.options, self.link_s, self.m)
        if metrics is None:
            return None
        self.stats.trace.append((metrics.period_s, metrics.latency_s))
        self.closed_s = min(self.closed_s, metrics.latency_s)
        self.stats.best_closed_s = min(self.stats.best_closed_s, metrics.latency_s)
        return metrics

    def consider(self, seq: tuple[int, ...], metrics: Metrics, k: int) -> None:
        """Keep the k-th offer if it beats the best plan so far (by score where there is one; scored once)."""
        score = self.scoring.score
        comp = Composition(seq, metrics, metrics.period_s)
        if score is not None:
            comp = Composition(seq, metrics, metrics.period_s, score(seq, metrics))
            self.stats.scored.append(comp)
        o, best = comp.objective_s, self.best
        if o < self.gate_s and (best is None or o < best.comp.objective_s
                                or (o == best.comp.objective_s and k < best.k)):
            self.best = _Best(comp, k)

    def scored_if_hopeful(self, seq: tuple[int, ...], metrics: Metrics, k: int) -> None:
        """consider the k-th offer unless the fine floor says it cannot beat the best score."""
        sc = self.scoring
        if sc.score is None or sc.floor_fine is None or self.may_win(sc.floor_fine(seq, metrics), k):
            self.consider(seq, metrics, k)

    def offer(self, seq: tuple[int, ...]) -> None:
        metrics = self.measured(seq)
        if metrics is None:
            return
        k = next(self.order)
        sc = self.scoring
        if sc.score is None or sc.floor is None or self.may_win(sc.floor(seq, metrics), k):
            self.scored_if_hopeful(seq, metrics, k)  # else it cannot beat the best score: not simulated

    def offer_all(self, seqs: Sequence[tuple[int, ...]]) -> None:
        """offer each of ``seqs``, in that order as to ties, but scored by increasing score floor: the likely
        winners first, so that once a floor cannot beat the best score no later one can (a simulation is dear,
        and an exact pass on a large cluster offers thousands of plans)."""
        sc = self.scoring
        if sc.score is None or sc.floor is None:
            for seq in seqs:
                self.offer(seq)
            return
        cut = None
        if sc.floor_cut is not None:
            # a floor above the least of the best score and the incumbent loses at every step of the loop below (the
            # best score only falls), as does any value above it: an offer whose cheaper floor is above that needs no
            # finer one, and the offers scored (those of lower floors, in their order) are the same
            best = self.best
            cut = min(sc.incumbent_s, best.comp.objective_s if best is not None else float("inf"))
        pending = []
        for seq in seqs:
            metrics = self.measured(seq)
            if metrics is not None:
                floor = sc.floor(seq, metrics) if cut is None else sc.floor_cut(seq, metrics, cut)
                pending.append((floor, next(self.order), seq, metrics))
        pending.sort(key=lambda p: (p[0], p[1]))
        for floor, k, seq, metrics in pending:
            if not self.may_win(floor, k):
                break  # nor can any later one: no lower floor, and at an equal floor a later offer
            self.scored_if_hopeful(seq, metrics, k)

    # ------------------------------------------------------------------------------------------ the steps
    def run(self, beat: float, **kw) -> list[Candidate]:
        """The DP's plans that can beat ``beat``, by increasing closed form."""
        m = self.m
        if self.edge_s is not None and self.edges is None and score_floor_terms(
                kw.get("schedules", SCORE_ANY), kw.get("fill_weight", 0.0))[0]:
            self.edges = _edge_times(self.prep, self.edge_s)
        found = _dp(self.options, self.prep, self.link_s, self.num_layers, m, self.required_mask, self.max_stages,
                    beat, self.stats, self.rank, merge_fronts=self.merge_fronts, edge_s=self.edges, **kw)
        return sorted(found, key=lambda f: (pipeline_latency_s(m, f[2], f[0], f[1]), f[3]))

    def single_island_plans(self) -> None:
        """Offer the plans of one option (a whole-model slice plan on one island): they need no DP; with a score
        each is always a candidate (its closed form can rank it out while its simulation, with no p2p on the
        cycle, ranks it first)."""
        options, score = self.options, self.scoring.score
        for oi in self.prep.single:
            o = options[oi]
            if self.required_mask & ~(1 << o.island) == 0 \
                    and (self.max_stages is None or o.num_stages <= self.max_stages):
                metrics = evaluate((oi,), options, self.link_s, self.m)
                if metrics is not None and (score is not None or metrics.latency_s < self.incumbent_s):
                    self.offer((oi,))

    def quick_plan(self) -> None:
        """Offer the best plan of the DP keeping a few entries per state: its closed form then prunes the exact DP
        (not where only interleaved scores count and a best score elsewhere already bounds them: the closed form
        prunes nothing)."""
        sc = self.scoring
        if sc.schedules == ("interleaved",) and sc.fill_weight > 0.0 and sc.incumbent_s < float("inf"):
            return
        quick = self.run(self.beat_s(), beam=_BEAM)
        if quick:
            self.offer(quick[0][3])

    def exact_pass(self, bound_step: float) -> None:
        """Offer every plan that can beat the best so far (its closed form, or with a score its score floor),
        non-dominated within its state: a superset of what a DP under each bound on the slowest stage (the paper's
        relaxation) finds, the closed form's optimum among them; the score decides (interleaving and the p2p on the
        1F1B cycle rank plans the closed form does not see)."""
        sc = self.scoring
        candidates = self.run(self.beat_s(), quantum=bound_step, score_beat=self.score_beat_s(),
                              fill_weight=sc.fill_weight, schedules=sc.schedules)
        self.stats.candidates += len(candidates)
        self.offer_all([f[3] for f in candidates])

    def complete_pass(self) -> None:
        """Where the score interleaves (Scoring.complete), offer every plan that can interleave (2 layers a stage
        at least, stages dividing m) and whose score floor can beat the best score so far, dominated or not: the
        exact pass's best bounds it, so this pass builds only what the floors cannot rule out. The interleaved
        simulation reads each stage's time, the stage count and the layers per stage, none of which the exact
        pass's dominance respects. (Plans that cannot interleave score their plain simulation: the exact pass
        offered those as a plain-only search does.)"""
        sc, options, m = self.scoring, self.options, self.m
        candidates = self.run(_INF, score_beat=self.score_beat_s(), fill_weight=sc.fill_weight,
                              schedules=sc.schedules, complete=True)
        if not plain_counts(sc.schedules):  # only those that can interleave: the stages divide the micro-batches
            candidates = [f for f in candidates if m % sum(options[oi].num_stages for oi in f[3]) == 0]
        self.stats.candidates += len(candidates)
        self.offer_all([f[3] for f in candidates])

    def complete_later(self, score_beat_s: float) -> Composition | None:
        """The complete pass, left by compose for a driver that now holds a plan scored ``score_beat_s`` (a real
        plan: what cannot beat it loses nothing); the plan it finds, None if it finds none better."""
        self.scoring = self.scoring._replace(incumbent_s=min(self.scoring.incumbent_s, score_beat_s))
        before = self.best
        self.complete_pass()
        return self.result() if self.best is not before else None

    def result(self) -> Composition | None:
        """The best plan, if it beats what a returned plan must beat."""
        if self.best is None or self.best.comp.objective_s >= self.gate_s:
            return None
        return self.best.comp


def _edge_times(prep: Prepared, edge_s: Sequence[tuple[float, float]]) -> EdgeTimes:
    """EdgeTimes.of(edge_s), once per prepared set and edge list: a driver composes one set in a seed order and
    then over every island set with the same edges."""
    hit = prep.cache.get("edges")
    if hit is None or hit[0] is not edge_s:
        hit = prep.cache["edges"] = (edge_s, EdgeTimes.of(edge_s))
    return hit[1]


def _prepared(options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int, saturated: int,
              allowed_mask: int, max_stages: int | None, stats: ComposeStats,
              rows: np.ndarray | None) -> Prepared | None:
    """_prepare's answer for this option set, from ``stats.prepared`` where the last call prepared the same set."""
    key = (id(options), len(options), id(link_s), allowed_mask, num_layers, saturated, max_stages)
    prep = stats.prepared
    if prep is None or prep.key != key or prep.options is not options or prep.link_s is not link_s:
        prep = stats.prepared = PreparedSet(key, options, link_s, _prepare(options, link_s, num_layers, saturated,
                                                                           allowed_mask, max_stages, rows))
    return prep.prepared


def _island_rank(island_order: Sequence[int] | None, options: Sequence[Option], idx: list[int]) -> list[int] | None:
    """rank[k]: island k's place in ``island_order`` (islands not in it: after all); None without an order."""
    if island_order is None:
        return None
    rank = [len(island_order)] * (1 + max(max(island_order), max(options[oi].island for oi in idx)))
    for r, k in enumerate(island_order):
        rank[k] = r
    return rank


def compose(options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int, num_microbatches: int,
            *, allowed_mask: int | None = None, required_mask: int = 0, max_stages: int | None = None,
            bound_step: float = 0.0, incumbent_s: float = float("inf"), island_order: Sequence[int] | None = None,
            stats: ComposeStats | None = None, deferred: list | None = None,
            score: Callable[[tuple[int, ...], Metrics], float] | None = None, score_band: bool = False,
            score_floor: Callable[[tuple[int, ...], Metrics], float] | None = None,
            score_floor_fine: Callable[[tuple[int, ...], Metrics], float] | None = None,
            score_floor_cut: Callable[[tuple[int, ...], Metrics, float], float] | None = None,
            score_incumbent_s: float = float("inf"), score_fill_weight: float = 0.0,
            score_schedules: tuple[str, ...] = SCORE_ANY, merge_fronts: bool = False,
            edge_s: Sequence[tuple[float, float]] | None = None,
            quick_plan: bool = True, rows: np.ndarray | None = None) -> Composition | None:
    """The lowest-latency sequence of options (see the module docstring), or None when none is feasible.

    ``allowed_mask``: islands that may be used (default all); ``required_mask``: islands every sequence must use
    (to price an island the best plan leaves out); ``max_stages``: the runtime's cap on pipeline stages;
    ``bound_step`` > 0: periods within that relative step compare as equal (faster; the plan is at most
    (m - 1) x bound_step x its period slower than the optimum); ``incumbent_s``: a latency already achieved
    elsewhere (another micro-batch size): only plans that beat it are searched, and None is returned if none
    does; ``island_order``: only pipelines whose islands appear in this order (front to back, islands may be
    skipped) -- the state then drops the set of used islands, so the cost grows polynomially with the number of
    islands (exact among such pipelines); ``score``: the latency to choose by (what the Plan reports; see the
    module docstring), computed once per candidate; ``incumbent_s`` then prunes closed forms only (the least
    score among the candidates is returned, whatever it is); ``score_band``: prune against the larger of the best
    score and the least closed form instead (every plan whose closed form beats the best score is a candidate),
    and ``incumbent_s`` is a score; ``score_floor``: a cheap floor under ``score`` (a candidate whose floor cannot
    beat the best score here or ``score_incumbent_s``, the best found elsewhere, is not scored: a simulation costs
    milliseconds and an island-order search meets tens of thousands of candidates); ``score_floor_fine``: a
    tighter, dearer floor under ``score``, asked only of a candidate ``score_floor`` lets through (the score is
    computed only if this one can beat the best score too); ``score_floor_cut``: ``score_floor`` with a third
    argument c, which may answer any value above c that lies under the floor instead of it (a cheaper floor, once it
    is above c: offer_all then asks for no finer one); ``score_fill_weight`` w:
    the DP's floor under the score is the largest of m x the slowest stage, the fill and m x a stage + w x the
    fill in front of it, + tail (default w = 0; 1/V where only interleaved schedules of at most V chunks per stage
    are scored: interleaved_schedule.interleaved_floor_s), and a score's interleaved schedules must hold a layer
    per chunk at least (interleave.most_virtual_stages): an option of n layers in s stages raises w to 1 / (n // s);
    ``score_schedules``: what the score can be, ("any",) (default) or some of "plain" (the plain 1F1B simulation:
    the DP also prunes by plain_1f1b_floor_s) and "interleaved" (with ``score_fill_weight``; with ``bound_step`` 0
    and without ``merge_fronts`` no option is dropped as dominated and a complete pass over the sequences that can
    interleave ends the search: the plan scores no more than any composition's interleaved schedules, provided the
    score floors lie under the score); ``merge_fronts``: the sequences of one island set whose front islands have the
    same links from every other island (front_classes) share a DP state. The closed form's optimum is the same; the
    candidates offered to the score are fewer (one per class and state, not one per front island), and the exact search
    costs about 2^K states per layer instead of K x 2^(K-1) on K islands that talk over one spine; ``edge_s``: per
    option, its first and its last stage's forward + backward seconds, which tighten the DP's plain 1F1B floor
    (cycles_s); ``quick_plan`` False: no quick plan before the exact pass (a driver whose incumbents already hold a plan
    of these options, composed in one island order just before, has the bound it would give); ``rows``: the options as
    Candidates.option_rows (rows[i] is options[i]), where the caller has them: the preparation reads columns;
    ``deferred``: a list where the complete pass is left to the caller (appended: _Search.complete_later)."""
    stats = stats if stats is not None else ComposeStats()
    m = num_microbatches
    if allowed_mask is None:
        allowed_mask = (1 << (1 + max((o.island for o in options), default=0))) - 1
    scoring = Scoring(score, score_band, score_floor, score_floor_fine, score_incumbent_s, score_fill_weight,
                      score_schedules, score_floor_cut)
    # a complete pass (exact against an interleaved score) ends the search unless periods are bucketed or fronts
    # merged: without dominance a merged search enumerates every island set's sequences, which on the driver's
    # many-island clusters (where it merges) is tens of millions of entries
    complete = scoring.complete and bound_step == 0.0 and not merge_fronts
    prep = _prepared(options, link_s, num_layers, m - 1, allowed_mask, max_stages, stats, rows)
    if prep is None:
        return None
    if prep.period_lb == float("inf"):
        return None  # no cover of [0, L) at all
    if (m - 1) * prep.period_lb + max(prep.period_lb, prep.fill_lb) >= incumbent_s and (
            score is None or m * prep.stage_lb >= score_incumbent_s):
        return None  # cannot beat the incumbent (nor, with a score, the best score): not even one DP run
    search = _Search(options, link_s, num_layers, m, prep, required_mask=required_mask, max_stages=max_stages,
                     incumbent_s=incumbent_s, rank=_island_rank(island_order, options, prep.idx), stats=stats,
                     scoring=scoring, merge_fronts=merge_fronts, edge_s=edge_s)
    search.single_island_plans()
    if quick_plan:
        search.quick_plan()
    search.exact_pass(bound_step)
    if complete and deferred is not None:
        deferred.append(search.complete_later)  # the driver runs it later, bounded by its best plan of all
    elif complete:
        search.complete_pass()
    return search.result()
