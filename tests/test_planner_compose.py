"""The composition DP (planner/compose.py) against the brute-force reference on seeded random instances."""
from __future__ import annotations

import functools
import math
import random

import pytest

from tangram_launch.costmodel.pipeline import pipeline_latency_s as pipeline_latency
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.interleaved_schedule import FLOOR_ROUNDING, interleaved_floor_s
from tangram_launch.costmodel.pipeline import simulated_1f1b_s
from tangram_launch.costmodel.plain_1f1b_paths import path_floor_1f1b_s
from tangram_launch.planner.bounds import plain_1f1b_floor_s
from tangram_launch.planner.compose import ComposeStats, Option, compose, evaluate
from tangram_launch.planner.dominance import covered_rooms
from tangram_launch.planner.plain_complete import behind_path_s, own_stages_s
from tangram_launch.planner.front_classes import front_classes, merged_states
from tangram_launch.planner.reference import brute_force, every_composition

from helpers_compose import scheduled, simulated, stage_seconds, with_bottleneck

SENTINEL = 1 << 30


def random_instance(rng: random.Random, *, max_layers: int = 8, max_islands: int = 3):
    L = rng.randint(1, max_layers)
    K = rng.randint(1, max_islands)
    m = rng.choice([1, 2, 3, 4, 8, 32])
    options = []
    for a in range(L):
        for b in range(a + 1, L + 1):
            for k in range(K):
                for _ in range(rng.choice([0, 1, 1, 2, 3])):
                    ns = rng.choice([1, 1, 2, 3])
                    bn = rng.uniform(0.1, 2.0) * (b - a) / ns
                    t = bn * rng.uniform(1.0, ns)
                    max_after = rng.choice([-1, 0, 1, 2, 3, 5, SENTINEL])
                    tail = rng.choice([0.0, rng.uniform(0, 3)])
                    options.append(Option(a, b, k, ns, max_after, t, bn, tail))
    link = [[0.0 if i == j else rng.choice([0.0, rng.uniform(0, 1.5)]) for j in range(K)] for i in range(K)]
    return options, link, L, m, K


def _check_plan(result, options, link, L, m, *, required=0, max_stages=None):
    """A composition is a contiguous cover of [0, L) with distinct islands that fits, and its latency is right."""
    seq = result.options
    assert options[seq[0]].start == 0 and options[seq[-1]].stop == L
    for a, b in zip(seq, seq[1:]):
        assert options[a].stop == options[b].start
    islands = [options[i].island for i in seq]
    assert len(set(islands)) == len(islands)
    assert all(required >> k & 1 == 0 or k in islands for k in range(8))
    if max_stages is not None:
        assert sum(options[i].num_stages for i in seq) <= max_stages
    metrics = evaluate(seq, options, link, m)
    assert metrics is not None
    assert result.latency_s == pytest.approx(metrics.latency_s)
    assert metrics.latency_s == pytest.approx(pipeline_latency(m, metrics.period_s, metrics.fill_s, metrics.tail_s))


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_brute_force_on_random_instances(seed):
    rng = random.Random(1000 + seed)
    checked = feasible = 0
    for _ in range(150):
        options, link, L, m, K = random_instance(rng)
        required = rng.choice([0, 0, 0, 1 << rng.randrange(K)])
        max_stages = rng.choice([None, None, 2, 4])
        dp = compose(options, link, L, m, required_mask=required, max_stages=max_stages)
        ref = brute_force(options, link, L, m, required_mask=required, max_stages=max_stages)
        checked += 1
        assert (dp is None) == (ref is None), (seed, L, m, K)
        if ref is not None:
            feasible += 1
            assert dp.latency_s == pytest.approx(ref.latency_s, rel=1e-12, abs=1e-12)
            _check_plan(dp, options, link, L, m, required=required, max_stages=max_stages)
    assert feasible > checked // 4  # the instances are not trivially infeasible


def test_incumbent_prunes_without_changing_the_optimum():
    rng = random.Random(7)
    for _ in range(200):
        options, link, L, m, K = random_instance(rng)
        ref = brute_force(options, link, L, m)
        if ref is None:
            continue
        # an incumbent slower than the optimum: the optimum is still found
        above = compose(options, link, L, m, incumbent_s=ref.latency_s * 1.5 + 1)
        assert above is not None and above.latency_s == pytest.approx(ref.latency_s)
        # an incumbent at least as fast: nothing beats it, so None
        assert compose(options, link, L, m, incumbent_s=ref.latency_s) is None


def test_bound_step_is_never_better_than_exact_and_close():
    rng = random.Random(11)
    for _ in range(200):
        options, link, L, m, K = random_instance(rng)
        exact = compose(options, link, L, m)
        if exact is None:
            continue
        approx = compose(options, link, L, m, bound_step=0.05)
        assert approx is not None
        assert approx.latency_s >= exact.latency_s - 1e-12
        # skipping bounds within 5 % costs at most (m - 1) x 5 % of the period
        assert approx.latency_s <= exact.latency_s + (m - 1) * 0.05 * approx.metrics.period_s + 1e-9


def test_memory_position_makes_a_deep_pipeline_infeasible():
    # island 0's option fits only with at most 1 following stage; island 1's slices would add 2
    opts = [Option(0, 1, 0, 1, 1, 1.0, 1.0, 0.0), Option(1, 3, 1, 2, SENTINEL, 1.0, 0.5, 0.0)]
    assert compose(opts, [[0, 0], [0, 0]], 3, 8) is None
    assert brute_force(opts, [[0, 0], [0, 0]], 3, 8) is None
    # ... unless memory saturates earlier: with m = 2 micro-batches, 1 following stage already holds the most
    ok = compose(opts, [[0, 0], [0, 0]], 3, 2)
    assert ok is not None and ok.options == (0, 1)


def test_relaxation_picks_a_slower_bottleneck_when_the_fill_pays_for_it():
    # A: one stage of 1.0 s on island 0 (fill 1.0). B: two slices on two islands with bottleneck 0.6 but a slow
    # link (0.5 s each way). With m = 1 the fill decides (A); with m = 64 the period decides (B).
    opts = [Option(0, 2, 0, 1, SENTINEL, 1.0, 1.0, 0.0),
            Option(0, 1, 0, 1, SENTINEL, 0.6, 0.6, 0.0), Option(1, 2, 1, 1, SENTINEL, 0.6, 0.6, 0.0)]
    link = [[0.0, 0.5], [0.5, 0.0]]
    one = compose(opts, link, 2, 1)
    assert one.options == (0,) and one.latency_s == pytest.approx(1.0)
    many = compose(opts, link, 2, 64)
    assert many.options == (1, 2)
    assert many.latency_s == pytest.approx(63 * 0.6 + 1.2 + 2 * 0.5)
    stats = ComposeStats()
    compose(opts, link, 2, 64, stats=stats)
    assert stats.trace and all(b >= 0.6 for b, _ in stats.trace)  # no bound below the least period was tried


def test_link_slower_than_every_stage_is_the_period():
    opts = [Option(0, 1, 0, 1, SENTINEL, 0.1, 0.1, 0.0), Option(1, 2, 1, 1, SENTINEL, 0.1, 0.1, 0.0)]
    link = [[0.0, 0.3], [0.3, 0.0]]
    r = compose(opts, link, 2, 10)
    assert r.metrics.period_s == pytest.approx(0.3)
    assert r.latency_s == pytest.approx(9 * 0.3 + 0.2 + 0.6)


def test_each_island_at_most_once():
    # the only cover of 2 layers uses island 0 twice: infeasible
    opts = [Option(0, 1, 0, 1, SENTINEL, 1.0, 1.0, 0.0), Option(1, 2, 0, 1, SENTINEL, 1.0, 1.0, 0.0)]
    assert compose(opts, [[0.0]], 2, 4) is None
    assert brute_force(opts, [[0.0]], 2, 4) is None


