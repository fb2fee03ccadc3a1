"""One micro-batch size's answers so far, composed (compose_size): its options (build.make_candidates), its
compatibility classes ranked by their floors (classes.class_floors_s) and composed most promising first
(class_composition.compose_group), those that cannot beat the best plan so far (Incumbent) skipped, and what an
earlier round at the size already composed not composed again (SizeMemo)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, NamedTuple, Sequence

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.planner.allocation import LinkModel, activation_bytes
from tangram_launch.planner.build import Candidates, make_candidates
from tangram_launch.planner.class_composition import compose_group
from tangram_launch.planner.classes import class_floors_s, group_minima, stage_totals
from tangram_launch.planner.compose import Composition, ComposeStats, pick
from tangram_launch.planner.grid_classes import GridClass
from tangram_launch.planner.interleave import MAX_VIRTUAL_STAGES
from tangram_launch.planner.options import PlannerOptions
from tangram_launch.planner.slices import PairSet
from tangram_launch.planner.twin_classes import TwinClasses

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import Island
    from tangram_launch.planner.query_pool import QueryPool
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec


class Incumbent(NamedTuple):
    """The best plan found so far: its predicted iteration (what the Plan reports), its micro-batch size, its
    compatibility class, its composition and the Candidates its option indices point into."""

    latency_s: float
    b: int
    group: Hashable
    composition: Composition
    candidates: Candidates


@dataclass
class SizeMemo:
    """What one search's rounds at a micro-batch size leave for its next round (compose_size)."""

    judged: dict = field(default_factory=dict)  # b -> make_candidates' memo: answers judged, pairs' options
    composed: dict = field(default_factory=dict)  # (b, class) -> (options, closed form, score bounds)
    # b -> (options, closed form and score bounds, classes) when a round at b ended: a round with the same options
    # under bounds no looser has nothing to find (every class was composed, or skipped, under bounds at least those)
    rounds: dict = field(default_factory=dict)
    minima: dict = field(default_factory=dict)  # b -> an answer's key -> (its templates, classes.group_minima)
    fields: dict = field(default_factory=dict)  # b -> an answer's key -> (its templates, their fields as an array)
    # b -> its LinkModel: the size's floor and every round read its island matrix and price boundaries alike
    links: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SearchContext:
    """What a search holds fixed across its micro-batch sizes and rounds: its inputs, the slice/island pairs, the
    islands, the runtime's capabilities, the options and the pool that answers slice queries."""

    cluster: "ClusterSpec"
    model: "ModelSpec"
    training: "TrainingSpec"
    pairset: PairSet
    islands: Sequence["Island"]
    caps: RuntimeCapabilities
    opts: PlannerOptions
    pool: "QueryPool"


def _counters() -> dict:
    return {"queries": 0, "configs": 0, "bounded": 0, "sizes_skipped": 0, "pairs_skipped": 0, "query_s": 0.0,
            "compose_s": 0.0}


@dataclass
class SearchState:
    """What a search accumulates round by round: the answers per size (b -> pair key -> SliceResult), the options
    per size (Candidates), the counters the plan reports, the composer's statistics, what earlier rounds left
    (SizeMemo), and the best plan so far."""

    results: dict = field(default_factory=dict)
    all_cands: dict = field(default_factory=dict)
    counters: dict = field(default_factory=_counters)
    cstats: ComposeStats = field(default_factory=ComposeStats)
    memo: SizeMemo | None = field(default_factory=SizeMemo)  # None: every round composes anew
    reach: dict = field(default_factory=dict)  # b -> its PipelineReach (pair_floors.py): pairs a pipeline could hold
    best: Incumbent | None = None
    # (b, class, its Candidates, compose_group's deferred): complete passes left for complete_deferred (None: none is)
    deferred: list | None = None
    size_best_s: dict = field(default_factory=dict)  # b -> the best predicted iteration composed at b


def size_links(b: int, cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec",
               islands: Sequence["Island"], memo: "SizeMemo | None") -> LinkModel:
    """The p2p model of micro-batch size b's activations (one per size and search where ``memo`` keeps it: its
    caches then serve every round at b)."""
    hit = memo.links.get(b) if memo is not None else None
    if hit is None:
        like = next(iter(memo.links.values()), None) if memo is not None else None  # another size's network
        hit = LinkModel(cluster, islands, activation_bytes(b, training.seq_len, model.hidden_size,
                                                           training.param_bytes), like=like)
        if memo is not None:
            memo.links[b] = hit
    return hit


