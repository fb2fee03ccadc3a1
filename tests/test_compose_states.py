"""The composer's DP makes the same entries whether an option goes in front of a state's entries one by one
(_add_entries' loop) or all at once in numpy (_entries_at_once, for options in front of many entries): the same
floats, so the same entries kept, in the same order, in every kind of pass (quick, exact, complete; closed form,
plain and interleaved score floors; cycle floors with edge times; island orders; merged fronts; bucketed periods)."""
from __future__ import annotations

import math
import random

import pytest

from helpers_compose import composable_instances, hopeful_on_both_paths
import tangram_launch.planner.compose as kernel
from tangram_launch.planner.compose import ComposeStats, EdgeTimes


def _passes(rng: random.Random, best_s: float):
    """Keyword sets for _dp covering its kinds of pass, bounds drawn around ``best_s`` (some prune, some not)."""
    schedules = rng.choice([("any",), ("plain",), ("interleaved",), ("plain", "interleaved")])
    beat = rng.choice([math.inf, best_s * rng.uniform(1.0, 1.3)])
    score_beat = rng.choice([math.inf, best_s * rng.uniform(0.5, 1.3), best_s * rng.uniform(0.9, 1.1)])
    return [dict(beat=beat, score_beat=score_beat, schedules=schedules, fill_weight=rng.choice([0.0, 0.25, 0.5]),
                 complete=complete, quantum=quantum, merge_fronts=merge, rank=rank, beam=beam,
                 max_stages=rng.choice([None, 3, 6]), edge=rng.random() < 0.7)
            for complete, quantum, merge, rank, beam in [(True, 0.0, False, None, None),
                                                         (False, 0.0, False, None, None),
                                                         (False, 0.05, False, None, None),
                                                         (False, 0.0, True, None, None),
                                                         (False, 0.0, False, "order", None),
                                                         (False, 0.0, False, None, 2)]]


def _run(options, link, L, m, K, edges, kw, vector_at, monkeypatch, front_of_state):
    """_dp's candidates (in order) and every state's entries as made (before any is dropped as dominated), with
    options put in front of ``vector_at`` entries or more at once."""
    monkeypatch.setattr(kernel, "_VECTOR_AT", vector_at)
    made = []

    def state_front(run, layer, key):
        made.append((key, list(layer[key])))
        return front_of_state(run, layer, key)

    monkeypatch.setattr(kernel, "_state_front", state_front)
    prep = kernel._prepare(options, link, L, m - 1, (1 << K) - 1, kw["max_stages"])
    if prep is None:
        return None
    stats = ComposeStats()
    rank = list(range(K)) if kw["rank"] == "order" else None
    found = kernel._dp(options, prep, link, L, m, 0, kw["max_stages"], kw["beat"], stats, rank=rank, beam=kw["beam"],
                       quantum=kw["quantum"], score_beat=kw["score_beat"], fill_weight=kw["fill_weight"],
                       schedules=kw["schedules"], merge_fronts=kw["merge_fronts"],
                       edge_s=EdgeTimes.of(edges) if kw["edge"] else None, complete=kw["complete"])
    return found, stats.states, made


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_options_put_in_front_at_once_make_the_same_entries_as_one_by_one(seed, monkeypatch):
    """Every kind of pass makes the same entries in every state and returns the same candidates, in the same
    order, from as many states, whether every option goes in front of its entries in numpy or none does; and the
    numpy path ran on many offers and kept and dropped entries (so the comparison is not vacuous)."""
    rng = random.Random(4100 + seed)
    front_of_state = kernel._state_front
    calls = {"offers": 0, "kept": 0, "dropped": 0}
    at_once = kernel._entries_at_once

    def counted(run, key, cols, group, offer, own_o):
        made = at_once(run, key, cols, group, offer, own_o)
        calls["offers"] += 1
        calls["kept"] += len(made)
        calls["dropped"] += offer[2] - offer[1] - len(made)
        return made

    monkeypatch.setattr(kernel, "_entries_at_once", counted)
    compared = 0
    for options, link, L, m, K, edges, closed in composable_instances(rng, 40):
        for kw in _passes(rng, min(closed)):
            one_by_one = _run(options, link, L, m, K, edges, kw, 1 << 30, monkeypatch, front_of_state)
            at_once_run = _run(options, link, L, m, K, edges, kw, 1, monkeypatch, front_of_state)
            assert one_by_one == at_once_run, kw
            compared += one_by_one is not None and bool(one_by_one[0])
    assert compared > 50
    assert calls["offers"] > 1000 and calls["kept"] > 1000 and calls["dropped"] > 1000


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_a_group_of_many_options_keeps_the_same_hopeful_options_in_numpy(seed, monkeypatch):
    """_hopeful's numpy path (groups of many options) keeps the same options and rooms, in the same order, as its
    loop, on every call the DP makes; and it drops options on many of them (not vacuous)."""
    rng = random.Random(4200 + seed)
    seen = hopeful_on_both_paths(kernel, monkeypatch)
    for options, link, L, m, K, edges, closed in composable_instances(rng, 40):
        for complete in (False, True):
            prep = kernel._prepare(options, link, L, m - 1, (1 << K) - 1, None)
            kernel._dp(options, prep, link, L, m, 0, None, math.inf if complete else min(closed) * 1.2,
                       ComposeStats(), score_beat=min(closed) * rng.uniform(0.8, 2.0), fill_weight=0.25,
                       schedules=rng.choice([("plain",), ("plain", "interleaved")]), complete=complete,
                       edge_s=EdgeTimes.of(edges))
    assert seen["calls"] > 200 and seen["dropping"] > 50