@pytest.mark.slow  # a brute force over every split (about a second)
def test_ordered_mode_matches_brute_force_over_that_order():
    rng = random.Random(23)
    for _ in range(400):
        options, link, L, m, K = random_instance(rng)
        order = list(range(K))
        rng.shuffle(order)
        required = rng.choice([0, 0, 1 << rng.randrange(K)])
        dp = compose(options, link, L, m, island_order=order, required_mask=required)
        ref = brute_force(options, link, L, m, island_order=order, required_mask=required)
        assert (dp is None) == (ref is None)
        if ref is not None:
            assert dp.latency_s == pytest.approx(ref.latency_s)
            islands = [options[i].island for i in dp.options]
            assert islands == sorted(islands, key=order.index)
            # an order restricts the search: never better than the exact search over all orders
            assert dp.latency_s >= compose(options, link, L, m, required_mask=required).latency_s - 1e-12


def test_greedy_link_chains_find_a_single_fast_chain():
    from tangram_launch.planner.orders import link_chains

    perm = [3, 0, 5, 1, 4, 2]
    link = [[0.0 if i == j else 5.0 for j in range(6)] for i in range(6)]
    for x, y in zip(perm, perm[1:]):
        link[x][y] = link[y][x] = 0.01
    chains = link_chains(range(6), link)
    assert perm in chains and perm[::-1] in chains


@pytest.mark.parametrize("seed", range(4))
def test_order_search_is_within_five_percent_of_the_exact_search(seed):
    """Six islands, one fast chain or random links: the bounded order search (planner/orders.py) against the
    exact composer."""
    from tangram_launch.planner.orders import search_orders

    rng = random.Random(seed)
    K, L, m = 6, 6, 8
    speed = [rng.uniform(0.3, 1.5) for _ in range(K)]
    options = [Option(a, b, k, 1, rng.choice([1, 3, SENTINEL]), speed[k] * (b - a) * 1.05, speed[k] * (b - a),
                      rng.uniform(0, 0.2)) for a in range(L) for b in range(a + 1, L + 1) for k in range(K)]
    if seed % 2:
        link = [[0.0 if i == j else rng.uniform(0, 1.0) for j in range(K)] for i in range(K)]
    else:
        perm = rng.sample(range(K), K)
        link = [[0.0 if i == j else 3.0 for j in range(K)] for i in range(K)]
        for x, y in zip(perm, perm[1:]):
            link[x][y] = link[y][x] = 0.01
    exact = compose(options, link, L, m)
    best = [float("inf")]

    def run(order):
        comp = compose(options, link, L, m, island_order=order, incumbent_s=best[0])
        if comp is not None:
            best[0] = comp.latency_s
            return comp.latency_s
        return None

    order, tried = search_orders(run, list(range(K)), link)
    assert order is not None and tried >= K
    assert exact.latency_s <= best[0] <= exact.latency_s * 1.05


# --- ranking by a score (the simulated 1F1B the Plan reports) ------------------------------------------------------

def test_score_ranks_two_plans_the_closed_form_ranks_the_other_way():
    # A: islands 0 -> 1, one stage each of 1.0 s, a 0.2 s link: the closed form's period is 1.0, but in 1F1B stage
    # 0's backward waits for the round trip to stage 1, so the steady state takes (1.0 + 1.0) / 2 + 0.2 per
    # micro-batch. B: the whole model on island 2, 1.25 s. m = 8: closed form A 9.4 < B 10.0; simulated B < A.
    opts = [Option(0, 1, 0, 1, SENTINEL, 1.0, 1.0, 0.0), Option(1, 2, 1, 1, SENTINEL, 1.0, 1.0, 0.0),
            Option(0, 2, 2, 1, SENTINEL, 1.25, 1.25, 0.0)]
    link = [[0.0, 0.2, 0.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0]]
    m = 8
    score = simulated(opts, link, m)
    by_formula = compose(opts, link, 2, m)
    assert by_formula.options == (0, 1) and by_formula.latency_s == pytest.approx(7 * 1.0 + 2.0 + 0.4)
    a = score((0, 1), evaluate((0, 1), opts, link, m))
    b = score((2,), evaluate((2,), opts, link, m))
    assert b == pytest.approx(10.0) and a > b  # the premise: the simulation ranks them the other way
    stats = ComposeStats()
    by_score = compose(opts, link, 2, m, score=score, stats=stats)
    assert by_score.options == (2,) and by_score.score_s == pytest.approx(b)
    assert {c.options for c in stats.scored} >= {(0, 1), (2,)}  # both were candidates
    # with the band an incumbent is a score: nothing here beats 10.0 s
    assert compose(opts, link, 2, m, score=score, incumbent_s=b, score_band=True) is None
    banded = compose(opts, link, 2, m, score=score, score_band=True)
    assert banded.options == (2,)


@pytest.mark.parametrize("band", [False, True], ids=["closed-form-search", "score-band"])
@pytest.mark.parametrize("seed", range(3))
def test_the_chosen_plan_has_the_least_score_of_every_candidate(seed, band):
    rng = random.Random(500 + seed)
    for _ in range(120):
        options, link, L, m, K = random_instance(rng)
        score = simulated(options, link, m)
        stats = ComposeStats()
        got = compose(options, link, L, m, score=score, stats=stats, score_band=band)
        if got is None:
            assert compose(options, link, L, m) is None  # the score prunes nothing the formula would find
            continue
        _check_plan(got, options, link, L, m)
        assert got.score_s == pytest.approx(score(got.options, got.metrics))  # its score is its own
        assert all(got.score_s <= c.score_s for c in stats.scored)
        # the closed form's optimum (the plan chosen before scores) is always a candidate: never a worse score
        exact = brute_force(options, link, L, m)
        assert exact is not None
        assert got.score_s <= score(exact.options, exact.metrics) + 1e-9


@pytest.mark.parametrize("band", [False, True], ids=["closed-form-search", "score-band"])
def test_a_score_below_the_closed_form_still_keeps_the_closed_form_optimum(band):
    # interleaving can put a plan's reported iteration well below its plain closed form; a score that scales each
    # plan's closed form by its own factor in [0.5, 1.2] must still never lose to the closed form's optimum
    rng = random.Random(77)
    for _ in range(150):
        options, link, L, m, K = random_instance(rng)
        factor = {}

        def score(seq, metrics):
            return metrics.latency_s * factor.setdefault(seq, rng.uniform(0.5, 1.2))
        stats = ComposeStats()
        got = compose(options, link, L, m, score=score, stats=stats, score_band=band)
        exact = brute_force(options, link, L, m)
        assert (got is None) == (exact is None)
        if exact is None:
            continue
        assert all(got.score_s <= c.score_s for c in stats.scored)
        assert any(c.latency_s == pytest.approx(exact.latency_s, rel=1e-12) for c in stats.scored)  # was scored
        assert got.score_s <= score(exact.options, exact.metrics) + 1e-9


def _least_score(options, link, L, m, score, **kw) -> float:
    """The least score of every composition (reference.every_composition; inf where there is none)."""
    return min((score(c.options, c.metrics) for c in every_composition(options, link, L, m, **kw)), default=math.inf)


