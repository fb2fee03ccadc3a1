"""The Tangram planner's entry point: cluster + model + training -> the frozen Plan.

    from tangram_launch.planner.api import make_plan
    plan = make_plan(cluster, model, training, runtime="megatron", parallelizer="megatron")

Steps (paper §5): islands (§4) -> slice/island pairs, pruned (slices.py) -> parallel parallelizer queries for each
candidate micro-batch size b (query_pool.py) -> options (build.py) -> composition per runtime compatibility class
(compose.py; above five islands over a bounded set of island orders, orders.py, unless few link classes keep the
exact search small, compose.front_classes; each ranked by the iteration the Plan reports: the simulated 1F1B, or
interleaved where faster) -> the best over b. The sizes b: every divisor of the global batch (or those asked for),
so the plan is the best over all of them. Branch and bound: the sizes are visited most promising first (a floor
under any plan's latency at each size, from the parallelizer's compute floors; the order changes only the time),
a size whose floor cannot beat the best plan so far is skipped, and
every query carries the best latency so far so the parallelizer costs only what could beat it. Under megatron a
pair whose floor (pair_floors.py: its layers on its island, the others on the other islands) cannot beat it is not
asked at all. A size's compatibility classes are composed in the order of their floors (classes.py: each island
holds one slice), and those that cannot beat it are skipped; inside a class, options no plan beating the bounds can
hold, and above five islands islands none can use, are dropped before composing (cover_floors.py). -> islands left
out (reasons from a floor, dropped.py), and GPUs left idle, with reasons -> Plan (build.py). Nothing fits:
InfeasibleError with the reasons (exit status 3 on the command line).
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, NamedTuple, Sequence

from tangram_launch.capabilities import DEFAULT_RUNTIME, RuntimeCapabilities, capabilities_for
from tangram_launch.costmodel.pipeline import cycle_floor_1f1b_s
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.islands import IslandSet, build_islands, compute_tflops
from tangram_launch.parallelizers.base import GIB, Parallelizer, SliceQuery, SliceResult
from tangram_launch.plan import Plan
from tangram_launch.planner.build import Candidates, build_plan, make_candidates
from tangram_launch.planner.classes import class_floors_s, group_minima, stage_totals
from tangram_launch.planner.gc_pause import no_collections
from tangram_launch.planner import bounds
from tangram_launch.planner.bounds import interleaved_1f1b_floor_s, least_links, plain_1f1b_floor_s
from tangram_launch.planner.compose import SCORE_ANY, Composition, ComposeStats, Option, compose, merged_states, pick
from tangram_launch.planner.cover_floors import island_floors_s, promising
from tangram_launch.planner.dropped import dropped_islands
from tangram_launch.planner.query_pool import QueryPool, default_workers
from tangram_launch.planner.allocation import LinkModel, activation_bytes
from tangram_launch.planner.orders import search_orders
from tangram_launch.planner.interleave import MAX_VIRTUAL_STAGES, most_virtual_stages
from tangram_launch.planner.pair_floors import PairFloors, capacity
from tangram_launch.planner.grid_classes import GridClass
from tangram_launch.planner.twin_classes import TwinClasses
from tangram_launch.text import plural
from tangram_launch.planner.slices import (
    ModelAtoms,
    Pair,
    PairSet,
    PruningPolicy,
    auto_atom_layers,
    build_pairs,
    dtype_problem,
)

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from tangram_launch.islands import Island
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec

logger = logging.getLogger(__name__)

# while only single-island plans bound the search, this share of a size's pairs (the lowest pair floors) is asked
# and composed first (megatron): its plan lets most of the others go unasked (figures: benchmarks/README.md)
FIRST_ROUND_SHARE = 0.25
# above exact_islands, the search is still exact where its DP keys per layer, with front islands merged by link
# class (compose.merged_states), are this few: up to 8 islands that talk over one spine
MERGED_EXACT_STATES = 256


@dataclass(frozen=True)
class PlannerOptions:
    pruning: PruningPolicy = field(default_factory=PruningPolicy)
    microbatch_sequences: tuple[int, ...] | None = None  # b values to try; default: every divisor of the batch
    max_workers: int | None = None  # process pool size; default min(2, cpu count)
    progress: bool | None = None  # None: progress on stderr only when it is a terminal
    bound_step: float = 0.0  # > 0: the composer compares periods within this relative step as equal (faster, not exact)
    atom_layers: int | None = None  # layers per model atom; None: slices.auto_atom_layers (1 up to 64 layers)
    exact_islands: int = 5  # up to this many islands the composer searches every island subset and order
    # branch and bound: queries carry the best latency found so far, and micro-batch sizes whose floor cannot beat
    # it are skipped (exact; off: every configuration is costed, as a check and for the ablation)
    branch_and_bound: bool = True
    # pipeline schedule: "1F1B", "interleaved-1F1B" (virtual stages required) or "auto" (interleave where the runtime
    # runs it and it is faster; planner/interleave.py)
    schedule: str = "auto"
    # compositions are ranked by the iteration the Plan reports (the simulated 1F1B); True also searches every plan
    # whose closed form is below the best simulated one (compose.py's score_band: slower, finds more where p2p lies on
    # the 1F1B cycle)
    score_band: bool = False

    def __post_init__(self) -> None:
        if self.microbatch_sequences is not None:
            for b in self.microbatch_sequences:
                if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                    raise SpecError("must be positive integers", field="microbatch_sequences", value=b)
        if self.atom_layers is not None and (isinstance(self.atom_layers, bool) or not isinstance(
                self.atom_layers, int) or self.atom_layers < 1):
            raise SpecError("must be a positive integer", field="atom_layers", value=self.atom_layers)
        if self.schedule not in ("auto", "1F1B", "interleaved-1F1B"):
            raise SpecError("unknown pipeline schedule", field="schedule", value=self.schedule,
                            valid="auto, 1F1B, interleaved-1F1B")
        if isinstance(self.exact_islands, bool) or not isinstance(self.exact_islands, int) or self.exact_islands < 1:
            raise SpecError("must be a positive integer", field="exact_islands", value=self.exact_islands)
        if self.bound_step < 0:
            raise SpecError("must be >= 0", field="bound_step", value=self.bound_step)


@dataclass
class SearchResult:
    """A planning run: the plan, and what produced it (reused by --compare and the benchmarks)."""

    plan: Plan
    composition: Composition
    candidates: Candidates  # of the chosen b
    all_candidates: dict[int, Candidates]
    results: dict[int, dict[tuple, SliceResult]]  # b -> redundancy key -> answer
    pairs: PairSet
    islands: IslandSet
    usable: tuple["Island", ...]
    capabilities: RuntimeCapabilities
    parallelizer: Parallelizer
    atoms: ModelAtoms
    stats: dict
    scored_s: tuple[float, ...] = ()  # predicted iteration of every composition the search scored


class Incumbent(NamedTuple):
    """The best plan found so far: its predicted iteration (what the Plan reports), its micro-batch size, its
    compatibility class, its composition and the Candidates its option indices point into."""

    latency_s: float
    b: int
    group: Hashable
    composition: Composition
    candidates: Candidates


def resolve_parallelizer(parallelizer: str | Parallelizer) -> Parallelizer:
    if isinstance(parallelizer, str):
        from tangram_launch.parallelizers.registry import get_parallelizer  # floor 3, loaded on demand

        return get_parallelizer(parallelizer)
    if not hasattr(parallelizer, "query"):
        raise SpecError("not a parallelizer (needs .name and .query(SliceQuery))", field="parallelizer",
                        value=type(parallelizer).__name__)
    return parallelizer


def resolve_capabilities(runtime: str | RuntimeCapabilities) -> RuntimeCapabilities:
    return runtime if isinstance(runtime, RuntimeCapabilities) else capabilities_for(runtime)


def divisors(global_batch: int) -> tuple[int, ...]:
    """Every divisor of the global batch, ascending: the micro-batch sizes the search considers by default."""
    small = [d for d in range(1, math.isqrt(global_batch) + 1) if global_batch % d == 0]
    return tuple(sorted({*small, *(global_batch // d for d in small)}))


def microbatch_choices(global_batch: int, limit: int) -> tuple[int, ...]:
    """Divisors of the global batch; when more than ``limit``, a spread from smallest to largest (log-spaced).
    Not the search's default (that is every divisor); kept for benchmarks and tests that compare against it."""
    divs = list(divisors(global_batch))
    if len(divs) <= limit:
        return tuple(divs)
    if limit == 1:
        return (divs[0],)
    picks = sorted({divs[round(i * (len(divs) - 1) / (limit - 1))] for i in range(limit)})
    return tuple(picks)


