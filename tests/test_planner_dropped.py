"""Reasons for dropped islands (planner/dropped.py): the floor under every plan using an island, against brute
force, and the reasons the planner words from it."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.planner.compose import Option
from tangram_launch.planner.cover_floors import island_floor_s
from tangram_launch.planner.reference import every_composition

NEVER = -1
ROOM = 1 << 30


def _instance(seed: int):
    rng = random.Random(seed)
    L = rng.randint(1, 6)
    K = rng.randint(1, 3)
    m = rng.choice([1, 2, 4, 8, 32])
    options = []
    for a in range(L):
        for b in range(a + 1, L + 1):
            for k in range(K):
                for _ in range(rng.choice([0, 1, 1, 2])):
                    ns = rng.choice([1, 1, 2, 3])
                    bn = rng.uniform(0.1, 2.0) * (b - a) / ns
                    options.append(Option(a, b, k, ns, rng.choice([NEVER, 0, 1, 2, 5, ROOM]), bn * rng.uniform(1, ns),
                                          bn, rng.choice([0.0, rng.uniform(0, 3)])))
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
    from tangram_launch.planner.compose import covers_of, pair_minima
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
    from tangram_launch.planner.api import _hopeful_islands

    # islands 0-2 hold each layer at 1, 1.5 and 2 s per micro-batch, island 3 at 10 s; m = 4. Floors: islands 0 and
    # 1: 4 x 1.5 + 0.1 (the other layer on the best other island), island 2: 4 x 2 + 0.1, island 3: 4 x 10 + 0.1
    options = [Option(0, 1, k, 1, ROOM, 1.0 + k / 2, 1.0 + k / 2, 0.1) for k in range(3)]
    options += [Option(1, 2, k, 1, ROOM, 1.0 + k / 2, 1.0 + k / 2, 0.1) for k in range(3)]
    options += [Option(0, 2, 3, 1, ROOM, 10.0, 10.0, 0.1), Option(1, 2, 3, 1, ROOM, 10.0, 10.0, 0.1)]
    assert _hopeful_islands(options, [0, 1, 2, 3], 0, 2, 4, 9.0) == [0, 1, 2]
    assert _hopeful_islands(options, [0, 1, 2, 3], 0, 2, 4, 6.2) == [0, 1]
    assert _hopeful_islands(options, [0, 1, 2, 3], 0, 2, 4, 6.1) == []  # a floor equal to the incumbent cannot beat it
    assert _hopeful_islands(options, [0, 1, 2, 3], 1 << 3, 2, 4, 6.2) == [0, 1, 3]  # a required island stays
    assert _hopeful_islands(options, [0, 1, 2, 3], 0, 2, 4, math.inf) == [0, 1, 2, 3]  # no incumbent yet


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