@pytest.mark.parametrize("seed", range(4))
def test_an_interleaved_only_score_with_its_fill_weight_finds_the_least_score(seed):
    """A one-grid class under torch scores only interleaved schedules (2..V chunks per stage: their event
    simulation, helpers_compose.scheduled); the DP then prunes by its floor with fill weight 1/V (a stage after
    1/V of the fill in front of it, interleaved_floor_s) and the candidates by interleaved_floor_s's least over v:
    neither floor lies above any composition's score, and the plan returned has the least score of every
    composition (brute force). The simulation needs the stages to divide the micro-batches and reads each stage's
    time, so it can rank first a sequence the DP's dominance in fill, tail, stages behind and period drops, or one
    whose closed form is far from the best (seed 900 held one at 6.93 s where the dominance pass found 33.39 s)."""
    rng = random.Random(900 + seed)
    V = 4
    checked = 0
    for _ in range(100):
        options, link, L, m, K = random_instance(rng, max_layers=6)
        score = scheduled(options, link, m, schedules=("interleaved",), most_chunks=V)

        def floor(seq, metrics):
            times = stage_seconds(options, link, seq, with_bottleneck)
            return min(interleaved_floor_s(*times, m, v) for v in range(2, V + 1)) + metrics.tail_s
        every = [(c.options, c.metrics) for c in every_composition(options, link, L, m)]
        got = compose(options, link, L, m, score=score, score_floor=floor, score_fill_weight=1.0 / V,
                      score_schedules=("interleaved",))
        assert all(floor(seq, met) <= score(seq, met) for seq, met in every)
        assert all(_dp_floor_s(seq, met, options, link, m, 1.0 / V) <= score(seq, met) for seq, met in every)
        least = min((score(seq, met) for seq, met in every), default=math.inf)
        if least == math.inf:  # no pipeline of it can interleave
            continue
        checked += 1
        _check_plan(got, options, link, L, m)
        assert got.score_s == pytest.approx(least, rel=1e-12)
    assert checked > 40


def _dp_floor_s(seq, metrics, options, link, m, w) -> float:
    """The DP's score floor of a whole sequence (bounds.score_floor_terms) with fill weight w, raised per option
    of n layers in s stages to 1 / (n // s) (a chunk holds a layer): the largest of m x the slowest stage, the
    fill, and per option m x its slowest stage + its weight x the fill in front of it; + the tail."""
    out, front = max(metrics.fill_s, m * max(options[oi].bottleneck_s for oi in seq)), 0.0
    for n, oi in enumerate(seq):
        o = options[oi]
        q = (o.stop - o.start) // o.num_stages
        wo = 1.0 / q if q >= 2 and q * w < 1.0 else w
        if n:
            front += 2.0 * link[options[seq[n - 1]].island][o.island]
        out = max(out, m * o.bottleneck_s + wo * front)
        front += o.time_s
    return (out + metrics.tail_s) * (1.0 - FLOOR_ROUNDING)  # (compose prunes only that far above a floor)


@pytest.mark.parametrize("seed", range(2))
def test_the_plain_1f1b_floor_is_under_the_simulation_and_prunes_nothing_that_wins(seed):
    """plain_1f1b_floor_s lies under the plain 1F1B simulation of every composition; compose with
    score_schedules=("plain",) (the DP prunes by that floor) returns the plan of the same score as with the
    default floor (m x period + tail), never worse than the closed form's optimum."""
    rng = random.Random(950 + seed)
    for _ in range(100):
        options, link, L, m, K = random_instance(rng, max_layers=6)
        score = simulated(options, link, m, with_bottleneck)
        every = every_composition(options, link, L, m)
        for c in every:
            assert plain_1f1b_floor_s(c.options, options, link, m, c.metrics.tail_s) <= \
                score(c.options, c.metrics) + 1e-9
        stats = ComposeStats()
        got = compose(options, link, L, m, score=score, stats=stats, score_schedules=("plain",),
                      score_floor=lambda seq, met: plain_1f1b_floor_s(seq, options, link, m, met.tail_s))
        assert (got is None) == (not every)
        if got is None:
            continue
        _check_plan(got, options, link, L, m)
        default = compose(options, link, L, m, score=score)
        assert got.score_s == pytest.approx(default.score_s, rel=1e-12)
        exact = brute_force(options, link, L, m)  # the closed form's optimum: never a worse score
        assert got.score_s <= score(exact.options, exact.metrics) + 1e-9


@pytest.mark.parametrize("seed", range(3))
def test_each_option_caps_the_chunks_of_any_pipeline_holding_it(seed):
    """Under "auto" (plain 1F1B and interleaved with v <= min(8, the fewest layers of a stage) chunks, where the
    stages divide the micro-batches), a pipeline holding an option of n layers in s stages interleaves in at most
    n // s chunks, and not at all below 2: the DP prunes each entry by that option's own cap (1 / (n // s) as the
    fill weight, or the plain floor alone), and loses nothing to the search under the default floor (m x period +
    tail, under any score) nor to the plain-only search, and scores no more than any composition's interleaved
    schedules (brute force). Stage counts above the layers, and layers per stage from 0 to 8, are drawn on
    purpose."""
    rng = random.Random(1300 + seed)
    V = 8
    checked = 0
    for _ in range(120):
        options, link, L, m, K = random_instance(rng, max_layers=8)
        score = scheduled(options, link, m, most_chunks=V)
        got = compose(options, link, L, m, score=score, score_schedules=("plain", "interleaved"),
                      score_fill_weight=1.0 / V)
        default = compose(options, link, L, m, score=score)
        assert (got is None) == (default is None)
        if got is None:
            continue
        checked += 1
        _check_plan(got, options, link, L, m)
        assert got.score_s <= default.score_s * (1.0 + 1e-12)
        interleaved = scheduled(options, link, m, schedules=("interleaved",), most_chunks=V)
        assert got.score_s <= _least_score(options, link, L, m, interleaved) * (1.0 + 1e-12)
        plain = scheduled(options, link, m, schedules=("plain",), most_chunks=V)
        plain_only = compose(options, link, L, m, score=plain, score_schedules=("plain",))
        assert got.score_s <= plain_only.score_s * (1.0 + 1e-12)
    assert checked > 60


def _restrictions(rng: random.Random, K: int, p: float) -> dict:
    """compose's restrictions, each drawn with probability p: a stage cap, a required island, an island order."""
    kw = {}
    if rng.random() < p:
        kw["max_stages"] = rng.randint(1, 6)
    if rng.random() < p and K > 1:
        kw["required_mask"] = 1 << rng.randrange(K)
    if rng.random() < p:
        kw["island_order"] = rng.sample(range(K), K)
    return kw


@pytest.mark.parametrize("seed", range(2))
def test_interleaved_scores_are_exact_under_every_search_setting(seed):
    """Where the score interleaves (alone, or as the least of plain and interleaved), compose's plan scores no more
    than any interleaved schedule of every composition the same restrictions admit (alone: the least score of
    every composition), under required islands, a stage cap, an island order, the score band and a best score
    found elsewhere, on up to 4 islands and 8 layers; a plain-only score and an interleaved one both add the
    complete pass to the quick plan and the exact pass (plain_complete.py), but not with merged fronts (the
    driver's search over many islands, where it would enumerate every island set's sequences)."""
    rng = random.Random(4100 + seed)
    checked = 0
    for _ in range(150):
        options, link, L, m, K = random_instance(rng, max_layers=rng.choice([6, 8]), max_islands=rng.choice([3, 4]))
        V = rng.choice([2, 4, 8])
        schedules = rng.choice([("interleaved",), ("plain", "interleaved")])
        score = scheduled(options, link, m, schedules=schedules, most_chunks=V)
        kw = _restrictions(rng, K, 0.3)
        interleaved = scheduled(options, link, m, schedules=("interleaved",), most_chunks=V)
        least = _least_score(options, link, L, m, interleaved, **kw)  # the score's, where it only interleaves
        search = dict(kw, score_band=rng.random() < 0.3)
        if rng.random() < 0.3 and least < math.inf:
            search["score_incumbent_s"] = least * rng.uniform(1.0, 1.5)
        stats = ComposeStats()
        got = compose(options, link, L, m, score=score, score_fill_weight=1.0 / V, score_schedules=schedules,
                      stats=stats, **search)
        assert stats.dp_runs <= 3
        if least == math.inf or (got is None and least >= search.get("score_incumbent_s", math.inf)):
            continue
        checked += 1
        _check_plan(got, options, link, L, m, required=kw.get("required_mask", 0), max_stages=kw.get("max_stages"))
        assert got.score_s <= least * (1.0 + 1e-12)
        if schedules == ("interleaved",):
            assert got.score_s == pytest.approx(least, rel=1e-12)
        plain = ComposeStats()
        compose(options, link, L, m, score=simulated(options, link, m, with_bottleneck), score_schedules=("plain",),
                stats=plain, **kw)
        assert plain.dp_runs <= 3
        merged = ComposeStats()
        compose(options, link, L, m, score=score, score_fill_weight=1.0 / V, score_schedules=schedules,
                stats=merged, merge_fronts=True, **kw)
        assert merged.dp_runs <= 2
    assert checked > 60