def candidate_sizes(global_batch: int, asked: Sequence[int] | None) -> tuple[int, ...]:
    """The micro-batch sizes a search considers: ``asked`` (each must divide the global batch), else every divisor.
    The search visits them most promising first and skips a size only where a floor under every plan at that size
    cannot beat the best plan found (SizeFloor.beyond), so its plan is the best over all of them."""
    if not asked:
        return divisors(global_batch)
    bad = [b for b in asked if global_batch % b]
    if bad:
        raise SpecError(f"must divide the global batch {global_batch}", field="microbatch_sequences",
                        value=bad[0], valid=", ".join(str(d) for d in divisors(global_batch)))
    return tuple(asked)


def _memory_reasons(atoms: ModelAtoms, usable: Sequence["Island"], caps: RuntimeCapabilities) -> list[str]:
    need = atoms.min_static_bytes(0, atoms.num_layers, offload=caps.offload)
    have = sum(i.gpu.memory_gib * GIB * i.num_gpus for i in usable)
    if need <= have:
        return []
    what = "parameters" if caps.offload else "parameters, gradients and optimizer state"
    return [f"the model needs {need / GIB:.0f} GiB of {what} ({atoms.model.total_params() / 1e9:.2f} B parameters); "
            f"the cluster's usable GPUs have {have / GIB:.0f} GiB"]


def search(cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", *,
           runtime: str | RuntimeCapabilities = DEFAULT_RUNTIME, parallelizer: str | Parallelizer = "megatron",
           islands: IslandSet | None = None, options: PlannerOptions | None = None) -> SearchResult:
    """Plan, and keep everything that went into the plan."""
    opts = options or PlannerOptions()
    # gc_pause.py: the search makes no reference cycles, and collections only rescanned its many long-lived
    # objects. One query pool for all the search's batches (query_pool.py): its workers keep their caches warm,
    # and stop when the search ends.
    with no_collections(), QueryPool(resolve_parallelizer(parallelizer), opts.max_workers,
                                      progress=opts.progress, label=f"planning {model.name}") as pool:
        return _search(cluster, model, training, runtime=runtime, pool=pool, islands=islands, options=opts)


def _search(cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", *,
            runtime: str | RuntimeCapabilities, pool: QueryPool,
            islands: IslandSet | None, options: PlannerOptions) -> SearchResult:
    t0 = time.perf_counter()
    opts = options
    caps = resolve_capabilities(runtime).for_model(model.num_experts)  # MoE: per-stage grids where the runtime has them
    if opts.schedule == "interleaved-1F1B":  # insisted on where the runtime has no such schedule: say so first
        problems = caps.schedule_problems("interleaved-1F1B")
        if problems:
            raise InfeasibleError(f"the {caps.name} runtime cannot run interleaved 1F1B", problems)
    par = pool.parallelizer
    iset = islands or build_islands(cluster, dtype=training.dtype)
    all_islands = tuple(iset.islands)
    atoms = ModelAtoms(model, training)
    L = model.num_layers
    G = training.global_batch

    usable, reasons = _usable_islands(all_islands, atoms, caps, training.dtype)
    atom_layers = opts.atom_layers or auto_atom_layers(L)
    pairset = build_pairs(atoms, all_islands, caps, opts.pruning, atom_layers=atom_layers)
    if not pairset.pairs:
        raise InfeasibleError("every slice/island pair was pruned", list(pairset.island_notes.values()) or reasons)

    bs = candidate_sizes(G, opts.microbatch_sequences)

    results: dict[int, dict[tuple, SliceResult]] = {}
    all_cands: dict[int, Candidates] = {}
    memo = SizeMemo()
    cstats = ComposeStats()
    best: Incumbent | None = None
    counters = {"queries": 0, "configs": 0, "bounded": 0, "sizes_skipped": 0, "pairs_skipped": 0, "query_s": 0.0,
                "compose_s": 0.0}
    tried = list(bs)
    best = _try_microbatches(bs, best, results, all_cands, counters, cstats, cluster=cluster, model=model,
                             training=training, pairset=pairset, islands=all_islands, caps=caps, pool=pool,
                             opts=opts, memo=memo)
    t_c = time.perf_counter()
    if best is None:
        raise InfeasibleError("no feasible plan", _infeasible_reasons(all_cands, pairset, reasons, caps))
    b_best, group_best, comp_best, cand = best.b, best.group, best.composition, best.candidates
    group_idx = cand.class_members()[group_best]
    dropped = dropped_islands(
        cand, group_idx, comp_best, all_islands, pairset, L, caps, opts.exact_islands,
        lambda k: _compose_group(cand, group_idx, L, cand.num_microbatches, caps, opts, ComposeStats(),
                                 required_mask=1 << k))
    compose_s = counters["compose_s"] + time.perf_counter() - t_c

    stats = _search_stats(par, pairset, counters, cstats, cand, opts, planning_s=time.perf_counter() - t0,
                          compose_s=compose_s, atom_layers=atom_layers, tried=tried)
    plan = build_plan(cand, comp_best, cluster=cluster, model=model, training=training, runtime=caps.name,
                      islands_dropped=dropped, planner=stats, schedule=opts.schedule, capabilities=caps)
    stats["gpus_idle"] = _idle_gpus(plan, all_islands, b_best)
    plan = _with_planner(plan, stats)
    problems = caps.plan_problems(plan)
    assert not problems, f"the composer produced a plan {caps.name} cannot run: {problems}"
    stats["planning_time_s"] = round(time.perf_counter() - t0, 4)
    plan = _with_planner(plan, stats)
    return SearchResult(plan=plan, composition=comp_best, candidates=cand, all_candidates=all_cands,
                        results=results, pairs=pairset, islands=iset, usable=usable, capabilities=caps,
                        parallelizer=par, atoms=atoms, stats=stats,
                        scored_s=tuple(c.objective_s for c in cstats.scored))


