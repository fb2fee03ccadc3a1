"""The loop over micro-batch sizes (try_microbatches): the sizes a search considers (every divisor of the global
batch, or those asked for: candidate_sizes), visited most promising first, each skipped where its floor
(size_floors.py) cannot beat the best plan so far; per size, rounds of slice queries (_ask, with the bounds a
pair's pipelines must beat; every size's seed pipelines before any size's other pairs: _seed_every_size) each
followed by composing the size's answers so far (size_composition.compose_size)."""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Sequence

from tangram_launch.errors import SpecError
from tangram_launch.parallelizers.base import SliceQuery, SliceResult
from tangram_launch.planner.interleave import MAX_VIRTUAL_STAGES
from tangram_launch.planner.orders import fastest_first, island_orders
from tangram_launch.planner.pair_floors import PairFloors, PipelineReach
from tangram_launch.planner.size_composition import SearchContext, SearchState, complete_deferred, compose_size, \
    size_links
from tangram_launch.planner.size_floors import SizeFloor, front_s, least_links_at, outside_s, score_extra_s, size_floor
from tangram_launch.planner.slices import Pair

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import Island


# of the first size the full rounds visit, this share of its pairs (the lowest pair floors) is asked and composed
# first (up to exact_islands islands): its plan lets most of the others go unasked (figures: benchmarks/README.md)
FIRST_ROUND_SHARE = 0.25


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


def try_microbatches(bs: Sequence[int], ctx: SearchContext, state: SearchState) -> None:
    """Query and compose the micro-batch sizes ``bs``; the best plan so far (Incumbent) is ``state.best``.

    Branch and bound over the queries: (1) every b's single-island pairs (the whole model on one island: few
    queries, bounded by earlier rounds' best) are composed first, which gives an incumbent and an order of the
    sizes; (2) every size's seed pipelines (_seed_every_size), whose plans bound the rest and order the sizes again;
    (3) size by size, most promising first, the other pairs are asked with the closed-form latency to beat
    as their bound (SliceQuery.latency_bound_s): a slice plan whose own (m - 1) x bottleneck + stage times + tail
    exceeds it is part of no pipeline the composer would still consider, so the parallelizer skips it (the
    closed-form optimum, and so the plans scored against it, are those of the full search).
    """
    model, opts, pairset = ctx.model, ctx.opts, ctx.pairset
    L = model.num_layers
    state.deferred = []  # every size's complete passes wait for the best plan over all sizes (complete_deferred)
    whole = [p for p in pairset.queries if p.layers == (0, L)]
    reach = PipelineReach(pairset.pairs, L)
    reach.prune()  # a class no pipeline can hold is asked at no size
    rest = [p for p in pairset.queries if p.layers != (0, L) and reach.usable(p.key)]
    bnb = opts.branch_and_bound
    present = sorted({p.island for p in pairset.pairs})  # the islands a pipeline can use
    floors = {b: size_floor(b, model=model, training=ctx.training, islands=ctx.islands, caps=ctx.caps,
                            par=ctx.pool.parallelizer if bnb else None,
                            links=least_links_at(size_links(b, ctx.cluster, model, ctx.training, ctx.islands,
                                                            state.memo), present))
              for b in bs}
    first: list[tuple[float, float, int]] = []
    for b in sorted(bs, key=lambda b: (floors[b].latency_s, b)):  # most promising first: its plan bounds the rest
        state.results.setdefault(b, {})
        state.reach.setdefault(b, reach.copy())
        own_s = _visit(b, whole, floors[b], ctx, state, use_incumbent=False)  # orders the sizes below
        if own_s is not None:
            first.append((own_s, floors[b].latency_s, b))
    # above exact_islands a class's composition is a search over island sets or orders costing seconds, and the
    # first round's would be done again whole: there the queries the split saves cost less than that (the same
    # plans either way)
    split = len({p.island for p in rest}) <= opts.exact_islands
    order = _visit_order(first)
    seeded = _seed_every_size(order, rest, floors, ctx, state) if rest and bnb else {}
    done_first = False
    for b in _pipelined_order(order, seeded) if rest else ():
        seeds = seeded.get(b, (frozenset(), None))[0]
        left = [p for p in rest if p not in seeds]
        if bnb and split and not done_first and floors[b].pairs is not None:
            # the first size: (up to exact_islands islands) its most promising quarter of pairs (by their floors),
            # whose plan bounds the rest, most of which then need no query
            pf = floors[b].pairs
            ranked = sorted(range(len(left)), key=lambda i: (pf.floor(left[i].island, *left[i].layers)[0], i))
            head = set(ranked[:max(1, int(len(rest) * FIRST_ROUND_SHARE) - len(seeds))])
            _visit(b, [p for i, p in enumerate(left) if i in head], floors[b], ctx, state, use_incumbent=True)
            left = [p for i, p in enumerate(left) if i not in head]
        _visit(b, left, floors[b], ctx, state, use_incumbent=True)
        if not done_first and split:
            # (above exact_islands a complete pass searches island sets or orders: left for the best plan over
            # every size to bound, as the others)
            _complete_best_class(state)
        done_first = True
    complete_deferred(state)  # the complete passes, bounded by the best plan over every size


