"""The composer's speed work on the 4,096-GPU row changes no answer: covered_rooms keeps fewer earlier options to scan
(one that another covers with no less room stands for nothing new) and gives the rooms of the brute force, and the
DP reads its groups' columns from the prepared set's rows (where the caller gives them) with the same kept options
and rooms as its loop."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers_compose import composable_instances, hopeful_on_both_paths, many_options_instance
import tangram_launch.planner.compose as kernel
from tangram_launch.planner.compose import ComposeStats, EdgeTimes, Option
from tangram_launch.planner.dominance import covered_rooms


def _rooms_by_brute_force(options, order):
    """Per option in ``order``: the largest max_after of an earlier option of the same start with no more time,
    tail, stages and bottleneck (-1: none)."""
    out = []
    for i, oi in enumerate(order):
        o = options[oi]
        room = -1
        for oj in order[:i]:
            e = options[oj]
            if e.start == o.start and e.time_s <= o.time_s and e.tail_s <= o.tail_s \
                    and e.num_stages <= o.num_stages and e.bottleneck_s <= o.bottleneck_s:
                room = max(room, e.max_after)
        out.append(room)
    return out


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60), starts=st.integers(1, 3), values=st.integers(1, 4))
def test_covered_rooms_are_the_brute_forces(seed, n, starts, values):
    """covered_rooms over a group whose options tie often (few distinct values of each field, so that many cover
    each other with more, as much or less room) gives every option the brute force's room, in any order."""
    rng = random.Random(seed)
    grid = [0.5 * k for k in range(1, values + 1)]
    options = [Option(rng.randrange(starts), 9, 0, rng.randint(1, values), rng.choice([-1, 0, 1, 2, 3, 1 << 30]),
                      rng.choice(grid), rng.choice(grid), rng.choice(grid)) for _ in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    assert covered_rooms(options, order) == _rooms_by_brute_force(options, order)


def test_an_option_covered_with_no_less_room_still_passes_its_room_on():
    """The option that covers a skipped one (room >= its max_after) gives the later options that the skipped one
    would cover the same room: the first covers the third through the second."""
    options = [Option(0, 4, 0, 1, 5, 1.0, 1.0, 0.0), Option(0, 4, 0, 2, 3, 2.0, 1.5, 0.0),
               Option(0, 4, 0, 3, 9, 3.0, 2.0, 0.0)]
    assert covered_rooms(options, [0, 1, 2]) == [-1, 5, 5]


_instance = many_options_instance


@pytest.mark.parametrize("seed", range(3))
def test_hopeful_options_read_from_rows_are_those_of_the_loop(seed, monkeypatch):
    """_hopeful's numpy path with the prepared set's rows (the driver's case: columns gathered from them) keeps the
    same options and rooms, in the same order, as its loop, on every call the DP makes, and the DP returns the same
    candidates with rows as without; the numpy path dropped options on many calls (not vacuous)."""
    rng = random.Random(4096 + seed)
    seen = hopeful_on_both_paths(kernel, monkeypatch)
    for options, link, L, m, K, edges, closed in composable_instances(rng, 40):
        rows = np.array([tuple(o) for o in options], dtype=np.float64)
        for complete in (False, True):
            kw = dict(score_beat=min(closed) * rng.uniform(0.8, 2.0), fill_weight=0.25,
                      schedules=rng.choice([("plain",), ("plain", "interleaved")]), complete=complete,
                      edge_s=EdgeTimes.of(edges))
            found = []
            for given_rows in (rows, None):
                prep = kernel._prepare(options, link, L, m - 1, (1 << K) - 1, None, given_rows)
                found.append(kernel._dp(options, prep, link, L, m, 0, None, math.inf if complete
                                        else min(closed) * 1.2, ComposeStats(), **kw))
            assert found[0] == found[1]
    assert seen["calls"] > 200 and seen["dropping"] > 50


def _fronts(instance, kw: dict, vector_at: int, monkeypatch) -> list:
    """Every state's _Front as _state_front returns it (without the columns), in order, and _dp's candidates, with
    states of ``vector_at`` entries or more reduced in numpy."""
    options, link, L, m, K, edges = instance
    monkeypatch.setattr(kernel, "_VECTOR_AT", vector_at)
    fronts = []

    def recorded(run, layer, key):
        front = state_front(run, layer, key)
        fronts.append(None if front is None else tuple(front)[:6])
        return front

    state_front = kernel._state_front
    monkeypatch.setattr(kernel, "_state_front", recorded)
    try:
        prep = kernel._prepare(options, link, L, m - 1, (1 << K) - 1, None)
        found = kernel._dp(options, prep, link, L, m, 0, None, kw["beat"], ComposeStats(), rank=kw["rank"],
                           score_beat=kw["score_beat"], fill_weight=kw["fill_weight"], schedules=kw["schedules"],
                           complete=kw["complete"], edge_s=EdgeTimes.of(edges) if kw["edge"] else None)
    finally:
        monkeypatch.setattr(kernel, "_state_front", state_front)
    return [fronts, found]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_big_states_get_the_same_running_minima_in_numpy(seed, monkeypatch):
    """_state_front's stages behind and running minima (least fill + tail, fill, plain_s, first-stage time) are the
    same whether a state is reduced in numpy (_front_at_once) or by its loop, in every kind of pass, and the DP
    returns the same candidates; many states went through numpy with entries in them (not vacuous)."""
    rng = random.Random(4196 + seed)
    big = 0
    for options, link, L, m, K, edges, closed in composable_instances(rng, 25):
        instance = options, link, L, m, K, edges
        for complete in (False, True):
            kw = dict(beat=math.inf if complete else min(closed) * rng.uniform(1.0, 1.3),
                      score_beat=rng.choice([math.inf, min(closed) * rng.uniform(0.8, 2.0)]),
                      fill_weight=rng.choice([0.0, 0.25]), complete=complete, edge=rng.random() < 0.7,
                      schedules=rng.choice([("any",), ("plain",), ("plain", "interleaved")]),
                      rank=rng.choice([None, list(range(K))]))
            loop, at_once = _fronts(instance, kw, 1 << 30, monkeypatch), _fronts(instance, kw, 1, monkeypatch)
            assert loop == at_once, kw
            big += sum(1 for f in at_once[0] if f is not None and len(f[0]) > 1)
    assert big > 100


@pytest.mark.parametrize("seed", range(3))
def test_groups_ordered_by_floor_in_numpy_are_ordered_as_by_the_loop(seed, monkeypatch):
    """_by_floor orders every group of options, under every set of free islands in front, the same (options,
    floors, covered rooms) in numpy as by sorting in Python, m = 1 (no steady state) included; many groups had
    distinct floors to order (not vacuous)."""
    rng = random.Random(4296 + seed)
    ordered = 0
    for _ in range(30):
        options, link, L, m, K, _ = _instance(rng)
        m = rng.choice([1, m])
        answers = []
        for vector_at in (1 << 30, 1):
            monkeypatch.setattr(kernel, "_VECTOR_AT", vector_at)
            prep = kernel._prepare(options, link, L, m - 1, (1 << K) - 1, None)
            if prep is None:
                break
            terms = (m - 1, prep.period_lb, prep.prefix, link)
            answers.append([kernel._by_floor(options, gidx, mask, terms, prep.cache)
                            for groups in prep.by_stop for _, _, gidx in groups for mask in range(1 << K)])
        if len(answers) == 2:
            assert answers[0] == answers[1]
            ordered += sum(len(set(floors)) > 1 for _, floors, _ in answers[0])
    assert ordered > 100


@settings(max_examples=200, deadline=None)
@given(sub=st.lists(st.integers(0, 6), max_size=8), searched=st.lists(st.integers(0, 6), max_size=8))
def test_a_class_is_searched_before_iff_each_of_its_options_was(sub, searched):
    """class_composition._all_in is set(sub) <= set(searched), with repeats and empty lists."""
    from tangram_launch.planner.class_composition import _all_in

    as_options = [Option(k, k + 1, 0, 1, 0, 1.0, 1.0, 0.0) for k in range(7)]
    sub_o, searched_o = [as_options[k] for k in sub], [as_options[k] for k in searched]
    assert _all_in(sub_o, searched_o) == (set(sub_o) <= set(searched_o))


def test_edge_times_are_made_once_per_prepared_set_and_edge_list():
    """compose's EdgeTimes of a prepared set: the same as EdgeTimes.of, made once for one edge list and again for
    another (a driver's next class brings its own)."""
    options = [Option(0, 2, 0, 1, 5, 1.0, 1.0, 0.0), Option(0, 2, 1, 1, 5, 2.0, 2.0, 0.0)]
    prep = kernel._prepare(options, [[0.0, 1.0], [1.0, 0.0]], 2, 3, 3, None)
    edges = [(0.4, 0.6), (0.9, 1.1)]
    first = kernel._edge_times(prep, edges)
    assert first == EdgeTimes.of(edges) and kernel._edge_times(prep, edges) is first
    other = [(0.5, 0.5), (1.0, 1.0)]
    assert kernel._edge_times(prep, other) == EdgeTimes.of(other)