def _usable_islands(all_islands: Sequence["Island"], atoms: ModelAtoms, caps: RuntimeCapabilities,
                    dtype: str) -> tuple[tuple["Island", ...], list[str]]:
    """The islands that can train in ``dtype``, and why the others cannot; InfeasibleError where the runtime cannot
    train in it, no island can, or the model's state cannot fit in the usable islands' memory."""
    if caps.dtype_problems(dtype):
        raise InfeasibleError(f"the {caps.name} runtime cannot train in {dtype}", caps.dtype_problems(dtype))
    usable = tuple(i for i in all_islands if dtype_problem(i, dtype) is None)
    reasons = [p for i in all_islands if (p := dtype_problem(i, dtype))]
    if not usable:
        raise InfeasibleError("no island can train in " + dtype, reasons)
    mem = _memory_reasons(atoms, usable, caps)
    if mem:
        raise InfeasibleError("no plan fits in memory", mem + reasons)
    return usable, reasons


def _search_stats(par: Parallelizer, pairset: PairSet, counters: dict, cstats: ComposeStats, cand: Candidates,
                  opts: PlannerOptions, *, planning_s: float, compose_s: float, atom_layers: int,
                  tried: Sequence[int]) -> dict:
    """The search's figures for the Plan's ``planner`` block (cand: the chosen size's Candidates)."""
    return {
        "parallelizer": getattr(par, "name", type(par).__name__),
        "planning_time_s": round(planning_s, 4),
        "pairs": pairset.counts["total"],
        "queries": counters["queries"],
        "pruned": {k: pairset.counts[k] for k in ("incompatible", "infeasible", "unbalanced", "redundant")},
        "b": cand.b,
        "atom_layers": atom_layers,
        "microbatch_sequences_tried": sorted(tried),
        "configs_evaluated": counters["configs"],
        "configs_bounded": counters["bounded"],
        "microbatch_sizes_skipped": counters["sizes_skipped"],  # their floor could not beat the plan found
        "pairs_skipped": counters["pairs_skipped"],  # not queried: part of no pipeline beating the plan found
        "query_time_s": round(counters["query_s"], 4),
        "compose_time_s": round(compose_s, 4),
        "workers": opts.max_workers or default_workers(),
        "compose": {"dp_runs": cstats.dp_runs, "states": cstats.states, "options": len(cand.options),
                    "simulated": len(cstats.scored), "best_closed_form_s": cstats.best_closed_s},
        "pruning": {"redundant": opts.pruning.redundant, "unbalanced": opts.pruning.unbalanced,
                    "infeasible": opts.pruning.infeasible, "balance_tolerance": opts.pruning.balance_tolerance},
    }


def make_plan(cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", *,
              runtime: str | RuntimeCapabilities = DEFAULT_RUNTIME, parallelizer: str | Parallelizer = "megatron",
              islands: IslandSet | None = None, options: PlannerOptions | None = None) -> Plan:
    """The best heterogeneous plan; raises InfeasibleError (with reasons) when nothing fits."""
    return search(cluster, model, training, runtime=runtime, parallelizer=parallelizer, islands=islands,
                  options=options).plan


# --- helpers -------------------------------------------------------------------------------------------------------