def _seed_every_size(order: Sequence[int], rest: Sequence[Pair], floors: dict[int, SizeFloor], ctx: SearchContext,
                     state: SearchState) -> dict[int, tuple[frozenset[Pair], float | None]]:
    """Before any size's full rounds, at every size (in ``order``) a few pipelines over the fastest islands, each
    island's layers in proportion to its speed (_seed_pairs): plans near each size's best, so the best of them
    bounds the first full round and ranks the sizes (_pipelined_order). Per size: the seed pairs asked and the
    size's best plan after them (None: none, or the size skipped)."""
    out: dict[int, tuple[frozenset[Pair], float | None]] = {}
    L = ctx.model.num_layers
    for b in order:
        pf = floors[b].pairs
        if pf is None:
            continue
        seed = _seed_pairs(rest, ctx.pairset.pairs, pf, _seed_orders(ctx.islands, sorted(pf.own), ctx.training.dtype),
                           L)
        if seed:
            own_s = _visit(b, seed, floors[b], ctx, state, use_incumbent=True)
            out[b] = (frozenset(seed), own_s)
    return out


def _pipelined_order(order: Sequence[int], seeded: dict[int, tuple[frozenset[Pair], float | None]]) -> list[int]:
    """The order of the full rounds: by the size's best plan after its seeds (a pipeline, where _visit_order's
    single-island plans are none), then ``order`` (_visit_order's; sorted() is stable). Order is for speed only:
    every size is visited or skipped by a safe floor whatever the order."""
    def key(b: int) -> float:
        own_s = seeded[b][1] if b in seeded else None
        return math.inf if own_s is None else own_s
    return sorted(order, key=key)


# sizes whose geometric means (_visit_order) are this close are a tie the single-island plans cannot split
ORDER_TIE = 0.01


def _visit_order(first: Sequence[tuple[float, float, int]]) -> list[int]:
    """The sizes of ``first`` ((own single-island plan, floor, b) each) in the order the pipelined rounds visit
    them, most promising first: by the geometric mean of the size's floor and its single-island plan (the best plan
    at b lies between them; a size whose floor is far below the others' can hold a pipeline beating them all).
    Means within ORDER_TIE of the first of a run of them are a tie (the single-island plan is no pipeline's
    estimate), visited lowest floor first: the floor bounds the pipelines, and the first size visited is the one
    split in rounds whose plan bounds every size after it. A heuristic for speed only: every size is visited (or
    skipped by a safe floor) whatever the order, and the plan does not depend on it
    (tests/test_c3_speed_more.py)."""
    ranked = sorted(first, key=lambda t: (t[0] * t[1], t[1], t[2]))
    out: list[int] = []
    i = 0
    while i < len(ranked):
        lead = ranked[i][0] * ranked[i][1]
        j = i + 1
        while j < len(ranked) and ranked[j][0] * ranked[j][1] <= lead * (1.0 + ORDER_TIE):
            j += 1
        out.extend(b for _own, _floor, b in sorted(ranked[i:j], key=lambda t: (t[1], t[2])))
        i = j
    return out


def _complete_best_class(state: SearchState) -> None:
    """The deferred complete passes of the best plan's class (its size and compatibility class), now: the plan they
    find is the exact score of that class, so the sizes visited after it are bounded by it. Exact at any time, as
    every complete pass bounded by a real plan; the other classes' passes stay deferred (costlier passes that the
    best plan over every size bounds best)."""
    best = state.best
    if best is not None and state.deferred:
        complete_deferred(state, lambda d: (d[0], d[1]) == (best.b, best.group))


def _bounds(ctx: SearchContext, state: SearchState) -> tuple[float, float]:
    """(closed form to beat: compose.ComposeStats.threshold_s, best predicted iteration); inf without B&B."""
    best = state.best
    if not ctx.opts.branch_and_bound or best is None:
        return math.inf, math.inf
    return state.cstats.threshold_s(best.latency_s, ctx.opts.score_band), best.latency_s


def _visit(b: int, pairs: Sequence[Pair], floor: SizeFloor, ctx: SearchContext, state: SearchState, *,
           use_incumbent: bool) -> float | None:
    """Ask size b's ``pairs`` and compose all of b's answers so far; b's own best, None if b was skipped."""
    bounds = _bounds(ctx, state)
    if floor.beyond(*bounds):
        state.counters["sizes_skipped"] += 1
        return None
    _ask(b, pairs, *bounds, floor, ctx, state)
    own_s = compose_size(b, ctx, state, use_incumbent=use_incumbent)
    state.size_best_s[b] = min(state.size_best_s.get(b, math.inf), own_s)
    return own_s


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