def test_score_equal_to_the_closed_form_keeps_the_search_exact():
    rng = random.Random(41)
    for _ in range(150):
        options, link, L, m, K = random_instance(rng)
        ref = brute_force(options, link, L, m)
        got = compose(options, link, L, m, score=lambda seq, met: met.latency_s)
        assert (got is None) == (ref is None)
        if ref is not None:
            assert got.score_s == pytest.approx(ref.latency_s, rel=1e-12, abs=1e-12)


def test_a_shared_stats_object_answers_as_fresh_ones_across_orders_and_sets():
    """compose keeps an option set's preparation in its ComposeStats for the next call on the same set (the
    island-order search composes one set in many orders): calls that share one stats object, over several orders,
    sets, required islands and micro-batch counts, answer exactly what calls with fresh stats do."""
    rng = random.Random(41)
    shared = ComposeStats()
    for _ in range(60):
        options, link, L, m, K = random_instance(rng)
        for _ in range(4):
            order = list(range(K))
            rng.shuffle(order)
            kw = dict(island_order=rng.choice([None, order]), required_mask=rng.choice([0, 1 << rng.randrange(K)]))
            mm = rng.choice([m, m + 3])
            got = compose(options, link, L, mm, stats=shared, **kw)
            want = compose(options, link, L, mm, stats=ComposeStats(), **kw)
            assert (got is None) == (want is None)
            if want is not None:
                assert (got.options, got.latency_s) == (want.options, want.latency_s)


def test_a_class_whose_closed_form_cannot_beat_is_still_searched_when_its_score_can():
    """compose's early exit (no DP run when the closed-form floor cannot beat ``incumbent_s``) holds only while the
    score cannot beat the best score either: an interleaved schedule scores a plan well below its closed form,
    down to m x period + tail (with ever more chunks per stage)."""
    opts = [Option(0, 1, 0, 1, SENTINEL, 1.0, 1.0, 0.0), Option(1, 2, 1, 1, SENTINEL, 1.0, 1.0, 0.0)]
    link = [[0.0, 0.0], [0.0, 0.0]]
    m = 8  # closed form (m - 1) x 1 + 2 = 9 s; the score m x 1 = 8 s

    def score(seq, met):
        return m * met.period_s + met.tail_s
    got = compose(opts, link, 2, m, incumbent_s=5.0, score=score, score_incumbent_s=8.5)
    assert got is not None and got.score_s == pytest.approx(8.0)
    # nor the best score: nothing to search
    assert compose(opts, link, 2, m, incumbent_s=5.0, score=score, score_incumbent_s=7.5) is None


def _few_class_links(rng: random.Random, K: int) -> list[list[float]]:
    """Links with few distinct values, so front islands often share a class (compose.front_classes): one spine,
    two pods, or random values from a short list."""
    kind = rng.choice(["spine", "pods", "few"])
    pod = [rng.randrange(2) for _ in range(K)]
    near, far = rng.uniform(0, 0.5), rng.uniform(0.5, 1.5)
    out = []
    for i in range(K):
        row = []
        for j in range(K):
            if i == j:
                row.append(0.0)
            elif kind == "spine":
                row.append(far)
            elif kind == "pods":
                row.append(near if pod[i] == pod[j] else far)
            else:
                row.append(rng.choice([near, far]))
        out.append(row)
    return out


@given(st.integers(1, 7), st.integers(0, 2 ** 32 - 1))
@settings(max_examples=200, deadline=None)
def test_front_classes_are_islands_with_the_same_links_from_every_other_island(K, seed):
    rng = random.Random(seed)
    link = _few_class_links(rng, K)
    mask = rng.randrange(1, 1 << K)
    cls = front_classes(link, mask)
    members = [k for k in range(K) if mask >> k & 1]
    for f in members:
        assert cls[f] in members and cls[cls[f]] == cls[f]  # a class stands for itself
        for g in members:
            if cls[f] == cls[g]:
                assert all(link[x][f] == link[x][g] for x in members if x not in (f, g)), (link, f, g)
    if all(link[i][j] == link[0][1] for i in range(K) for j in range(K) if i != j) and K > 1:
        assert len({cls[k] for k in members}) == 1  # one spine: one class
        assert merged_states(link, members) == (1 << len(members)) - 1
    # merged keys never exceed the unmerged ones (each set times its islands)
    assert merged_states(link, members) <= len(members) << max(0, len(members) - 1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1] + [pytest.param(s, marks=pytest.mark.slow) for s in (2, 3)])  # ~1 s a seed
def test_merged_fronts_find_the_brute_force_optimum(seed):
    """merge_fronts shares DP states between front islands of one link class: the closed form's optimum is the
    brute force's, on links with few classes (where states merge) and on random ones."""
    rng = random.Random(7000 + seed)
    merged = 0
    for _ in range(120):
        options, link, L, m, K = random_instance(rng, max_islands=4)
        if rng.random() < 0.8:
            link = _few_class_links(rng, K)
        required = rng.choice([0, 0, 1 << rng.randrange(K)])
        max_stages = rng.choice([None, None, 3])
        dp = compose(options, link, L, m, required_mask=required, max_stages=max_stages, merge_fronts=True)
        ref = brute_force(options, link, L, m, required_mask=required, max_stages=max_stages)
        assert (dp is None) == (ref is None)
        if ref is not None:
            assert dp.latency_s == pytest.approx(ref.latency_s, rel=1e-12, abs=1e-12)
            _check_plan(dp, options, link, L, m, required=required, max_stages=max_stages)
            merged += len({c for c in front_classes(link, (1 << K) - 1)}) < K
    assert merged > 20  # the instances do merge fronts


@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in (1, 2)])  # 1-2 s a seed
def test_without_the_quick_plan_the_exact_pass_alone_finds_the_optimum(seed):
    """quick_plan=False (the driver's merged pass after a seed order): one DP pass instead of two, and the plan is
    still the brute force's optimum, with merged fronts or without, and under an incumbent."""
    rng = random.Random(7500 + seed)
    feasible = 0
    for _ in range(100):
        options, link, L, m, K = random_instance(rng, max_islands=4)
        merge = rng.random() < 0.5
        ref = brute_force(options, link, L, m)
        with_quick, without = ComposeStats(), ComposeStats()
        a = compose(options, link, L, m, merge_fronts=merge, stats=with_quick)
        b = compose(options, link, L, m, merge_fronts=merge, stats=without, quick_plan=False)
        assert (b is None) == (ref is None)
        if ref is None:
            continue
        feasible += 1
        assert b.latency_s == pytest.approx(ref.latency_s, rel=1e-12, abs=1e-12) == a.latency_s
        _check_plan(b, options, link, L, m)
        assert without.dp_runs == with_quick.dp_runs - 1 == 1
        above = compose(options, link, L, m, incumbent_s=ref.latency_s * 1.5 + 1, quick_plan=False)
        assert above is not None and above.latency_s == pytest.approx(ref.latency_s, rel=1e-12, abs=1e-12)
    assert feasible > 25


def _memory_variants(rng: random.Random):
    """Instances whose layers and island hold a fast option that fits only near the back and leaner, slower ones
    that fit further forward (recompute, ZeRO), as real slice plans do."""
    L, K = rng.randint(2, 7), rng.randint(1, 3)
    m = rng.choice([2, 4, 8, 32])
    options = []
    for a in range(L):
        for b in range(a + 1, L + 1):
            for k in range(K):
                ns = rng.choice([1, 2])
                bn = rng.uniform(0.2, 1.0) * (b - a) / ns
                tail = rng.uniform(0, 1)
                room = rng.choice([0, 1, 2])
                for v in range(rng.randint(1, 3)):
                    slow = 1.0 + v * rng.uniform(0.0, 0.4)  # v = 0: the fast one; ties (slow = 1) happen
                    options.append(Option(a, b, k, ns, room + 2 * v if v < 2 else SENTINEL, bn * ns * slow,
                                          bn * slow, tail * rng.choice([1.0, slow])))
    rng.shuffle(options)
    link = [[0.0 if i == j else rng.uniform(0, 0.5) for j in range(K)] for i in range(K)]
    return options, link, L, m