def _try_microbatches(bs: Sequence[int], best, results: dict, all_cands: dict, counters: dict,
                      cstats: ComposeStats, *, cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec",
                      pairset: PairSet, islands: Sequence["Island"], caps: RuntimeCapabilities, pool: QueryPool,
                      opts: PlannerOptions, memo: "SizeMemo | None" = None):
    """Query and compose the micro-batch sizes ``bs``; returns the best plan so far (Incumbent).

    Branch and bound over the queries: (1) every b's single-island pairs (the whole model on one island: few
    queries, bounded by earlier rounds' best) are composed first, which gives an incumbent and an order of the
    sizes; (2) size by size, most promising first, the other pairs are asked with the closed-form latency to beat
    as their bound (SliceQuery.latency_bound_s): a slice plan whose own (m - 1) x bottleneck + stage times + tail
    exceeds it is part of no pipeline the composer would still consider, so the parallelizer skips it (the
    closed-form optimum, and so the plans scored against it, are those of the full search).
    """
    L = model.num_layers
    whole = [p for p in pairset.queries if p.layers == (0, L)]
    rest = [p for p in pairset.queries if p.layers != (0, L)]
    bnb = opts.branch_and_bound
    present = sorted({p.island for p in pairset.pairs})  # the islands a pipeline can use
    floors = {b: _size_floor(b, model=model, training=training, islands=islands, caps=caps,
                             par=pool.parallelizer if bnb else None,
                             links=_least_links_at(b, cluster, model, training, islands, present)) for b in bs}

    def bound() -> tuple[float, float]:
        """(closed form to beat: compose.ComposeStats.threshold_s, best predicted iteration); inf without B&B."""
        if not bnb or best is None:
            return math.inf, math.inf
        return cstats.threshold_s(best.latency_s, opts.score_band), best.latency_s

    def visit(b: int, pairs: Sequence[Pair], use_incumbent: bool) -> float | None:
        """Ask size b's ``pairs`` and compose all of b's answers so far; b's own best, None if b was skipped."""
        nonlocal best
        if floors[b].beyond(*bound()):
            counters["sizes_skipped"] += 1
            return None
        _ask(b, pairs, *bound(), floors[b], results, counters, model=model, training=training, islands=islands,
             caps=caps, pool=pool)
        best, own_s = _compose_b(b, best, results, all_cands, counters, cstats, cluster=cluster, model=model,
                                 training=training, pairset=pairset, islands=islands, caps=caps, opts=opts,
                                 use_incumbent=use_incumbent, memo=memo)
        return own_s

    first: list[tuple[float, float, int]] = []
    for b in sorted(bs, key=lambda b: (floors[b].latency_s, b)):  # most promising first: its plan bounds the rest
        results.setdefault(b, {})
        own_s = visit(b, whole, use_incumbent=False)  # each size's own single-island latency orders the sizes below
        if own_s is not None:
            first.append((own_s, floors[b].latency_s, b))
    # above exact_islands a class's composition is a search over island sets or orders costing seconds, and the
    # first round's would be done again whole: there the queries the split saves cost less than that (the same
    # plans either way)
    split = len({p.island for p in rest}) <= opts.exact_islands
    for _own, _floor, b in sorted(first) if rest else ():
        left = rest
        if bnb and floors[b].pairs is not None and (best is None or len(best.composition.options) == 1):
            # while only single-island plans bound the search: first a few pipelines over the fastest islands, each
            # island's layers in proportion to its speed (_seed_pairs: a plan near the best one, whose bound makes
            # the next round's queries cheaper and their options fewer), then (up to exact_islands islands) the
            # size's most promising quarter of pairs (by their floors), whose plan bounds the rest, most of which
            # then need no query
            pf = floors[b].pairs
            seed = _seed_pairs(rest, pairset.pairs, pf, _seed_orders(islands, sorted(pf.own), training.dtype), L)
            if seed:
                visit(b, seed, use_incumbent=True)
                taken = set(seed)
                left = [p for p in rest if p not in taken]
            if split:
                ranked = sorted(range(len(left)), key=lambda i: (pf.floor(left[i].island, *left[i].layers)[0], i))
                head = set(ranked[:max(1, int(len(rest) * FIRST_ROUND_SHARE) - len(seed))])
                visit(b, [p for i, p in enumerate(left) if i in head], use_incumbent=True)
                left = [p for i, p in enumerate(left) if i not in head]
        visit(b, left, use_incumbent=True)
    return best


def _seed_orders(islands: Sequence["Island"], present: Sequence[int], dtype: str) -> list[list[int]]:
    """The island orders of the seed round: island_orders over the fastest k islands, for every k from 2. A plan
    over every island pays the bubble of all their stages, and the best plan often leaves the slow islands out,
    which only a seed over the fast ones comes near."""
    fast = fastest_first(islands, present, dtype)
    out: list[list[int]] = []
    for k in range(2, len(fast) + 1):
        for order in island_orders(islands, fast[:k], dtype):
            if order not in out:
                out.append(order)
    return out


def _seed_pairs(queries: Sequence[Pair], pairs: Sequence[Pair], floors: PairFloors,
                orders: Sequence[Sequence[int]], num_layers: int) -> list[Pair]:
    """The queries (redundancy representatives) of _seed_chains' pipelines. A seed for the branch and bound: such
    a plan is often close to the best one, so the rounds after it ask with a tighter bound (a few queries, after
    which the next round keeps fewer options)."""
    rep = {q.key: q for q in queries}
    out: dict[Pair, None] = {}
    for chain in _seed_chains(pairs, floors, orders, num_layers):
        if all(p.key in rep for p in chain):
            out.update(dict.fromkeys(rep[p.key] for p in chain))
    return list(out)


def _seed_chains(pairs: Sequence[Pair], floors: PairFloors, orders: Sequence[Sequence[int]],
                 num_layers: int) -> list[list[Pair]]:
    """Per order of ``orders`` (island indices, front to back), a pipeline of ``pairs`` over its islands with
    floors, front to back, each island's layers in proportion to its GPUs over its GPU-seconds floor per layer:
    the kept pair whose stop is nearest that share, leaving a layer for each island behind. An order for which the
    pruning left no such chain has none."""
    L = num_layers
    at: dict[tuple[int, int], list[int]] = {}  # (island, start) -> stops of kept pairs
    for p in pairs:
        at.setdefault((p.island, p.layers[0]), []).append(p.layers[1])
    place = {(p.island, *p.layers): p for p in pairs}
    out: list[list[Pair]] = []
    for order in orders:
        ks = [k for k in order if k in floors.own]
        if len(ks) < 2:
            continue
        rate = [floors.gpus[k] / max(floors.own[k][0][-1], 1e-30) for k in ks]  # layers per second, relatively
        total, acc, start, chain = sum(rate), 0.0, 0, []
        for i, k in enumerate(ks):
            acc += rate[i]
            stops = [t for t in at.get((k, start), ()) if t <= L - (len(ks) - 1 - i)]  # room for the others
            if i == len(ks) - 1:
                stops = [t for t in stops if t == L]
            if not stops:
                break
            want = L * acc / total
            stop = min(stops, key=lambda t: (abs(t - want), t))
            chain.append(place[k, start, stop])
            start = stop
        if start == L:
            out.append(chain)
    return out


@dataclass
class SizeMemo:
    """What one search's rounds at a micro-batch size leave for its next round (_compose_b)."""

    judged: dict = field(default_factory=dict)  # b -> make_candidates' memo: answers judged, pairs' options
    composed: dict = field(default_factory=dict)  # (b, class) -> (options, closed form, score bounds)
    # b -> (options, closed form and score bounds, classes) when a round at b ended: a round with the same options
    # under bounds no looser has nothing to find (every class was composed, or skipped, under bounds at least those)
    rounds: dict = field(default_factory=dict)
    minima: dict = field(default_factory=dict)  # b -> an answer's key -> (its templates, classes.group_minima)
    fields: dict = field(default_factory=dict)  # b -> an answer's key -> (its templates, their fields as an array)