def _ask(b: int, pairs: Sequence[Pair], bound_s: float, score_s: float, floor: SizeFloor, ctx: SearchContext,
         state: SearchState) -> None:
    """Query every pair at size b (``floor``: b's SizeFloor, with its links) in the search's pool; answers go to
    results[b][pair.key]. A pair's query carries the
    closed-form bound less the least fill the rest of any pipeline holding it adds (outside_s), and the best
    predicted iteration less score_extra_s, per number of layers its plan's least stage may have
    (SliceQuery.score_bounds_s: a plan with stages of one layer cannot interleave, and pays the fill in front)."""
    reach = state.reach.get(b)
    if reach is None:
        _ask_wave(b, pairs, bound_s, score_s, floor, ctx, state, None)
        return
    for key, r in state.results[b].items():
        if not r.plans:
            reach.kill(key)
    # the slices at layer 0 first, then those at layer L: a pair whose every way to layer 0 or L passes a pair that
    # holds no plan goes unasked
    L = ctx.model.num_layers
    for wave in ([p for p in pairs if p.layers[0] == 0], [p for p in pairs if p.layers[0] > 0 and p.layers[1] == L],
                 [p for p in pairs if p.layers[0] > 0 and p.layers[1] < L]):
        _ask_wave(b, wave, bound_s, score_s, floor, ctx, state, reach)


def _ask_wave(b: int, pairs: Sequence[Pair], bound_s: float, score_s: float, floor: SizeFloor, ctx: SearchContext,
              state: SearchState, reach: PipelineReach | None) -> None:
    """_ask's queries of ``pairs`` in one batch; a pair that ``reach`` (the size's PipelineReach) shows in no
    pipeline of live pairs, or whose pair floors cannot beat the bounds, is answered "bounded" without a query, and
    a class whose answer holds no plan is killed in ``reach``."""
    model, training, islands, caps = ctx.model, ctx.training, ctx.islands, ctx.caps
    results, counters = state.results, state.counters
    L = model.num_layers
    queries: list[SliceQuery] = []
    where: list[Pair] = []
    into, out_of = floor.links
    dead: list[tuple] = []  # killed in ``reach`` after the loop (a kill makes the next usable() read every island)
    for p in pairs:
        if (reach is not None and not reach.usable(p.key)) or \
                (floor.pairs is not None and floor.pairs.beyond(p.island, *p.layers, bound_s, score_s)):
            # part of no pipeline that could beat the bounds: answered "bounded" without a query
            results[b][p.key] = _merge(results[b].get(p.key), SliceResult((*p.key, b), (), None, bounded=1))
            dead.append(p.key)
            counters["pairs_skipped"] += 1
            continue
        outside = outside_s(floor, p, into, out_of, L)
        front = front_s(floor, p, into)
        n = p.layers[1] - p.layers[0]
        queries.append(SliceQuery(model=model, training=training, layers=p.layers, island=islands[p.island],
                                  microbatch_sequences=b, capabilities=caps, max_stages=caps.max_stages,
                                  pipelined=p.layers != (0, L), latency_bound_s=bound_s - outside,
                                  score_bound_s=score_s - score_extra_s(front, outside, n),
                                  score_bounds_s=tuple(score_s - score_extra_s(front, outside, i)
                                                       for i in range(min(n, MAX_VIRTUAL_STAGES)))))
        where.append(p)
    if queries:
        _run(b, queries, where, ctx, state, dead)
    if reach is not None:
        for key in dead:
            reach.kill(key)


def _run(b: int, queries: Sequence[SliceQuery], where: Sequence[Pair], ctx: SearchContext, state: SearchState,
         dead: list[tuple]) -> None:
    """Answer ``queries`` (of the pairs ``where``) in the pool into results[b]; the keys of answers without a plan
    go to ``dead``."""
    results, counters = state.results, state.counters
    t_q = time.perf_counter()
    answers = ctx.pool.run(queries)
    counters["query_s"] += time.perf_counter() - t_q
    counters["queries"] += len(queries)
    for p, r in zip(where, answers):
        results[b][p.key] = _merge(results[b].get(p.key), r)
        if not results[b][p.key].plans:
            dead.append(p.key)
    counters["configs"] += sum(r.configs_evaluated for r in answers)
    counters["bounded"] += sum(r.bounded for r in answers)


def _merge(old: SliceResult | None, new: SliceResult) -> SliceResult:
    """Without redundancy pruning several pairs share a key; their plans are the same up to a shift, keep one."""
    return new if old is None or (not old.plans and new.plans) else old