@pytest.mark.parametrize("seed", range(4))
def test_options_an_earlier_option_covers_change_no_dp_state(seed, monkeypatch):
    """dominance.covered_rooms lets the DP skip an option in front of the entries that an earlier option of the
    same layers and island, no worse in time, tail, stages and bottleneck, fits: on instances full of such memory
    variants, the DP keeps the same fronts (same states), offers the same candidates and returns the same plan as
    without the skip, and that plan is the brute-force optimum."""
    import tangram_launch.planner.compose as kernel

    rng = random.Random(7000 + seed)
    skipped_somewhere = False
    for _ in range(40):
        options, link, L, m = _memory_variants(rng)
        runs = []
        for skip in (True, False):
            if not skip:
                monkeypatch.setattr(kernel, "covered_rooms", lambda opts, order: [-1] * len(order))
            st_ = ComposeStats()
            comp = compose(options, link, L, m, stats=st_, score=lambda seq, met: met.latency_s * 0.97,
                           score_schedules=("plain",))
            runs.append((comp and comp.options, st_.states, st_.trace, st_.candidates))
            monkeypatch.undo()
        assert runs[0] == runs[1]
        ref = brute_force(options, link, L, m)
        plain = compose(options, link, L, m)
        assert (plain is None) == (ref is None)
        if ref is not None:
            assert plain.latency_s == pytest.approx(ref.latency_s, rel=1e-12, abs=1e-12)
        prep = kernel._prepare(options, link, L, m - 1, (1 << 3) - 1, None)
        if prep is not None:
            for _island, _bit, group in (g for groups in prep[1] for g in groups):
                skipped_somewhere |= any(r >= 0 for r in covered_rooms(options, group))
    assert skipped_somewhere


@pytest.mark.parametrize("seed", range(3))
def test_options_a_groups_score_floor_rules_out_change_no_dp_state(seed, monkeypatch):
    """compose._hopeful drops, per option group and set of islands free in front, the options whose m x slowest
    stage + tail cannot beat the best score: with and without it the DP keeps the same states, offers and scores
    the same candidates in the same order and returns the same plan (plain, and plain or interleaved with its
    complete pass), and it drops some."""
    import tangram_launch.planner.compose as kernel

    rng = random.Random(7300 + seed)
    real, dropped = kernel._hopeful, [0]

    def counting(run, key, gidx, covered, group):
        kept = real(run, key, gidx, covered, group)
        dropped[0] += len(gidx) - len(kept[0])
        return kept

    for _ in range(40):
        options, link, L, m, _K = random_instance(rng, max_layers=8)
        score = scheduled(options, link, m, most_chunks=8)
        for schedules, weight in ((("plain",), 0.0), (("plain", "interleaved"), 1.0 / 8)):
            runs = []
            for hopeful in (counting, lambda run, key, gidx, covered, group: (gidx, covered)):
                monkeypatch.setattr(kernel, "_hopeful", hopeful)
                st_ = ComposeStats()
                comp = compose(options, link, L, m, stats=st_, score=score, score_schedules=schedules,
                               score_fill_weight=weight)
                runs.append((comp and (comp.options, comp.score_s), st_.states, st_.dp_runs, st_.trace,
                             st_.candidates, [c.options for c in st_.scored]))
                monkeypatch.undo()
            assert runs[0] == runs[1]
    assert dropped[0] > 0


@pytest.mark.slow
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.integers(-1, 4), st.integers(1, 4),
                          st.integers(1, 4), st.integers(1, 4)), max_size=40))
@settings(max_examples=200, deadline=None)
def test_covered_room_is_the_most_room_of_an_earlier_option_no_worse(rows):
    """dominance.covered_rooms against its definition: per option, the largest max_after of an option before it on
    the same layers with no more time, tail, stages and bottleneck (-1: none). Small integer fields, so ties and
    equal options are common."""

    options = [Option(start, 8, 0, stages, after, float(t), float(bn), float(tail))
               for start, stages, after, t, bn, tail in rows]
    order = list(range(len(options)))[::-1]
    want = []
    for k, oi in enumerate(order):
        o = options[oi]
        rooms = [options[p].max_after for p in order[:k] if options[p].start == o.start
                 and options[p].time_s <= o.time_s and options[p].tail_s <= o.tail_s
                 and options[p].num_stages <= o.num_stages and options[p].bottleneck_s <= o.bottleneck_s]
        want.append(max(rooms, default=-1))
    assert covered_rooms(options, order) == want


@given(st.integers(0, 2 ** 32 - 1))
@settings(max_examples=60, deadline=None)
def test_covers_per_island_set_are_the_least_over_every_cover(seed):
    """covers (from pair_minima) equal a brute force over every chain of options, and the DP's prefix bounds per
    set of islands (PrefixBounds) one over every chain whose islands are distinct members of the set: the least
    fill, period and tail of a cover of [0, j) (and covers' of [j, L)), each on its own."""
    from tangram_launch.planner.bounds import PrefixBounds, covers

    rng = random.Random(seed)
    options, _link, L, _m, K = random_instance(rng, max_layers=5)
    idx = [i for i, o in enumerate(options) if o.max_after >= 0]

    def brute(sub, lo, hi, distinct=False):  # least (fill, period, tail) over chains covering [lo, hi)
        best = [math.inf] * 3

        def walk(at, fill, period, tail, used):
            if at == hi:
                best[:] = [min(best[0], fill), min(best[1], period), min(best[2], tail)]
                return
            for i in sub:
                o = options[i]
                if o.start == at and o.stop <= hi and not (distinct and used >> o.island & 1):
                    walk(o.stop, fill + o.time_s, max(period, o.bottleneck_s), max(tail, o.tail_s),
                         used | 1 << o.island)

        walk(lo, 0.0, 0.0, 0.0, 0)
        return best

    front, back = covers(options, idx, L, back=False), covers(options, idx, L, back=True)
    prefix = PrefixBounds(options, idx, L)
    for j in range(1, L + 1):
        assert [front.fill_s[j], front.period_s[j], front.tail_s[j]] == pytest.approx(brute(idx, 0, j), rel=1e-12)
        for mask in range(1 << K):
            sub = [i for i in idx if mask >> options[i].island & 1]
            got = prefix(mask)
            assert [got.fill_s[j], got.period_s[j], got.tail_s[j]] == pytest.approx(brute(sub, 0, j, True),
                                                                                    rel=1e-12)
    for j in range(L):
        assert [back.fill_s[j], back.period_s[j], back.tail_s[j]] == pytest.approx(brute(idx, j, L), rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_a_fine_score_floor_scores_fewer_and_chooses_the_same(seed):
    """score_floor_fine is asked only of candidates the cheap floor lets through, and one it rules out is not
    scored. With the score itself as the fine floor (the tightest valid one), compose scores no more candidates
    and chooses the same plan as without it, on random instances scored by the 1F1B simulation."""
    rng = random.Random(9100 + seed)
    fewer = 0
    for _ in range(60):
        options, link, L, m, _K = random_instance(rng)
        score = simulated(options, link, m)
        runs = []
        for fine in (None, score):
            st_ = ComposeStats()
            comp = compose(options, link, L, m, stats=st_, score=score, score_schedules=("plain",),
                           score_floor=lambda seq, met: plain_1f1b_floor_s(seq, options, link, m, met.tail_s),
                           score_floor_fine=fine)
            runs.append((comp and (comp.options, comp.objective_s), len(st_.scored)))
        assert runs[1][0] == runs[0][0]
        assert runs[1][1] <= runs[0][1]
        fewer += runs[1][1] < runs[0][1]
    assert fewer > 0


@pytest.mark.unit
@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**6))
def test_prefix_bounds_with_links_lie_under_every_front_cover_by_distinct_islands(seed):
    """PrefixBounds(mask)[j] is under the fill (times + 2 x each link crossed), the period (slowest bottleneck or
    link) and the tail of every cover of [0, j) by distinct islands of the mask, links between its slices included,
    and the least link into the next island (front_link_s) is under the link that cover's last island crosses."""
    from tangram_launch.planner.bounds import PrefixBounds, front_link_s

    rng = random.Random(seed)
    options, link, L, m, K = random_instance(rng, max_layers=6)
    prefix = PrefixBounds(options, range(len(options)), L, link)

    def walk(pos, used, fill, period, tail, stage, last):
        for mask in range(1 << K):
            if used & ~mask:
                continue
            got = prefix(mask)
            assert got.fill_s[pos] <= fill + 1e-9
            assert got.period_s[pos] <= period + 1e-9
            assert got.tail_s[pos] <= tail + 1e-9
            assert got.stage_period_s[pos] <= stage + 1e-9 and got.stage_period_s[pos] <= got.period_s[pos]
        for o in options:
            if o.start != pos or used >> o.island & 1:
                continue
            lk = link[last][o.island] if last >= 0 else 0.0
            if last >= 0:
                assert front_link_s(link, used, o.island, {}) <= lk
            walk(o.stop, used | 1 << o.island, fill + o.time_s + 2.0 * lk, max(period, o.bottleneck_s, lk),
                 max(tail, o.tail_s), max(stage, o.bottleneck_s), o.island)

    walk(0, 0, 0.0, 0.0, 0.0, 0.0, -1)