class SizeFloor(NamedTuple):
    """Floors at one micro-batch size: under any plan's latency, and under the fill of any set of layers."""

    latency_s: float  # under the closed form
    score_s: float  # under the predicted iteration (m x the slowest stage at least)
    prefix_s: tuple[float, ...]  # prefix_s[i]: least forward + backward seconds of layers [0, i), any island/grid
    embedding_s: float
    head_s: float
    pairs: PairFloors | None = None  # per pair: under any pipeline holding it (pair_floors.py)
    # per island the least link into it and out of it at this size (_least_links_at), where the driver gave them
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


def _least_links_at(b: int, cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec",
                    islands: Sequence["Island"], present: Sequence[int]) -> tuple[dict[int, float], dict[int, float]]:
    """Per island of ``present``, the least one-way link into it and out of it from another, at micro-batch size b
    (bounds.least_links; 0 where there is no other)."""
    return least_links(LinkModel(cluster, islands, activation_bytes(
        b, training.seq_len, model.hidden_size, training.param_bytes)).island_matrix(), present, default=0.0)


def _size_floor(b: int, *, model: "ModelSpec", training: "TrainingSpec", islands: Sequence["Island"],
                caps: RuntimeCapabilities, par: Parallelizer | None,
                links: tuple[dict[int, float], dict[int, float]] | None = None) -> SizeFloor:
    """Floors at micro-batch size b from the parallelizer's compute floors (``compute_floors``; all 0 for a
    parallelizer without them): every layer runs on some stage of n GPUs for at least its floor time, so the
    slowest of the stages takes at least the model's GPU-seconds / the usable GPUs' capacity (pair_floors.capacity:
    GPUs, each island's counted at its slowdown against the least floors), and one micro-batch through the pipeline
    at least the sum of the layers' floors:

        closed form >= (m - 1) x sum(GPU-seconds floors) / capacity + sum(seconds floors)
        predicted iteration >= max(m x sum(GPU-seconds floors) / capacity, sum(seconds floors))

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
    gpu_s = sum(best[k][0] for k in kinds) + best["embedding"][0] + best["head"][0]
    prefix = (0.0, *itertools.accumulate(best[k][1] for k in kinds))
    fill_s = prefix[-1] + best["embedding"][1] + best["head"][1]
    m = training.global_batch // b
    # per-pair floors need every island's floors for every kind (an island left out would lower the others' GPUs).
    # Only where a query costs a process grid per TP x DP x CP split (megatron, torch; under deepspeed, without TP,
    # queries are cheap and nothing was gained). A skipped pair's every pipeline has a closed form and a predicted
    # iteration that cannot beat the bounds. (The Pareto composer takes every plan whose score floor can beat the
    # best score as a candidate: every example plan is the same with and without it.)
    pairs = (PairFloors(kinds, per_island, gpus, m, links)
             if caps.tensor_parallel and all(needed <= f.keys() for f in per_island.values()) else None)
    cap = capacity(kinds, per_island, gpus)  # <= their GPUs
    return SizeFloor((m - 1) * gpu_s / cap + fill_s, bounds.chain_score_floor_s(m * gpu_s / cap, fill_s), prefix,
                     best["embedding"][1],
                     best["head"][1], pairs, links)


def _outside_s(floor: SizeFloor, pair: Pair, into: dict[int, float], out_of: dict[int, float],
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


def _front_s(floor: SizeFloor, pair: Pair, into: dict[int, float]) -> float:
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


def _score_extra_s(front_s: float, outside_s: float, num_layers: int = MAX_VIRTUAL_STAGES) -> float:
    """What any predicted iteration of a pipeline holding a slice plan of ``num_layers`` layers adds to m x its
    slowest stage + its tail, at least: the plain 1F1B runs that stage's m micro-batches after the first one's
    forward reached it and before the last one's backward left the stages in front (bounds.plain_1f1b_floor_s:
    + the fill in front); interleaved with v chunks, 1/v of that fill (interleaved_schedule.interleaved_floor_s),
    where v is at most MAX_VIRTUAL_STAGES and the fewest layers of any stage (interleave.choose_virtual_stages), so
    at most the slice's layers: a slice of one layer cannot interleave. The closed form adds both. A query's score
    bound is lowered by it, as its closed-form bound is by the fill outside (``outside_s``, which a score need not
    add: a slice's slowest stage at the front of an interleaved pipeline never idles)."""
    v = most_virtual_stages(num_layers)
    return front_s if v < 2 else front_s / v


def _ask(b: int, pairs: Sequence[Pair], bound_s: float, score_s: float, floor: SizeFloor, results: dict,
         counters: dict, *, model: "ModelSpec", training: "TrainingSpec", islands: Sequence["Island"],
         caps: RuntimeCapabilities, pool: QueryPool) -> None:
    """Query every pair at size b (``floor``: b's SizeFloor, with its links) in the search's pool; answers go to
    results[b][pair.key]. A pair's query carries the
    closed-form bound less the least fill the rest of any pipeline holding it adds (_outside_s), and the best
    predicted iteration less _score_extra_s, per number of layers its plan's least stage may have
    (SliceQuery.score_bounds_s: a plan with stages of one layer cannot interleave, and pays the fill in front)."""
    L = model.num_layers
    queries: list[SliceQuery] = []
    where: list[Pair] = []
    into, out_of = floor.links
    for p in pairs:
        if floor.pairs is not None and floor.pairs.beyond(p.island, *p.layers, bound_s, score_s):
            # part of no pipeline that could beat the bounds: answered "bounded" without a query
            results[b][p.key] = _merge(results[b].get(p.key), SliceResult((*p.key, b), (), None, bounded=1))
            counters["pairs_skipped"] += 1
            continue
        outside = _outside_s(floor, p, into, out_of, L)
        front = _front_s(floor, p, into)
        n = p.layers[1] - p.layers[0]
        queries.append(SliceQuery(model=model, training=training, layers=p.layers, island=islands[p.island],
                                  microbatch_sequences=b, capabilities=caps, max_stages=caps.max_stages,
                                  pipelined=p.layers != (0, L), latency_bound_s=bound_s - outside,
                                  score_bound_s=score_s - _score_extra_s(front, outside, n),
                                  score_bounds_s=tuple(score_s - _score_extra_s(front, outside, i)
                                                       for i in range(min(n, MAX_VIRTUAL_STAGES)))))
        where.append(p)
    if not queries:
        return
    t_q = time.perf_counter()
    answers = pool.run(queries)
    counters["query_s"] += time.perf_counter() - t_q
    counters["queries"] += len(queries)
    for p, r in zip(where, answers):
        results[b][p.key] = _merge(results[b].get(p.key), r)
    counters["configs"] += sum(r.configs_evaluated for r in answers)
    counters["bounded"] += sum(r.bounded for r in answers)


def _compose_b(b: int, best, results: dict, all_cands: dict, counters: dict, cstats: ComposeStats, *,
               cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", pairset: PairSet,
               islands: Sequence["Island"], caps: RuntimeCapabilities, opts: PlannerOptions,
               use_incumbent: bool = True, memo: "SizeMemo | None" = None):
    """Options of size b from its answers so far, composed per compatibility class (the most promising class
    first, hopeless ones skipped); returns the best plan so far (Incumbent) and the best latency composed at b
    itself (inf if none).

    ``memo`` (SizeMemo) carries what earlier rounds at b did: answers judged once, and per class the options and
    bounds it was last composed with. Under bounds no looser, a class is composed again only if one of its options
    that could be in a plan beating them is new (_compose_group's ``searched``): that earlier composition's plan
    already counts in the best plan. A round that left b's options as they were, under bounds no looser than at the
    end of its last round, ranks no class at all (SizeMemo.rounds)."""
    t_c = time.perf_counter()
    L = model.num_layers
    m = training.global_batch // b
    links = LinkModel(cluster, islands, activation_bytes(b, training.seq_len, model.hidden_size,
                                                         training.param_bytes))
    cand = make_candidates(b, L, pairset.pairs, results[b], islands, caps, links, m, dtype=training.dtype,
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
            return best, own_s
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
        comp = _compose_group(cand, idx, L, m, caps, opts, cstats, incumbent_s=threshold,
                              score_incumbent_s=score_to_beat, schedules=schedules, searched=searched,
                              rows=rows[0])
        if comp is not None:
            own_s = min(own_s, comp.objective_s)
            if best is None or comp.objective_s < best.latency_s:
                best = Incumbent(comp.objective_s, b, group, comp, cand)  # ranked by the iteration the Plan reports
    if memo is not None and use_incumbent and best is not None:
        memo.rounds[b] = (cand.options, cstats.threshold_s(best.latency_s, opts.score_band), best.latency_s,
                          cand.groups)
    counters["compose_s"] += time.perf_counter() - t_c
    return best, own_s


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
    free = {g: GridClass(g.base, None) if g.in_base else None for g in distinct}
    one = {g: g.key if g.grid is not None else None for g in distinct}
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
    interleave in their own class)."""
    interleaves = opts.schedule != "1F1B" and "interleaved-1F1B" in caps.schedules
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


def _with_planner(plan: Plan, stats: dict) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, planner={**dict(plan.planner), **stats})


def _idle_gpus(plan: Plan, islands: Sequence["Island"], b: int) -> dict:
    """How many GPUs the plan leaves idle, and why, per island it uses only in part (islands left out whole are
    explained in islands_dropped)."""
    used: dict[str, int] = {}
    for s in plan.stages:
        used[s.island] = used.get(s.island, 0) + s.num_gpus
    out: dict = {"total": sum(i.num_gpus for i in islands) - sum(used.values()), "islands": {}}
    for isl in islands:
        n = used.get(isl.name)
        if n is None or n == isl.num_gpus:
            continue
        out["islands"][isl.name] = {
            "idle": isl.num_gpus - n,
            "reason": (f"{isl.name}: {n} of {isl.num_gpus} GPUs used; a slice plan's GPUs are pp stages of "
                       f"tp x dp x cp GPUs that divide a node or are whole nodes, with dp dividing the micro-batch "
                       f"of {b} sequences, and no such plan using more of the island was faster")}
    return out


def _merge(old: SliceResult | None, new: SliceResult) -> SliceResult:
    """Without redundancy pruning several pairs share a key; their plans are the same up to a shift, keep one."""
    return new if old is None or (not old.plans and new.plans) else old


@dataclass
class ClassScores:
    """How the composer ranks the pipelines of one compatibility class (``idx``: its options in ``cand``; ``sub``:
    those options, which a pipeline ``seq`` indexes): the predicted iteration build_plan will report, and floors
    under it for pruning. ``schedules``: the schedules whose predictions can matter in this class
    (_score_schedules)."""

    cand: Candidates
    idx: Sequence[int]
    sub: Sequence[Option]
    m: int
    caps: RuntimeCapabilities
    opts: PlannerOptions
    schedules: tuple[str, ...]
    scores: dict = field(default_factory=dict)  # the island orders meet the same plans again and again

    def predicted_s(self, seq: tuple[int, ...], metrics) -> float:
        """What build_plan will report for the pipeline (Candidates.schedule_choice)."""
        hit = self.scores.get(seq)
        if hit is None:
            hit = self.scores[seq] = self.cand.schedule_choice([self.idx[i] for i in seq], metrics,
                                                               schedule=self.opts.schedule,
                                                               capabilities=self.caps).latency_s
        return hit

    def one_grid(self, seq: tuple[int, ...]) -> bool:
        """Whether build_plan may interleave the sequence although only its plain 1F1B counts in this class (a free
        torch class under "auto": a pipeline whose stages share one grid)."""
        if self.opts.schedule == "1F1B" or "interleaved-1F1B" not in self.caps.schedules:
            return False
        grids = {getattr(self.cand.groups[self.idx[i]], "grid", None) for i in seq}
        return len(grids) == 1 and None not in grids

    def plain_floor_s(self, seq: tuple[int, ...], metrics, *, round_trips: bool) -> float:
        """Under the plain 1F1B simulation + tail: bounds.plain_1f1b_floor_s, with ``round_trips`` the larger of
        it and costmodel.pipeline.cycle_floor_1f1b_s over the sequence's stages."""
        floor = plain_1f1b_floor_s(seq, self.sub, self.cand.link_matrix, self.m, metrics.tail_s)
        if round_trips:
            stage_times = self.cand.stage_times([self.idx[i] for i in seq])
            floor = max(floor, cycle_floor_1f1b_s(*stage_times, self.m) + metrics.tail_s)
        return floor

    def floor_s(self, seq: tuple[int, ...], metrics) -> float:
        """Under predicted_s where it can matter: plain 1F1B, the larger of bounds.plain_1f1b_floor_s and the
        round trips across its stage boundaries (costmodel.pipeline.cycle_floor_1f1b_s: where a slow link lies
        between islands, most candidates' simulations are far above the former); interleaved,
        bounds.interleaved_1f1b_floor_s with v <= MAX_VIRTUAL_STAGES; either, the lesser; anything, the slowest
        stage's m forwards and backwards and the tail."""
        if self.schedules == SCORE_ANY:
            return self.m * max(self.sub[i].bottleneck_s for i in seq) + metrics.tail_s
        floor = math.inf
        if "plain" in self.schedules:
            # (with only plain counted, a one-grid pipeline's score may be interleaved: not under the round trips;
            # nor for a plan of one slice plan, whose stages would have to be built: the fine floor reads them,
            # for those this floor lets through, and a size's first ranking meets thousands of such plans)
            floor = self.plain_floor_s(seq, metrics, round_trips=len(seq) > 1 and (
                "interleaved" in self.schedules or not self.one_grid(seq)))
        if "interleaved" in self.schedules:
            floor = min(floor, interleaved_1f1b_floor_s(seq, self.sub, self.cand.link_matrix, self.m, metrics.fill_s,
                                                        metrics.tail_s, MAX_VIRTUAL_STAGES))
        return floor

    def fine_floor_s(self, seq: tuple[int, ...], metrics) -> float:
        """Under predicted_s, asked only before scoring: the lesser of the plain 1F1B's floors (compose's and the
        round trips across its stage boundaries) and the best interleaved schedule's own floor
        (interleaved_schedule.interleaved_floor_s of its stages), which needs no simulation. Under any schedule and class (an interleaved score is the interleaved prediction): floor_s's
        interleaved floor is the least over every number of virtual stages and memory, this one the schedule
        build_plan would choose, so far fewer candidates are simulated."""
        plain = self.plain_floor_s(seq, metrics, round_trips=True)
        if self.opts.schedule == "1F1B":
            return plain
        inter = self.cand.interleaved_choice([self.idx[i] for i in seq], metrics, schedule=self.opts.schedule,
                                             capabilities=self.caps)
        return min(plain, inter.latency_s) if inter.virtual_stages > 1 else plain


class ClassOptions(NamedTuple):
    """The options of a class worth composing (_class_options): their indices in the Candidates, those options,
    their rows (Candidates.option_rows) where known, and the islands a pipeline may use, as a list and a mask."""

    idx: Sequence[int]
    sub: Sequence[Option]
    rows: "np.ndarray | None"
    present: list[int]
    allowed_mask: int | None


def _class_options(cand: Candidates, idx: Sequence[int], L: int, m: int, opts: PlannerOptions, *,
                   allowed_mask: int | None, required_mask: int, incumbent_s: float, score_incumbent_s: float,
                   schedules: tuple[str, ...], searched: Sequence[Option] | None,
                   rows: "np.ndarray | None") -> ClassOptions | None:
    """The class's options that some plan beating the incumbents can hold (cover_floors.promising: compose would
    prune the others at every use, but they cost it time in each of up to hundreds of island orders), and the
    islands to compose over; None where every promising option was ``searched`` before (every plan that could beat
    the bounds holds only options searched before: it was found then)."""
    # with the floors of the class's own schedules where it is composed in many island orders or by the merged exact
    # search (above exact_islands): there an option dropped saves more than its floors cost
    weight = 1.0 / MAX_VIRTUAL_STAGES if "interleaved" in schedules else 0.0
    many = len(cand.islands) > opts.exact_islands
    idx = promising(cand.options, idx, L, m, incumbent_s, score_incumbent_s, cand.link_matrix,
                    schedules=schedules if many else SCORE_ANY, fill_weight=weight if many else 0.0,
                    rows=rows[idx] if rows is not None else None)
    sub_rows = rows[idx] if rows is not None else None  # (the kept options' rows: compose prepares by them)
    sub = pick(cand.options, idx)
    if searched is not None and set(sub) <= set(searched):
        return None
    if sub_rows is not None:
        present = sorted(k for k in set(sub_rows[:, 2].astype(int).tolist())
                         if allowed_mask is None or allowed_mask >> k & 1)
    else:
        present = sorted({o.island for o in sub if allowed_mask is None or allowed_mask >> o.island & 1})
    if allowed_mask is None and present:  # (what compose takes by default, from these options: every island)
        allowed_mask = (1 << (1 + present[-1])) - 1
    if len(present) > opts.exact_islands and merged_states(cand.link_matrix, present) > MERGED_EXACT_STATES:
        # (where the exact search over every island set runs anyway, its floors per set of free islands prune what
        # an island left out would)
        present = _hopeful_islands(sub, present, required_mask, L, m, score_incumbent_s)
        allowed_mask = sum(1 << k for k in present)
    return ClassOptions(idx, sub, sub_rows, present, allowed_mask)


def _compose_group(cand: Candidates, idx: Sequence[int], L: int, m: int, caps: RuntimeCapabilities,
                   opts: PlannerOptions, stats: ComposeStats, *, allowed_mask: int | None = None,
                   required_mask: int = 0, incumbent_s: float = float("inf"),
                   score_incumbent_s: float = float("inf"),
                   schedules: tuple[str, ...] = SCORE_ANY,
                   searched: Sequence[Option] | None = None,
                   rows: "np.ndarray | None" = None) -> Composition | None:
    """The composer on one compatibility class: exact over island subsets up to ``opts.exact_islands`` islands,
    beyond that over a bounded set of island orders (polynomial; see orders.search_orders). ``incumbent_s``: the
    closed form to beat; ``score_incumbent_s``: the best predicted iteration found elsewhere (winners that cannot
    beat it are not simulated); ``schedules``: the schedules whose predictions can matter here (_score_schedules),
    so that the composer prunes by their floors; ``searched``: options of this class already composed under bounds
    no tighter, whose plans already count in the incumbents: None is returned unless a promising option is new.
    ``rows``: every option of ``cand`` as Candidates.option_rows (promising then reads the class's rows), or None."""
    chosen = _class_options(cand, idx, L, m, opts, allowed_mask=allowed_mask, required_mask=required_mask,
                            incumbent_s=incumbent_s, score_incumbent_s=score_incumbent_s, schedules=schedules,
                            searched=searched, rows=rows)
    if chosen is None:
        return None
    idx, sub, present = chosen.idx, chosen.sub, chosen.present
    edges = pick(cand.edges, idx) if len(cand.edges) == len(cand.options) else None
    weight = 1.0 / MAX_VIRTUAL_STAGES if "interleaved" in schedules else 0.0
    scorer = ClassScores(cand, idx, sub, m, caps, opts, schedules)
    best = None

    def run(order: list[int] | None, merge_fronts: bool = False, quick_plan: bool = True) -> float | None:
        nonlocal best
        comp = compose(sub, cand.link_matrix, L, m, allowed_mask=chosen.allowed_mask, required_mask=required_mask,
                       max_stages=caps.max_stages, bound_step=opts.bound_step, island_order=order,
                       incumbent_s=min(incumbent_s, stats.threshold_s(best.objective_s if best else None,
                                                                      opts.score_band)),
                       stats=stats, score=scorer.predicted_s, score_band=opts.score_band,
                       score_floor=scorer.floor_s, score_floor_fine=scorer.fine_floor_s,
                       score_incumbent_s=min(score_incumbent_s, best.objective_s if best else float("inf")),
                       score_fill_weight=weight, score_schedules=schedules, merge_fronts=merge_fronts,
                       undominated=True, edge_s=edges,  # grid_classes.undominated judged each class
                       quick_plan=quick_plan, rows=chosen.rows)
        if comp is None:
            return None
        if best is None or comp.objective_s < best.objective_s:  # without the band, compose gates nothing
            best = comp
        return comp.objective_s

    if len(present) <= opts.exact_islands:
        run(None)
    elif merged_states(cand.link_matrix, present) <= MERGED_EXACT_STATES:
        # the exact DP over every island set and order (compose.front_classes), after one seed order whose plan
        # bounds it (unbounded, it costs several times the CPU); the seed's plan bounds it as the DP's quick plan
        # would, so it has none
        run(island_orders(cand.islands, present, cand.training_dtype)[0])
        run(None, merge_fronts=True, quick_plan=False)
    else:
        search_orders(run, present, cand.link_matrix, island_orders(cand.islands, present, cand.training_dtype))
    if best is None:
        return None
    return Composition(tuple(idx[i] for i in best.options), best.metrics, best.bound_s, best.score_s)


def _hopeful_islands(sub: Sequence[Option], present: Sequence[int], required_mask: int, L: int, m: int,
                     score_incumbent_s: float) -> list[int]:
    """The islands some plan through which could still beat the best predicted iteration found elsewhere: an
    island under whose every plan the score floor (dropped.island_floor_s) is no lower is left out, until none is
    (each one left out raises the others' floors). Every plan through such an island loses to the incumbent, so
    none that could win is lost, and fewer islands can bring the search back to the exact one (<= exact_islands)."""
    keep = list(present)
    if score_incumbent_s == math.inf:
        return keep
    while True:
        idx = [i for i, o in enumerate(sub) if o.island in keep]
        floors = island_floors_s(sub, idx, [k for k in keep if not required_mask >> k & 1], L, m)
        out = [k for k in keep if required_mask >> k & 1 or floors[k] < score_incumbent_s]
        if len(out) == len(keep):
            return out
        keep = out


def fastest_first(islands: Sequence["Island"], present: Sequence[int], dtype: str) -> list[int]:
    """``present`` by peak TFLOPS in ``dtype``, fastest first (ties: more memory per GPU, then index)."""
    return sorted(present, key=lambda k: (-compute_tflops(islands[k].gpu, dtype), -islands[k].gpu.memory_gib, k))


def island_orders(islands: Sequence["Island"], present: Sequence[int], dtype: str) -> list[list[int]]:
    """Pipeline orders tried when there are too many islands for the exact search: most memory per GPU first
    (early stages hold the most in-flight activations under 1F1B), fastest first, slowest first, and least
    memory first; each is searched exactly."""

    def mem(k: int) -> float:
        return islands[k].gpu.memory_gib

    def speed(k: int) -> float:
        return compute_tflops(islands[k].gpu, dtype)

    candidates = [sorted(present, key=lambda k: (-mem(k), -speed(k), k)),
                  fastest_first(islands, present, dtype),
                  sorted(present, key=lambda k: (speed(k), -mem(k), k)),
                  sorted(present, key=lambda k: (mem(k), -speed(k), k))]
    out: list[list[int]] = []
    for o in candidates:
        if o not in out:
            out.append(o)
    return out


def _infeasible_reasons(cands: dict[int, Candidates], pairset: PairSet, reasons: list[str],
                        caps: RuntimeCapabilities) -> list[str]:
    out = list(reasons) + [n for n in pairset.island_notes.values() if n not in reasons]
    # One line per island and per drop reason, whatever the number of micro-batch sizes that failed alike.
    first: dict[str, tuple[int, str]] = {}
    sizes: dict[str, list[int]] = {}
    dropped: dict[str, list[int]] = {}
    for cand in sorted(cands.values(), key=lambda c: c.b):
        for isl, msgs in cand.infeasible.items():
            if msgs:
                first.setdefault(isl, (cand.b, msgs[0]))  # the smallest micro-batch: the nearest to fitting
                sizes.setdefault(isl, []).append(cand.b)
        for why, n in cand.dropped.items():
            dropped.setdefault(why, [0])[0] += n
            dropped[why].append(cand.b)
    for isl, (b, msg) in first.items():
        text = msg if msg.startswith(isl) else f"{isl}: {msg}"
        more = sizes[isl][1:]
        text += f" (shown at b={b}, the smallest micro-batch; b={','.join(map(str, more))} fail too)" if more else ""
        if text not in out:
            out.append(text)
    for why, (n, *bs) in dropped.items():
        out.append(f"{plural(n, 'slice plan')} dropped at b={','.join(map(str, bs))}: {why} ({caps.name})")
    if not any(c.options for c in cands.values()):
        out.append("no slice plan of any pair fits in GPU memory")
    else:
        out.append("slice plans exist, but no sequence of them covers the model with each stage fitting in memory "
                   "at its pipeline position" + (" under one process grid" if caps.uniform_grid else ""))
    return out
