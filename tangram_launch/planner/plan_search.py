"""The Tangram planner's entry point: cluster + model + training -> the frozen Plan.

    from tangram_launch.planner import make_plan
    plan = make_plan(cluster, model, training, runtime="megatron", parallelizer="megatron")

Steps (paper §5), each in the module named: islands (§4) -> slice/island pairs, pruned (slices.py) -> for each
candidate micro-batch size b, every divisor of the global batch or those asked for (size_search.py), parallel
parallelizer queries (query_pool.py) -> options (build.py) -> composition per runtime compatibility class
(size_composition.py, class_composition.py, compose.py; above five islands over a bounded set of island orders,
orders.py, unless few link classes keep the exact search small, compose.front_classes; each ranked by the
iteration the Plan reports: the simulated 1F1B, or interleaved where faster) -> the best over b, so the plan is the
best over all of them. Branch and bound: the sizes are visited most promising first (a floor under any plan's
latency at each size, size_floors.py, from the parallelizer's compute floors; the order changes only the time), a
size whose floor cannot beat the best plan so far is skipped, and every query carries the best latency so far so
the parallelizer costs only what could beat it. A pair whose floor (pair_floors.py: its layers on its island,
the others on the other islands) cannot beat it is not asked at all. A size's compatibility classes
are composed in the order of their floors (classes.py: each island holds one slice), and those that cannot beat it
are skipped; inside a class, options no plan beating the bounds can hold, and above five islands islands none can
use, are dropped before composing (cover_floors.py). -> islands left out (reasons from a floor, dropped.py), and
GPUs left idle, with reasons (reasons.py) -> Plan (build.py). Nothing fits: InfeasibleError with the reasons
(reasons.py; exit status 3 on the command line). planner/bounds.py lists every pruning bound. Where the plan leaves
whole nodes of an island idle, the same search runs once more with that island split into its used and idle nodes
(island_split.py), and the faster plan is kept."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from tangram_launch.capabilities import DEFAULT_RUNTIME, RuntimeCapabilities
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.islands import IslandSet, build_islands
from tangram_launch.parallelizers.base import Parallelizer, SliceResult
from tangram_launch.plan import Plan
from tangram_launch.planner.build import Candidates, build_plan
from tangram_launch.planner.class_composition import compose_group
from tangram_launch.planner.compose import Composition, ComposeStats
from tangram_launch.planner.dropped import dropped_islands
from tangram_launch.planner.gc_pause import no_collections
from tangram_launch.planner.island_split import in_pipeline_order, split_idle
from tangram_launch.planner.options import PlannerOptions
from tangram_launch.planner.query_pool import QueryPool, default_workers
from tangram_launch.planner.reasons import idle_gpus, infeasible_reasons, usable_islands
from tangram_launch.planner.resolve import resolve_capabilities, resolve_parallelizer
from tangram_launch.planner.size_composition import SearchContext, SearchState, SizeMemo
from tangram_launch.planner.size_search import candidate_sizes, try_microbatches
from tangram_launch.planner.slices import ModelAtoms, PairSet, auto_atom_layers, build_pairs

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import Island
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec


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
    unsplit: "SearchResult | None" = None  # the search over the islands as built, where a split island beat it


def search(cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", *,
           runtime: str | RuntimeCapabilities = DEFAULT_RUNTIME, parallelizer: str | Parallelizer = "megatron",
           islands: IslandSet | None = None, options: PlannerOptions | None = None) -> SearchResult:
    """Plan, and keep everything that went into the plan."""
    opts = options or PlannerOptions()
    # gc_pause.py: the search makes no reference cycles, and collections only rescanned its many long-lived
    # objects. One query pool for all the search's batches (query_pool.py): its workers keep their caches warm,
    # and stop when the search ends.
    with no_collections(), QueryPool(resolve_parallelizer(parallelizer, opts.gpu_counts), opts.max_workers,
                                      progress=opts.progress, label=f"planning {model.name}") as pool:
        result = _search(cluster, model, training, runtime=runtime, pool=pool, islands=islands, options=opts)
        if opts.split_idle_islands:
            result = _with_idle_split(result, cluster, model, training, runtime=runtime, pool=pool, options=opts)
        return result


def _with_idle_split(result: SearchResult, cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", *,
                     runtime: str | RuntimeCapabilities, pool: QueryPool, options: PlannerOptions) -> SearchResult:
    """The search once more with each island the plan leaves whole nodes of idle split into its used and idle
    nodes (island_split.py); the faster of the two plans, the split one saying which island became which parts."""
    split = split_idle(result.islands, result.plan)
    if split is None or len(split[0].islands) > options.exact_islands:  # the exact composer's range only:
        return result  # above it a search of thousands of GPUs would run twice
    iset, parts = split
    spent = [result.stats["planning_time_s"]]  # every search's time counts in the plan's, kept or not

    def timed_search(islands: IslandSet) -> SearchResult:
        t0 = time.perf_counter()
        try:
            return _search(cluster, model, training, runtime=runtime, pool=pool, islands=islands, options=options)
        finally:
            spent.append(time.perf_counter() - t0)

    try:
        alt = timed_search(iset)
    except InfeasibleError:
        alt = None
    if alt is None or alt.plan.predicted.iteration_time_s >= result.plan.predicted.iteration_time_s:
        result.stats["planning_time_s"] = round(sum(spent), 4)
        result.plan = _with_planner(result.plan, result.stats)
        return result
    ordered = in_pipeline_order(result.islands, iset, parts, alt.plan)
    if ordered is not None:  # the same parts, the one the pipeline reaches first on the island's first nodes
        again = timed_search(ordered[0])
        if again.plan.predicted.iteration_time_s <= alt.plan.predicted.iteration_time_s:
            alt, (iset, parts) = again, ordered
    # the stages keep the names of the islands `tangram-launch islands` lists; the split is said in the stats
    whole_of = {part: name for name, pair in parts.items() for part in pair}
    nodes_of = {isl.name: isl.num_nodes for isl in iset.islands}
    alt.stats["islands_split"] = {
        "islands": {name: [{"nodes": nodes_of[part],
                            "stages": [st.index for st in alt.plan.stages if st.island == part]} for part in pair]
                    for name, pair in parts.items()},
        "unsplit_iteration_s": result.plan.predicted.iteration_time_s}
    named = dataclasses.replace(
        alt.plan, stages=tuple(dataclasses.replace(st, island=whole_of.get(st.island, st.island))
                               for st in alt.plan.stages),
        islands_used=tuple(dict.fromkeys(whole_of.get(i, i) for i in alt.plan.islands_used)))
    t0 = time.perf_counter()
    written = _as_written(named, cluster, model, training, runtime=runtime, parallelizer=alt.parallelizer,
                          islands=result.islands, options=options)
    spent.append(time.perf_counter() - t0)
    if written is not None and written.predicted.iteration_time_s >= result.plan.predicted.iteration_time_s:
        result.stats["planning_time_s"] = round(sum(spent), 4)
        result.plan = _with_planner(result.plan, result.stats)
        return result
    alt.stats["planning_time_s"] = round(sum(spent), 4)
    if written is None:
        alt.plan = _with_planner(named, alt.stats)
    else:  # the search's figures, the written plan's pipeline (its GPUs, p2p and prediction)
        own = ("p2p_s", "schedule_notes", "plain_1f1b_iteration_s")
        planner = {**{k: v for k, v in alt.plan.planner.items() if k not in own},
                   **{k: v for k, v in written.planner.items() if k in own}, **alt.stats}
        alt.plan = dataclasses.replace(written, planner=planner, islands_dropped=named.islands_dropped)
    alt.unsplit = result
    return alt


def _as_written(plan: Plan, cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", *,
                runtime: str | RuntimeCapabilities, parallelizer: Parallelizer, islands: IslandSet,
                options: PlannerOptions) -> Plan | None:
    """A split plan's stages as a hand-written plan names them (the islands as built, every field given), costed by
    the hand-written path: the plan a user who writes it down gets, GPUs and prediction. The split search priced
    its parts as two islands, a link between them; on one island, consecutive stages of one grid are one slice
    (planner/manual.py), as the search prices every other slice. None where that path cannot cost it."""
    from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan, written_form

    try:
        manual = parse_manual_plan(written_form(plan), num_layers=model.num_layers,
                                   island_names=[i.name for i in islands.islands])
        return cost_manual_plan(manual, cluster, model, training, runtime=runtime, parallelizer=parallelizer,
                                islands=islands, options=options)
    except (InfeasibleError, SpecError):
        return None


def make_plan(cluster: "ClusterSpec", model: "ModelSpec", training: "TrainingSpec", *,
              runtime: str | RuntimeCapabilities = DEFAULT_RUNTIME, parallelizer: str | Parallelizer = "megatron",
              islands: IslandSet | None = None, options: PlannerOptions | None = None) -> Plan:
    """The best heterogeneous plan; raises InfeasibleError (with reasons) when nothing fits."""
    return search(cluster, model, training, runtime=runtime, parallelizer=parallelizer, islands=islands,
                  options=options).plan


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

    usable, reasons = usable_islands(all_islands, atoms, caps, training.dtype)
    atom_layers = opts.atom_layers or auto_atom_layers(L)
    pairset = build_pairs(atoms, all_islands, caps, opts.pruning, atom_layers=atom_layers)
    if not pairset.pairs:
        raise InfeasibleError("every slice/island pair was pruned", list(pairset.island_notes.values()) or reasons)

    bs = candidate_sizes(G, opts.microbatch_sequences)

    state = SearchState(memo=SizeMemo())
    tried = list(bs)
    try_microbatches(bs, SearchContext(cluster=cluster, model=model, training=training, pairset=pairset,
                                       islands=all_islands, caps=caps, opts=opts, pool=pool), state)
    t_c = time.perf_counter()
    best, all_cands, counters, cstats, results = state.best, state.all_cands, state.counters, state.cstats, \
        state.results
    if best is None:
        raise InfeasibleError("no feasible plan", infeasible_reasons(all_cands, pairset, reasons, caps))
    b_best, group_best, comp_best, cand = best.b, best.group, best.composition, best.candidates
    group_idx = cand.class_members()[group_best]
    dropped = dropped_islands(
        cand, group_idx, comp_best, all_islands, pairset, L, caps, opts.exact_islands,
        lambda k: compose_group(cand, group_idx, L, cand.num_microbatches, caps, opts, ComposeStats(),
                                required_mask=1 << k))
    compose_s = counters["compose_s"] + time.perf_counter() - t_c

    stats = _search_stats(par, pairset, counters, cstats, cand, opts, planning_s=time.perf_counter() - t0,
                          compose_s=compose_s, atom_layers=atom_layers, tried=tried)
    plan = build_plan(cand, comp_best, cluster=cluster, model=model, training=training, runtime=caps.name,
                      islands_dropped=dropped, planner=stats, schedule=opts.schedule, capabilities=caps)
    stats["gpus_idle"] = idle_gpus(plan, all_islands, b_best)
    plan = _with_planner(plan, stats)
    problems = caps.plan_problems(plan)
    assert not problems, f"the composer produced a plan {caps.name} cannot run: {problems}"
    stats["planning_time_s"] = round(time.perf_counter() - t0, 4)
    plan = _with_planner(plan, stats)
    return SearchResult(plan=plan, composition=comp_best, candidates=cand, all_candidates=all_cands,
                        results=results, pairs=pairset, islands=iset, usable=usable, capabilities=caps,
                        parallelizer=par, atoms=atoms, stats=stats,
                        scored_s=tuple(c.objective_s for c in cstats.scored))


def _search_stats(par: Parallelizer, pairset: PairSet, counters: dict, cstats: ComposeStats, cand: Candidates,
                  opts: PlannerOptions, *, planning_s: float, compose_s: float, atom_layers: int,
                  tried: Sequence[int]) -> dict:
    """The search's figures for the Plan's ``planner`` block (cand: the chosen size's Candidates)."""
    # the search space's one non-default option is named only when set: default plans keep their bytes
    wider = {"gpu_counts": opts.gpu_counts} if opts.gpu_counts != "tiling" else {}
    return {
        **wider,
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


def _with_planner(plan: Plan, stats: dict) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, planner={**dict(plan.planner), **stats})