@pytest.mark.unit
@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**6))
def test_fit_prefix_bounds_lie_under_every_front_that_fits_in_front_of_n_stages(seed):
    """FitPrefixBounds(n)(mask)[j] is under the fill, period, tail and slowest stage of every cover of [0, j) by
    distinct islands of the mask that fits in front of n stages (each of its options with the stages behind it,
    n and the cover's own, as compose.evaluate counts them), and never under PrefixBounds(mask)[j]: it covers by
    fewer options."""
    from tangram_launch.planner.bounds import FitPrefixBounds, PrefixBounds

    rng = random.Random(seed)
    options, link, L, m, K = random_instance(rng, max_layers=6)
    idx = [i for i, o in enumerate(options) if o.max_after >= 0]
    whole = PrefixBounds(options, idx, L, link)
    fit = FitPrefixBounds(options, idx, L, link, m - 1, whole=whole if rng.random() < 0.5 else None)
    for n in range(m + 2):
        for mask in range(1 << K):
            got, least = fit(n)(mask), whole(mask)
            for a, b in zip(got, least):
                assert all(x >= y for x, y in zip(a, b))

    def walk(seq, used, fill, period, tail, stage):
        pos = options[seq[-1]].stop if seq else 0
        for n in range(m + 2):
            after, fits = n, True
            for oi in reversed(seq):
                fits = fits and options[oi].max_after >= min(after, m - 1)
                after += options[oi].num_stages
            for mask in range(1 << K):
                if fits and not used & ~mask:
                    got = fit(n)(mask)
                    assert got.fill_s[pos] <= fill + 1e-9 and got.period_s[pos] <= period + 1e-9
                    assert got.tail_s[pos] <= tail + 1e-9 and got.stage_period_s[pos] <= stage + 1e-9
        for oi in idx:
            o = options[oi]
            if o.start != pos or used >> o.island & 1:
                continue
            lk = link[options[seq[-1]].island][o.island] if seq else 0.0
            walk(seq + [oi], used | 1 << o.island, fill + o.time_s + 2.0 * lk, max(period, o.bottleneck_s, lk),
                 max(tail, o.tail_s), max(stage, o.bottleneck_s))

    walk([], 0, 0.0, 0.0, 0.0, 0.0)

def _prefix_reference(options, idx, L, link, mask, memo):
    """PrefixBounds' recurrence (see its docstring) as a loop over each island's pair minima, one float operation at
    a time in the order the arrays take them: (fill, period, tail, stage) per prefix [0, j) for the set ``mask``."""
    from tangram_launch.planner.bounds import front_link_s, pair_minima

    if mask not in memo:
        none = [0.0] + [math.inf] * L
        fill, period, tail, stage = (list(none) for _ in range(4))
        for k in sorted({options[i].island for i in idx if mask >> options[i].island & 1}):
            rest = mask & ~(1 << k)
            sf, sp, st_, ss = _prefix_reference(options, idx, L, link, rest, memo)
            lk = front_link_s(link, rest, k, {})
            for (a, b), (t, bn, tl) in pair_minima(options, [i for i in idx if options[i].island == k]).items():
                fill[b] = min(fill[b], sf[a] + t + (2.0 * lk if a else 0.0))
                v = sp[a] if sp[a] > bn else bn
                period[b] = min(period[b], lk if a and lk > v else v)
                stage[b] = min(stage[b], ss[a] if ss[a] > bn else bn)
                tail[b] = min(tail[b], st_[a] if st_[a] > tl else tl)
        memo[mask] = (fill, period, tail, stage)
    return memo[mask]


@pytest.mark.unit
@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10**6), st.booleans())
def test_prefix_bounds_are_their_recurrence_bit_for_bit(seed, zero_links):
    """PrefixBounds' array covers (from the option rows or the loop) equal its recurrence taken one pair at a time,
    to the bit, for every set of islands: links added only past layer 0 and links of 0 (which raise no period and
    add no fill) skipped, as the arrays skip them."""
    import numpy as np

    from tangram_launch.planner.bounds import PrefixBounds

    rng = random.Random(seed)
    options, link, L, _m, K = random_instance(rng, max_layers=6)
    if zero_links:
        link = [[0.0] * K for _ in range(K)]
    idx = [i for i, o in enumerate(options) if o.max_after >= 0]
    rows = np.array(options, dtype=np.float64).reshape(-1, 8)
    memo: dict = {}
    for prefix in (PrefixBounds(options, idx, L, link), PrefixBounds(options, idx, L, link, rows)):
        for mask in range(1 << K):
            want = _prefix_reference(options, idx, L, link, mask & prefix.islands, memo)
            got = prefix(mask)
            assert (got.fill_s, got.period_s, got.tail_s, got.stage_period_s) == want, (seed, mask)


@pytest.mark.slow  # 150 simulated pipelines (seconds)
@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6))
def test_round_trips_floor_lies_under_the_plain_simulation_but_m_links_need_not(seed):
    """bounds.round_trips_s for each stage boundary (its link, the stages behind it) is under the plain 1F1B
    simulation, whatever the stage times; m x the link is not, once the warm-up of many stages behind the link
    hides some of its round trips (which is why the DP's plain floor reads the former)."""
    from tangram_launch.costmodel.pipeline import simulated_1f1b_s
    from tangram_launch.planner.bounds import round_trips_s

    rng = random.Random(seed)
    S = rng.randint(2, 24)
    m = rng.choice([1, 2, 3, 8, 16, 64])
    times = [rng.uniform(0.001, 1.0) for _ in range(S)]
    fwd, bwd = [t / 3 for t in times], [2 * t / 3 for t in times]
    p2p = [rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in range(S - 1)]
    sim = simulated_1f1b_s(fwd, bwd, p2p, m)
    for k, p in enumerate(p2p):
        assert round_trips_s(p, S - k - 1, m) <= sim * (1 + 1e-12)
    # 32 stages of 0.03 s, a 1 s link after the 16th, 128 micro-batches: the simulation is under 128 x 1 s
    assert simulated_1f1b_s([0.01] * 32, [0.02] * 32, [0.0] * 15 + [1.0] + [0.0] * 15, 128) < 128 * 1.0


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6))
def test_cycles_across_a_boundary_lie_under_the_plain_simulation(seed):
    """bounds.cycles_s for each stage boundary (its link, the stages behind it, the stage times beside it) is under
    the plain 1F1B simulation, whatever the stage times and their forward / backward split, and never under the
    round trips alone (round_trips_s) it adds the stage times to."""
    from tangram_launch.costmodel.pipeline import simulated_1f1b_s
    from tangram_launch.planner.bounds import cycles_s, round_trips_s

    rng = random.Random(seed)
    S = rng.randint(2, 24)
    m = rng.choice([1, 2, 3, 8, 16, 64])
    fwd = [rng.uniform(0.001, 1.0) for _ in range(S)]
    bwd = [f * rng.uniform(0.5, 3.0) for f in fwd]
    p2p = [rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in range(S - 1)]
    sim = simulated_1f1b_s(fwd, bwd, p2p, m)
    for k, p in enumerate(p2p):
        behind = S - k - 1
        got = cycles_s(p, behind, m, fwd[k] + bwd[k], fwd[k + 1] + bwd[k + 1])
        assert got <= sim * (1 + 1e-12)
        assert got >= round_trips_s(p, behind, m)


