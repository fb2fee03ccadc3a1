"""Reasons for dropped islands (planner/dropped.py): the floor under every plan using an island, against brute
force, and the reasons the planner words from it."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.planner.compose import SCORE_ANY as SCORE_ANY_, Option
from tangram_launch.planner.cover_floors import island_floor_s
from tangram_launch.planner.reference import every_composition

from helpers_compose import random_options, scheduled

NEVER = -1
ROOM = 1 << 30


def _instance(seed: int, max_layers: int = 6):
    rng = random.Random(seed)
    L = rng.randint(1, max_layers)
    K = rng.randint(1, 3)
    m = rng.choice([1, 2, 4, 8, 32])
    options = random_options(rng, L, K, fits=[NEVER, 0, 1, 2, 5, ROOM], tail_max_s=3.0)
    link = [[0.0 if i == j else rng.choice([0.0, rng.uniform(0, 1.5)]) for j in range(K)] for i in range(K)]
    return options, link, L, m, K


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6))
def test_island_floor_is_under_every_plan_using_the_island(seed):
    options, link, L, m, K = _instance(seed)
    plans = [(c.options, c.metrics) for c in every_composition(options, link, L, m)]
    idx = list(range(len(options)))
    for k in range(K):
        floor_s = island_floor_s(options, idx, k, L, m)
        using = [m * max(options[i].bottleneck_s for i in seq) + metrics.tail_s
                 for seq, metrics in plans if any(options[i].island == k for i in seq)]
        if using:
            assert floor_s <= min(using) * (1 + 1e-12)
        if floor_s == math.inf:
            assert not using


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 7))
def test_island_floors_read_the_other_islands_minima_as_one_pass_over_their_options_would(seed, islands):
    """island_floors_s merges the other islands' pair minima from the islands before and after each island: the
    same floors, bit for bit, as the least over the other islands' options taken directly."""
    from tangram_launch.planner.bounds import covers_of, pair_minima
    from tangram_launch.planner.cover_floors import island_floors_s, usable

    rng = random.Random(seed)
    L, m = rng.randint(1, 8), rng.choice([1, 2, 4, 8, 32])
    options = []
    for _ in range(rng.randint(0, 50)):
        a = rng.randrange(L)
        options.append(Option(a, rng.randint(a + 1, L), rng.randrange(islands), rng.randint(1, 3),
                              rng.choice([NEVER, 0, 2, ROOM]), rng.uniform(0, 4), rng.uniform(0, 2),
                              rng.choice([0.0, rng.uniform(0, 1)])))
    idx = usable(options, range(len(options)), L)
    want = {}
    for k in range(islands + 1):  # (island ``islands`` has no options)
        others = pair_minima(options, [i for i in idx if options[i].island != k])
        front, back = covers_of(others, L, back=False), covers_of(others, L, back=True)
        want[k] = min((m * max(o.bottleneck_s, front.period_s[o.start], back.period_s[o.stop])
                       + max(o.tail_s, front.tail_s[o.start], back.tail_s[o.stop])
                       for o in (options[i] for i in idx) if o.island == k), default=math.inf)
    assert island_floors_s(options, idx, list(range(islands + 1)), L, m) == want


def test_island_floor_is_the_plan_when_the_island_holds_the_slowest_stage():
    # island 1 must hold layers [1, 2) at 3 s; island 0 covers the rest at 1 s: floor = m x 3 + the larger tail
    options = [Option(0, 1, 0, 1, ROOM, 1.0, 1.0, 0.5), Option(1, 2, 1, 1, ROOM, 3.0, 3.0, 0.2),
               Option(0, 2, 0, 1, ROOM, 2.0, 2.0, 0.5)]
    assert island_floor_s(options, range(3), 1, 2, 4) == pytest.approx(4 * 3.0 + 0.5)
    # without a cover of [0, 1) by another island no plan can use island 1
    assert island_floor_s(options[1:], range(2), 1, 2, 4) == math.inf