def compose_size(b: int, ctx: SearchContext, state: SearchState, *, use_incumbent: bool = True) -> float:
    """Options of size b from its answers so far, composed per compatibility class (the most promising class
    first, hopeless ones skipped); the best plan so far (Incumbent) goes to ``state.best``; returns the best latency
    composed at b itself (inf if none).

    ``state.memo`` (SizeMemo) carries what earlier rounds at b did: answers judged once, and per class the options and
    bounds it was last composed with. Under bounds no looser, a class is composed again only if one of its options
    that could be in a plan beating them is new (compose_group's ``searched``): that earlier composition's plan
    already counts in the best plan. A round that left b's options as they were, under bounds no looser than at the
    end of its last round, ranks no class at all (SizeMemo.rounds)."""
    t_c = time.perf_counter()
    model, training, islands, caps, opts = ctx.model, ctx.training, ctx.islands, ctx.caps, ctx.opts
    best, all_cands, counters, cstats, memo = state.best, state.all_cands, state.counters, state.cstats, state.memo
    L = model.num_layers
    m = training.global_batch // b
    links = size_links(b, ctx.cluster, model, training, islands, memo)
    cand = make_candidates(b, L, ctx.pairset.pairs, state.results[b], islands, caps, links, m, dtype=training.dtype,
                           training=training, judged=memo.judged.setdefault(b, {}) if memo is not None else None)
    all_cands[b] = cand
    if best is not None and best.b == b and best.candidates is not cand:
        best = _moved(best, cand)  # the incumbent of b's first options, in terms of its fuller option list
    own_s = math.inf
    last = memo.rounds.get(b) if memo is not None and use_incumbent else None
    if best is not None and last is not None and last[0] == cand.options and last[3] == cand.groups:
        threshold = cstats.threshold_s(best.latency_s, opts.score_band)
        if threshold <= last[1] and best.latency_s <= last[2]:
            counters["compose_s"] += time.perf_counter() - t_c
            state.best = best
            return own_s
    classes = cand.class_members()
    floors, score_floors, interleave_only = _class_floors(
        cand, classes, _answer_minima(cand, memo.minima.setdefault(b, {}) if memo is not None else {}), L, m, caps,
        opts)
    work = sorted(((floors.get(group, math.inf), group, idx) for group, idx in classes.items()), key=lambda w: w[0])
    twins = TwinClasses(cand)  # classes with another grid's very options (Megatron's dp x cp splits): once each
    rows: list = []  # every option's fields as an array (Candidates.option_rows), made when a class is composed
    for lb, group, idx in work:
        # the closed form to beat (compose.ComposeStats.threshold_s); none for a size's own first ranking, which
        # needs the size's own best exactly: there the best score among its classes so far bounds the rest (what
        # cannot beat it is not simulated)
        threshold = cstats.threshold_s(best.latency_s if best is not None and use_incumbent else None,
                                       opts.score_band)
        score_to_beat = best.latency_s if best is not None and use_incumbent else own_s
        if (lb >= threshold or group in interleave_only) and score_floors.get(group, math.inf) >= score_to_beat:
            continue  # neither its closed form nor its predicted iteration can beat the best plan
        if group in interleave_only and not any(
                S > 1 and m % S == 0 for S in stage_totals(cand.options, idx, L, m)):
            continue  # no pipeline of it can interleave (its stages would not divide the micro-batches)
        schedules = _score_schedules(group, caps, opts)
        if twins.twin_of(idx, schedules) is not None:
            continue  # its twin, composed or passed over this round under bounds no tighter, found its plans
        searched = None
        if memo is not None:
            opts_of = pick(cand.options, idx)
            last = memo.composed.get((b, group))
            if last is not None and threshold <= last[1] and score_to_beat <= last[2]:
                if last[0] == opts_of:
                    continue  # the same options: nothing new to find
                searched = last[0]
            memo.composed[(b, group)] = (opts_of, threshold, score_to_beat)
        if not rows:
            rows.append(cand.option_rows(memo.fields.setdefault(b, {}) if memo is not None else None))
        note = [] if state.deferred is not None else None
        comp = compose_group(cand, idx, L, m, caps, opts, cstats, incumbent_s=threshold,
                             score_incumbent_s=score_to_beat, schedules=schedules, searched=searched,
                             rows=rows[0], deferred=note)
        if note:
            state.deferred.append((b, group, cand, note))
        if comp is not None:
            own_s = min(own_s, comp.objective_s)
            if best is None or comp.objective_s < best.latency_s:
                best = Incumbent(comp.objective_s, b, group, comp, cand)  # ranked by the iteration the Plan reports
    if memo is not None and use_incumbent and best is not None:
        memo.rounds[b] = (cand.options, cstats.threshold_s(best.latency_s, opts.score_band), best.latency_s,
                          cand.groups)
    counters["compose_s"] += time.perf_counter() - t_c
    state.best = best
    return own_s