def _fixed_stages(o, seq):
    """An option's stage times whatever the sequence: its bottleneck on one stage (the same one each time), the
    rest of its time split evenly over the others (none longer: time <= stages x bottleneck in random_instance)."""
    rest = (o.time_s - o.bottleneck_s) / (o.num_stages - 1) if o.num_stages > 1 else 0.0
    times = [rest] * (o.num_stages - 1)
    times.insert((o.start + o.stop) % o.num_stages, o.bottleneck_s)
    return times


@pytest.mark.parametrize("seed", range(3))
def test_stage_times_at_the_edges_tighten_the_plain_floor_and_choose_the_same(seed):
    """With ``edge_s`` (each option's first and last stage's forward + backward) the DP's plain 1F1B floor counts
    the stage times its round trips pass (cycles_s): on random instances scored by the 1F1B simulation compose
    returns a plan of the same score as without them, never worse than the closed form's optimum (brute force),
    while its DP keeps fewer states."""
    rng = random.Random(9300 + seed)
    score_of = functools.partial(simulated, stage_times=_fixed_stages)
    states = [0, 0]
    for _ in range(80):
        options, link, L, m, K = random_instance(rng, max_layers=6)
        # the round trips count below the cap on stages behind (compose._prepare's n_cap, from the finite
        # max_after): many micro-batches, every option's memory for a few stages behind it or for all of them
        m = rng.choice([8, 16, 32])
        options = [o._replace(max_after=rng.choice([2, 4, m - 1])) for o in options]
        score = score_of(options, link, m)
        edges = [(t[0], t[-1]) for t in (_fixed_stages(o, ()) for o in options)]
        every = every_composition(options, link, L, m)
        got = []
        for n, edge_s in enumerate((None, edges)):
            stats = ComposeStats()
            got.append(compose(options, link, L, m, score=score, stats=stats, score_schedules=("plain",),
                               score_floor=lambda seq, met: plain_1f1b_floor_s(seq, options, link, m, met.tail_s),
                               edge_s=edge_s))
            states[n] += stats.states
        assert (got[1] is None) == (not every)
        if not every:
            continue
        _check_plan(got[1], options, link, L, m)
        assert got[1].score_s == pytest.approx(got[0].score_s, rel=1e-12)
        exact = brute_force(options, link, L, m)  # the closed form's optimum: never a worse score
        assert got[1].score_s <= score(exact.options, exact.metrics) + 1e-9
    assert states[1] < states[0]


# --- exact against the plain 1F1B simulation (plain_complete.py) ----------------------------------------------------

def _path_floor_score_floor(options, link, m):
    """A score floor as the driver's fine one: the larger of plain_1f1b_floor_s and the path floor over the
    sequence's stages (costmodel.plain_1f1b_paths), under the plain simulation of ``with_bottleneck`` stages."""
    def floor(seq, metrics):
        paths = path_floor_1f1b_s(*stage_seconds(options, link, seq, with_bottleneck), m) * (1.0 - FLOOR_ROUNDING)
        return max(plain_1f1b_floor_s(seq, options, link, m, metrics.tail_s), paths + metrics.tail_s)
    return floor


def _plain_sweep(rng: random.Random, instances: int) -> int:
    """compose against the least score of every composition, where the score is the plain 1F1B simulation (alone,
    or the least of it and interleaved schedules), under required islands, a stage cap, an island order, the score
    band, a best score found elsewhere and the driver's floors; returns how many instances had a plan."""
    checked = 0
    for _ in range(instances):
        options, link, L, m, K = random_instance(rng, max_layers=rng.choice([6, 8]), max_islands=rng.choice([3, 4]))
        m = rng.choice([1, 2, 4, 8, 16, 32])
        V = rng.choice([2, 4])
        schedules = rng.choice([("plain",), ("plain",), ("plain", "interleaved")])
        score = scheduled(options, link, m, schedules=schedules, most_chunks=V)
        kw = _restrictions(rng, K, 0.2)
        least = _least_score(options, link, L, m, score, **kw)
        search = dict(kw, score_band=rng.random() < 0.2)
        if schedules == ("plain",) and rng.random() < 0.5:
            search["score_floor"] = search["score_floor_fine"] = _path_floor_score_floor(options, link, m)
            search["edge_s"] = [(t[0], t[-1]) for t in (with_bottleneck(o, ()) for o in options)]
        if rng.random() < 0.2 and least < math.inf:
            search["score_incumbent_s"] = least * rng.uniform(1.0, 1.2)
        got = compose(options, link, L, m, score=score, score_schedules=schedules,
                      score_fill_weight=1.0 / V if "interleaved" in schedules else 0.0, **search)
        if least == math.inf or (got is None and least >= search.get("score_incumbent_s", math.inf)):
            continue
        checked += 1
        _check_plan(got, options, link, L, m, required=kw.get("required_mask", 0), max_stages=kw.get("max_stages"))
        assert got.score_s == pytest.approx(least, rel=1e-12)
    return checked


@pytest.mark.parametrize("seed", range(3))
def test_a_plain_score_finds_the_least_score_of_every_composition(seed):
    """Where the score can be the plain 1F1B simulation, compose returns the least score of every composition the
    restrictions admit (brute force), though its DP's dominance (fill, tail, stages, period) does not order that
    score: the complete pass covers every sequence, pruned only by safe floors."""
    assert _plain_sweep(random.Random(7100 + seed), 200) > 120


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_fitting_fronts_in_front_of_every_state_keep_the_least_score(seed, monkeypatch):
    """compose reads the fronts that fit in front of a state's stages (bounds.FitPrefixBounds) only in front of
    states of _FIT_AT entries or more, which these small instances seldom reach: read in front of every state, they
    cut entries and the plain sweep still finds the least score of every composition."""
    import tangram_launch.planner.compose as compose_module

    monkeypatch.setattr(compose_module, "_FIT_AT", 0)
    assert _plain_sweep(random.Random(7400 + seed), 200) > 120
    rng = random.Random(7500 + seed)
    states = {}
    for fit_at in (0, 1 << 30):
        monkeypatch.setattr(compose_module, "_FIT_AT", fit_at)
        rng.seed(7500 + seed)
        st_ = ComposeStats()
        for _ in range(100):
            options, link, L, m, K = random_instance(rng, max_layers=8, max_islands=4)
            m = rng.choice([4, 8, 16])
            compose(options, link, L, m, stats=st_, score=scheduled(options, link, m, schedules=("plain",)),
                    score_schedules=("plain",))
        states[fit_at] = st_.states
    assert states[0] < states[1 << 30]


@pytest.mark.slow  # thousands of brute forces (tens of seconds)
def test_a_plain_score_finds_the_least_score_over_thousands_of_instances():
    """test_a_plain_score_finds_the_least_score_of_every_composition on 3,000 instances."""
    assert _plain_sweep(random.Random(7200), 3000) > 1800