def test_islands_whose_floor_cannot_beat_the_incumbent_are_left_out_of_the_order_search():
    from tangram_launch.planner.class_composition import hopeful_islands

    # islands 0-2 hold each layer at 1, 1.5 and 2 s per micro-batch, island 3 at 10 s; m = 4. Floors: islands 0 and
    # 1: 4 x 1.5 + 0.1 (the other layer on the best other island), island 2: 4 x 2 + 0.1, island 3: 4 x 10 + 0.1
    options = [Option(0, 1, k, 1, ROOM, 1.0 + k / 2, 1.0 + k / 2, 0.1) for k in range(3)]
    options += [Option(1, 2, k, 1, ROOM, 1.0 + k / 2, 1.0 + k / 2, 0.1) for k in range(3)]
    options += [Option(0, 2, 3, 1, ROOM, 10.0, 10.0, 0.1), Option(1, 2, 3, 1, ROOM, 10.0, 10.0, 0.1)]
    assert hopeful_islands(options, [0, 1, 2, 3], 0, 2, 4, 9.0) == [0, 1, 2]
    assert hopeful_islands(options, [0, 1, 2, 3], 0, 2, 4, 6.2) == [0, 1]
    assert hopeful_islands(options, [0, 1, 2, 3], 0, 2, 4, 6.1) == []  # a floor equal to the incumbent cannot beat it
    assert hopeful_islands(options, [0, 1, 2, 3], 1 << 3, 2, 4, 6.2) == [0, 1, 3]  # a required island stays
    assert hopeful_islands(options, [0, 1, 2, 3], 0, 2, 4, math.inf) == [0, 1, 2, 3]  # no incumbent yet


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([1.0, 1.02, 1.2]), st.booleans())
def test_options_left_out_as_unpromising_change_no_composition(seed, slack, with_links):
    from tangram_launch.planner.compose import ComposeStats, compose
    from tangram_launch.planner.cover_floors import promising
    from tangram_launch.planner.reference import brute_force

    options, link, L, m, K = _instance(seed)
    best = brute_force(options, link, L, m)
    if best is None:
        return
    to_beat = best.latency_s * slack  # an incumbent from elsewhere, at or above the optimum
    keep = promising(options, range(len(options)), L, m, to_beat, to_beat, link if with_links else None)
    kept = [options[i] for i in keep]
    full = compose(options, link, L, m, incumbent_s=to_beat, stats=ComposeStats())
    less = compose(kept, link, L, m, incumbent_s=to_beat, stats=ComposeStats())
    assert (full is None) == (less is None)
    if full is not None:
        assert less.latency_s == pytest.approx(full.latency_s)
    if slack > 1.0:  # the optimum's options are all kept
        assert set(best.options) <= set(keep)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([1.0, 1.0 + 1e-9, 1.02, 1.2]),
       st.sampled_from([("plain",), ("interleaved",), ("plain", "interleaved")]))
def test_options_left_out_by_their_score_floors_change_no_plan(seed, slack, schedules):
    """promising with the score's schedules (the plain 1F1B floor, the interleaved one with the option's own cap
    on chunks) keeps every option of a plan whose score can beat the score to beat: composing the kept options
    finds the same score as composing them all."""
    from tangram_launch.planner.compose import ComposeStats, compose
    from tangram_launch.planner.cover_floors import promising

    options, link, L, m, K = _instance(seed, max_layers=9)  # (up to 3 layers per stage: the chunk caps matter)
    score = scheduled(options, link, m, schedules)
    kw = dict(score=score, score_schedules=schedules, score_fill_weight=1.0 / 8)
    best = compose(options, link, L, m, stats=ComposeStats(), **kw)
    if best is None or best.score_s == math.inf:
        return
    to_beat = best.score_s * slack  # a best score from elsewhere, at or above this one
    # a closed form to beat that keeps nothing: only the score floors keep options
    keep = promising(options, range(len(options)), L, m, 1e-12, to_beat, link, schedules=schedules,
                     fill_weight=1.0 / 8)
    kept = [options[i] for i in keep]
    full = compose(options, link, L, m, stats=ComposeStats(), score_incumbent_s=to_beat, **kw)
    less = compose(kept, link, L, m, stats=ComposeStats(), score_incumbent_s=to_beat,
                   **{**kw, "score": scheduled(kept, link, m, schedules)})

    def beating(c):  # (compose returns its best even where it does not beat the score to beat)
        return c.score_s if c is not None and c.score_s < to_beat else math.inf
    assert beating(less) == pytest.approx(beating(full), rel=1e-12)
    if slack > 1.0:  # the best plan's options are all kept
        assert {options[i] for i in best.options} <= set(kept)


def test_an_option_of_two_layers_per_stage_is_kept_for_its_interleaved_score():
    """Two one-stage slices of two layers each, 1 s per micro-batch, m = 4: plain 1F1B takes 3 x 1 + 2 = 5 s at
    least behind the first slice, interleaved with 2 chunks 4 x 1 + (2 - 1) / 2 = 4.5 s. Against a best score of
    4.6 s the second slice is kept for its interleaved score (2 layers per stage: 2 chunks), and dropped where only
    the plain schedule counts, or where the stages have one layer each (they cannot interleave)."""
    from tangram_launch.planner.cover_floors import promising

    opts = [Option(0, 2, 0, 1, ROOM, 1.0, 1.0, 0.0), Option(2, 4, 1, 1, ROOM, 1.0, 1.0, 0.0)]
    link = [[0.0, 0.0], [0.0, 0.0]]
    kw = dict(fill_weight=1.0 / 8)
    assert promising(opts, [0, 1], 4, 4, 1e-12, 4.6, link, schedules=("plain", "interleaved"), **kw) == [0, 1]
    assert promising(opts, [0, 1], 4, 4, 1e-12, 4.6, link, schedules=("plain",), **kw) == [0]
    thin = [o._replace(num_stages=2, time_s=1.0, bottleneck_s=0.5) for o in opts]  # 1 layer per stage
    # plain: 4 x 0.5 = 2 s behind 1 s of fill in front: 3 s; against 2.9 s only the first is kept
    assert promising(thin, [0, 1], 4, 4, 1e-12, 2.9, link, schedules=("plain", "interleaved"), **kw) == [0]