def complete_deferred(state: SearchState, select: Callable[[tuple], bool] | None = None) -> None:
    """The complete passes compose_size left (SearchState.deferred), once every size was visited, each bounded by
    the best plan over all sizes (a real plan, so what cannot beat it loses nothing), the sizes with the best plans
    of their own first. The costliest complete passes then prune by the optimum, not by the best plan found when
    their size was visited. ``select``: only the passes it picks, now; the others stay deferred."""
    pending = state.deferred or []
    if select is None:
        deferred, state.deferred = pending, None
    else:
        deferred = [d for d in pending if select(d)]
        state.deferred = [d for d in pending if not select(d)]
    t_c = time.perf_counter()
    for b, group, cand, later in sorted(deferred, key=lambda d: (state.size_best_s.get(d[0], math.inf), d[0])):
        for finish, idx in later:
            best_s = state.best.latency_s if state.best is not None else math.inf
            comp = finish(best_s)
            if comp is not None and comp.objective_s < best_s:
                comp = Composition(tuple(idx[i] for i in comp.options), comp.metrics, comp.bound_s, comp.score_s)
                best = Incumbent(comp.objective_s, b, group, comp, cand)
                # (in terms of the size's last option list, as compose_size keeps it)
                state.best = best if cand is state.all_cands[b] else _moved(best, state.all_cands[b])
    state.counters["compose_s"] += time.perf_counter() - t_c


def _answer_minima(cand: Candidates, kept: dict) -> list:
    """Per part of ``cand``, (classes.group_minima of its answer's templates, its island, its layers): once per
    answer (its pairs share its templates) and kept in ``kept`` across rounds at b while the answer is the same
    (make_candidates' memo), keyed by the answer (AnswerTemplates.key)."""
    minima = []
    for island, n, temps in cand.parts:
        hit = kept.get(temps.key)
        if hit is None or hit[0] is not temps:
            hit = kept[temps.key] = (temps, group_minima([t[0] for t in temps], [t[2] for t in temps]))
        minima.append((hit[1], island, n))
    return minima


def _class_floors(cand: Candidates, classes: dict, minima: list, L: int, m: int, caps: RuntimeCapabilities,
                  opts: PlannerOptions) -> tuple[dict, dict, set]:
    """Per compatibility class: the floor under its closed form, the floor under its predicted iteration, and
    whether only interleaved schedules can win it (classes.class_floors_s, from each answer's ``minima``)."""
    interleave_only: set = set()
    if not any(isinstance(g, GridClass) for g in classes):  # each option in one class: one pass over them all
        score_floors: dict = {}
        floors = class_floors_s(cand.options, cand.groups, L, m, score_floors=score_floors, minima=minima)
        return floors, score_floors, interleave_only
    # one-grid classes inside a free one (grid_classes.GridClass): an option counts in two, so two passes
    floors, score_floors = {}, {}
    distinct = dict.fromkeys(cand.groups)  # (in their first options' order)
    free = {g: GridClass(g.base, None) for g in distinct}
    one = {g: g if g.grid is not None else None for g in distinct}
    for to_class in (free, one):  # free, one-grid classes
        plain: dict = {}
        inter: dict = {}
        floors.update(class_floors_s(cand.options, list(dict.fromkeys(to_class[g] for g in distinct)), L, m,
                                     score_floors=plain, interleaved_floors=(inter, MAX_VIRTUAL_STAGES),
                                     minima=minima, class_of=to_class.__getitem__))
        for group in plain:
            # its score floor: interleaved only where only interleaved schedules can win it
            only = _score_schedules(group, caps, opts) == ("interleaved",)
            score_floors[group] = (inter if only else plain).get(group, math.inf)
            if only:
                interleave_only.add(group)
    floors.pop(None, None)
    score_floors.pop(None, None)
    return floors, score_floors, interleave_only


def _score_schedules(group, caps: RuntimeCapabilities, opts: PlannerOptions) -> tuple[str, ...]:
    """The schedules whose predictions can pick a plan of this class. Under "auto" with one-grid classes inside a
    free one (grid_classes.GridClass): a one-grid class adds only interleaved pipelines (its plain ones are the free
    class's, or beaten there option by option), and the free class only plain ones (its one-grid pipelines
    interleave in their own class). Where "interleaved-1F1B" is insisted on, no plain prediction picks a plan
    (Candidates.schedule_choice scores a pipeline that cannot interleave inf)."""
    interleaves = opts.schedule != "1F1B" and "interleaved-1F1B" in caps.schedules
    if interleaves and opts.schedule == "interleaved-1F1B":
        return ("interleaved",)
    if isinstance(group, GridClass) and opts.schedule == "auto":
        return ("interleaved",) if group.grid is not None else ("plain",)
    return ("plain", "interleaved") if interleaves else ("plain",)


def _moved(best: Incumbent, cand: Candidates) -> Incumbent:
    """An incumbent re-indexed into ``cand``, a later option list of the same size b (every old option is in it:
    the same answers, more of them), so that the plan, the dropped islands' reasons and the search result all read
    one option list."""
    comp, old = best.composition, best.candidates
    wanted = {old.options[i] for i in comp.options}
    index: dict = {}
    for i, o in enumerate(cand.options):
        if o in wanted:  # (hashing the few wanted options' tuples, not every option's with its class)
            index.setdefault((o, cand.groups[i]), i)
    moved = tuple(index[(old.options[i], old.groups[i])] for i in comp.options)
    return best._replace(composition=Composition(moved, comp.metrics, comp.bound_s, comp.score_s), candidates=cand)