def test_a_deferred_complete_pass_finds_the_least_score_under_a_later_bound():
    """compose with ``deferred`` leaves its complete pass to the caller (size_composition.complete_deferred): run
    later, bounded by a score a real plan holds (here the least one found by brute force, a little above it, or
    none), the passes together still find the least score of every composition, and a pass bounded by the least
    score itself finds nothing better."""
    rng = random.Random(7300)
    checked = 0
    for _ in range(200):
        options, link, L, m, K = random_instance(rng, max_layers=rng.choice([6, 8]), max_islands=rng.choice([3, 4]))
        m = rng.choice([2, 4, 8, 16])
        schedules = rng.choice([("plain",), ("plain", "interleaved")])
        score = scheduled(options, link, m, schedules=schedules, most_chunks=2)
        least = _least_score(options, link, L, m, score)
        later: list = []
        got = compose(options, link, L, m, score=score, score_schedules=schedules, deferred=later,
                      score_fill_weight=0.5 if "interleaved" in schedules else 0.0)
        if least == math.inf:
            continue
        checked += bool(later)
        bound = rng.choice([math.inf, least * rng.uniform(1.000001, 1.2)])
        found = [got.score_s] if got is not None else []
        for finish in later:
            comp = finish(bound)
            if comp is not None:
                _check_plan(comp, options, link, L, m, required=0, max_stages=None)
                assert comp.score_s < bound
                found.append(comp.score_s)
        assert min(found) == pytest.approx(least, rel=1e-12)
        assert all(finish(least) is None for finish in later)
    assert checked > 100


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.floats(0.0, 2.0)), min_size=1, max_size=9),
       st.integers(1, 24))
def test_the_path_floor_lies_under_the_plain_simulation(stages, m):
    """path_floor_1f1b_s (four paths through each stage of the 1F1B schedule) lies under the simulation of the same
    stage times and links, and is at least m x the slowest stage + the fill in front of it; with one slow stage
    and no links it is the simulation."""
    fwd, bwd = [s[0] for s in stages], [s[1] for s in stages]
    p2p = [s[2] for s in stages[1:]]
    sim = simulated_1f1b_s(fwd, bwd, p2p, m)
    floor = path_floor_1f1b_s(fwd, bwd, p2p, m)
    assert floor <= sim * (1.0 + 1e-12) + 1e-12
    front = 0.0
    for k, (f, b) in enumerate(zip(fwd, bwd)):
        assert floor >= (m * (f + b) + front) * (1.0 - 1e-12)
        front += f + b + (2.0 * p2p[k] if k < len(p2p) else 0.0)


_STAGE = st.tuples(st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.floats(0.0, 1.0))  # forward, backward, p2p in front


@settings(max_examples=300, deadline=None)
@given(st.lists(_STAGE, max_size=3), st.lists(_STAGE, min_size=1, max_size=4), st.lists(_STAGE, max_size=4),
       st.integers(1, 24))
def test_the_dp_path_floor_of_an_option_lies_under_the_plain_simulation(front, option, behind, m):
    """What compose's complete pass adds in front of an entry (behind_path_s with own_stages_s, from an option's
    time, slowest stage and stage count, the fill and the stages behind it) + the fill in front lies under the
    plain simulation of any stages with those numbers: any forward/backward split, the slowest stage anywhere in
    the option, p2p inside it and at its edges."""
    stages = front + option + behind
    fwd, bwd = [s[0] for s in stages], [s[1] for s in stages]
    p2p = [s[2] for s in stages[1:]]
    sim = simulated_1f1b_s(fwd, bwd, p2p, m)
    times = [f + b for f, b, _ in stages]
    first, last = len(front), len(front) + len(option)
    in_front = sum(times[:first]) + 2.0 * sum(p2p[:first])
    time_s = sum(times[first:last]) + 2.0 * sum(p2p[first:last - 1])
    fill_behind = sum(times[last:]) + 2.0 * sum(p2p[last - 1:])
    bn = max(times[first:last])
    floor = in_front + behind_path_s(0.0, m, bn, own_stages_s(time_s, bn), fill_behind, len(stages) - first - 1)
    assert floor <= sim * (1.0 + 1e-12) + 1e-12


def test_an_options_other_stages_raise_its_path_floor_to_the_simulation():
    """Two equal stages in one option, two slower-than-half stages behind it: the option's second stage lies on
    the path through its first both ways (own_stages_s), which the stages behind the option alone do not show;
    with it the floor is the simulation."""
    fwd, bwd, p2p, m = [1.0, 1.0, 0.8, 0.8], [2.0, 2.0, 1.6, 1.6], [0.0, 0.0, 0.0], 32
    sim = simulated_1f1b_s(fwd, bwd, p2p, m)
    fill_behind = 2.4 + 2.4
    alone = behind_path_s(0.0, m, 3.0, 0.0, fill_behind, 3)
    assert alone < sim * 0.95
    assert behind_path_s(0.0, m, 3.0, own_stages_s(6.0, 3.0), fill_behind, 3) == pytest.approx(sim, rel=1e-12)


def test_the_path_floor_is_the_simulation_of_one_slow_stage_in_front():
    """A slow first stage with fast stages behind it waits for the first backward to come back and for the last:
    the path floor counts both waits, m x its stage time + the fill in front alone does not."""
    fwd, bwd, p2p, m = [1.0, 0.5, 0.5, 0.5], [2.0, 1.0, 1.0, 1.0], [0.05] * 3, 16
    sim = simulated_1f1b_s(fwd, bwd, p2p, m)
    assert path_floor_1f1b_s(fwd, bwd, p2p, m) == pytest.approx(sim, rel=1e-12)
    assert m * 3.0 < sim * 0.999


@pytest.mark.slow
def test_the_default_search_finds_the_best_single_size_plan_on_a_plain_schedule():
    """The planner's default search (every divisor of the batch, sizes skipped by floors, incumbents carried from
    size to size) returns the best of one search per divisor: a size's DP under a tighter bound kept other
    entries than alone, and its plain 1F1B simulation ranked a dropped one first."""
    from tangram_launch.planner import PlannerOptions, make_plan
    from tangram_launch.specs.training import TrainingSpec
    from test_planner import HET, MODEL

    training = TrainingSpec(256, 128, "fp16")
    default = make_plan(HET, MODEL, training, runtime="torch", options=PlannerOptions(max_workers=1))
    per_size = [make_plan(HET, MODEL, training, runtime="torch",
                          options=PlannerOptions(max_workers=1, microbatch_sequences=(b,))).predicted.iteration_time_s
                for b in range(1, 257) if 256 % b == 0]
    assert default.predicted.iteration_time_s == pytest.approx(min(per_size), rel=1e-12)


@pytest.mark.slow
def test_insisted_interleaving_runs_no_plain_complete_pass():
    """Under --schedule interleaved-1F1B a pipeline that cannot interleave scores inf
    (build.Candidates.schedule_choice), so no plain prediction picks a plan: the composer's schedules are interleaved
    only, and its complete pass covers only pipelines that can interleave. Counting plain there, a size where
    nothing could interleave had no score to beat, and the complete pass enumerated every sequence (generated case
    33 at b = 8: ~465,000 DP states)."""
    from tangram_launch.capabilities import capabilities_for
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.planner.grid_classes import GridClass
    from tangram_launch.planner.size_composition import _score_schedules
    from test_planner_microbatch_exact import generated_case

    cluster, model, training, runtime, schedule = generated_case(33)
    assert (runtime, schedule) == ("torch", "interleaved-1F1B")
    opts = PlannerOptions(max_workers=1, progress=False, schedule=schedule, microbatch_sequences=(8,))
    caps = capabilities_for(runtime)
    for group in ("free", GridClass("free", None), GridClass("free", (1, 1, 1))):
        assert _score_schedules(group, caps, opts) == ("interleaved",)
    plan = search(cluster, model, training, runtime=runtime, parallelizer="megatron", options=opts).plan
    assert plan.planner["compose"]["states"] < 20_000