def test_above_exact_islands_the_reason_names_the_search_that_found_nothing_better():
    """Above exact_islands the planner does not price each island's best plan (that would be a search per island);
    an island whose floor does not rule it out is reported as not beating the chosen plan in the search that ran,
    which says what that search was, with the floor under any plan using it."""
    from types import SimpleNamespace

    from tangram_launch.planner.build import Candidates
    from tangram_launch.planner.compose import Composition, Metrics
    from tangram_launch.planner.dropped import dropped_islands

    K, m = 7, 4
    options = [Option(0, 2, k, 1, ROOM, 1.0 + k, 1.0 + k, 0.0) for k in range(K)]
    islands = tuple(SimpleNamespace(name=f"isl{k}") for k in range(K))
    cand = Candidates(b=1, num_microbatches=m, islands=islands, links=None, link_matrix=((0.0,) * K,) * K,
                      options=options)
    best = Composition((0,), Metrics(30.0, 7.5, 1.0, 0.0, ()), 7.5, 30.0)  # as if slower than its closed form
    pairset = SimpleNamespace(island_notes={})

    def reasons(exact_islands):
        return {d["island"]: d["reason"] for d in dropped_islands(
            cand, range(K), best, islands, pairset, 2, SimpleNamespace(name="torch"), exact_islands,
            lambda k: Composition((k,), Metrics(m * (1.0 + k), 1.0 + k, 1.0 + k, 0.0, ()), 1.0 + k))}

    many = reasons(5)
    assert "the search over more than 5 islands (exact over island sets" in many["isl6"]
    assert "at least 28 s" in many["isl6"]  # m x its bottleneck
    assert "the best one takes 28 s" in reasons(7)["isl6"]  # within exact_islands: priced by a composition


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([SCORE_ANY_, ("plain",), ("interleaved",), ("plain", "interleaved")]),
       st.sampled_from([0.0, 1.0 / 8]), st.booleans())
def test_promising_over_option_rows_keeps_what_the_loop_keeps(seed, schedules, weight, with_links):
    """promising over the options' rows (one array, the path the planner takes) keeps exactly the options its loop
    over Option tuples keeps, in the same order, for any bounds, schedules, fill weight and links: the same float
    operations, column by column (including options outside [0, L) or fitting nowhere, and m = 1). The bounds are
    drawn among the options' own floors, where the tests decide."""
    import numpy as np

    from tangram_launch.planner.cover_floors import promising

    options, link, L, m, K = _instance(seed, max_layers=12)  # (up to 12 layers per stage: every chunk cap)
    if not options:
        return
    rng = random.Random(seed)
    L = rng.choice([L, max(1, L - 1)])  # (L - 1: the options ending at L lie outside the model)
    idx = sorted(rng.sample(range(len(options)), rng.randint(1, len(options))))
    rows = np.array([options[i] for i in idx], dtype=np.float64)
    lk = link if with_links else None
    kw = dict(schedules=schedules, fill_weight=weight)
    closed = sorted({(m - 1) * o.bottleneck_s + L * o.time_s for o in options})
    score = sorted({m * o.bottleneck_s * rng.uniform(1, 2) + o.tail_s for o in options})
    bounds = [(1e-12, rng.choice(score)) for _ in range(4)] + [(rng.choice(closed), 1e-12) for _ in range(2)]
    bounds += [(rng.choice(closed), rng.choice(score)), (math.inf, rng.choice(score))]
    for c, s in bounds:
        assert promising(options, idx, L, m, c, s, lk, rows=rows, **kw) == promising(options, idx, L, m, c, s, lk,
                                                                                      **kw)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.booleans())
def test_compose_prepared_from_option_rows_is_the_same(seed, with_links):
    """compose's preparation from the options' rows (usable options by columns, each island's pair minima by
    row_minima) is the loop's: the same options, groups and bounds, and the same covers for every set of islands."""
    import numpy as np

    from tangram_launch.planner.compose import _prepare

    options, link, L, m, K = _instance(seed, max_layers=9)
    if not options:
        return
    rng = random.Random(seed)
    L = rng.choice([L, max(1, L - 1)])  # (L - 1: the options ending at L lie outside the model)
    rows = np.array(options, dtype=np.float64)
    mask = rng.randint(1, (1 << K) - 1) if K > 1 else 1
    lk = link if with_links else [[0.0] * K for _ in range(K)]
    want = _prepare(options, lk, L, m - 1, mask, None)
    got = _prepare(options, lk, L, m - 1, mask, None, rows)
    assert (got is None) == (want is None)
    if want is None:
        return
    assert got._replace(prefix=None, rows=None) == want._replace(prefix=None, rows=None)  # (rows: only got's)
    mine, theirs = got[5], want[5]
    assert mine.islands == theirs.islands
    for sub in range(1 << K):
        if not sub & ~mine.islands:
            assert mine(sub) == theirs(sub)
