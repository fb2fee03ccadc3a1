"""What the composer's DP leaves out before pareto_front sees it changes no state's front: an entry that one already
in its target state dominates (same tail and period, no more stages behind or fill: compose._seen) is not made,
and an option covered wherever it fits (compose._uncovered) is not offered. Checked against the DP without either,
state by state, in every kind of pass, and against brute force for the closed form's optimum."""
from __future__ import annotations

import math
import random

import pytest

from helpers_compose import random_options
import tangram_launch.planner.compose as kernel
from tangram_launch.planner.compose import ComposeStats, EdgeTimes, Option, compose
from tangram_launch.planner.reference import every_composition

STATE_FRONT = kernel._state_front  # (before any test patches it)


def _instance(rng: random.Random):
    """Options on 2-4 islands over 4-7 layers with few distinct tails and periods (so that entries tie in both and
    one option often covers another of its slice), and links that tie too."""
    L, K = rng.randint(4, 7), rng.randint(2, 4)
    m = rng.choice([3, 4, 8, 16])
    raw = random_options(rng, L, K, fits=[0, 1, 2, 3, 1 << 30], tail_max_s=2.0)
    raw += random_options(rng, L, K, fits=[1, 3, 1 << 30], tail_max_s=2.0)
    options = [o._replace(tail_s=rng.choice([0.0, 0.5, 1.0, o.tail_s]),
                          bottleneck_s=min(o.time_s, rng.choice([0.5, 1.0, o.bottleneck_s]))) for o in raw]
    link = [[0.0 if i == j else rng.choice([0.0, 0.25, rng.uniform(0, 1.0), math.inf]) for j in range(K)]
            for i in range(K)]
    edges = [(o.bottleneck_s * rng.uniform(0.3, 1.0), o.bottleneck_s * rng.uniform(0.3, 1.0)) for o in options]
    return options, link, L, m, K, edges


def _passes(rng: random.Random, best_s: float) -> list[dict]:
    """Keyword sets for _dp over its kinds of pass, bounds drawn around ``best_s`` (some prune, some not)."""
    out = []
    for complete, quantum, merge, rank, beam in [(True, 0.0, False, None, None), (False, 0.0, False, None, None),
                                                 (False, 0.05, False, None, None), (False, 0.0, True, None, None),
                                                 (False, 0.0, False, "order", None), (False, 0.0, False, None, 2)]:
        out.append(dict(beat=rng.choice([math.inf, best_s * rng.uniform(1.0, 1.3)]),
                        score_beat=rng.choice([math.inf, best_s * rng.uniform(0.5, 1.3)]),
                        schedules=rng.choice([("any",), ("plain",), ("interleaved",), ("plain", "interleaved")]),
                        fill_weight=rng.choice([0.0, 0.25, 0.5]), complete=complete, quantum=quantum,
                        merge_fronts=merge, rank=rank, beam=beam, max_stages=rng.choice([None, 3, 6]),
                        edge=rng.random() < 0.7, vector_at=rng.choice([1, 4, 1 << 30])))
    return out


def _run(instance, kw: dict, monkeypatch, counts: dict):
    """_dp's candidates, states counted and every state's front as _state_front leaves it, in order; ``counts``
    gains the entries gathered in the states before their fronts (where entries dominate: not a complete pass)."""
    options, link, L, m, K, edges = instance
    monkeypatch.setattr(kernel, "_VECTOR_AT", kw["vector_at"])
    fronts = []

    def recorded(run, layer, key):
        counts["gathered"] += 0 if run.complete else len(layer[key])
        front = STATE_FRONT(run, layer, key)
        fronts.append((key, list(layer[key])))
        return front

    monkeypatch.setattr(kernel, "_state_front", recorded)
    prep = kernel._prepare(options, link, L, m - 1, (1 << K) - 1, kw["max_stages"])
    if prep is None:
        return None
    stats = ComposeStats()
    found = kernel._dp(options, prep, link, L, m, 0, kw["max_stages"], kw["beat"], stats,
                       rank=list(range(K)) if kw["rank"] == "order" else None, beam=kw["beam"], quantum=kw["quantum"],
                       score_beat=kw["score_beat"], fill_weight=kw["fill_weight"], schedules=kw["schedules"],
                       merge_fronts=kw["merge_fronts"], edge_s=EdgeTimes.of(edges) if kw["edge"] else None,
                       complete=kw["complete"])
    return found, stats.states, fronts


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_entries_and_options_left_out_before_the_fronts_leave_every_front_the_same(seed, monkeypatch):
    """Every kind of pass leaves the same front in every state (the same entries, in the same order, pointing at
    the same parents), as many states and the same candidates, with and without what the DP leaves out before
    pareto_front; and it left out many entries and options (not vacuous)."""
    rng = random.Random(5100 + seed)
    seen, uncovered, by_floor = kernel._seen, kernel._uncovered, kernel._by_floor
    with_cut, without = {"gathered": 0}, {"gathered": 0}
    options_left = {"n": 0}

    def counted_uncovered(options, idx, floor_terms, cache):
        out = uncovered(options, idx, floor_terms, cache)
        options_left["n"] += len(idx) - len(out[0])
        return out

    def every_option(options, idx, floor_terms, cache):
        return idx, by_floor(options, idx, None, floor_terms, cache)[2]

    compared = 0
    for _ in range(30):
        instance = _instance(rng)
        closed = [c.latency_s for c in every_composition(*instance[:4])]
        if not closed:
            continue
        for kw in _passes(rng, min(closed)):
            monkeypatch.setattr(kernel, "_seen", seen)
            monkeypatch.setattr(kernel, "_uncovered", counted_uncovered)
            cut = _run(instance, kw, monkeypatch, with_cut)
            monkeypatch.setattr(kernel, "_seen", lambda run, start, tkey: None)
            monkeypatch.setattr(kernel, "_uncovered", every_option)
            plain = _run(instance, kw, monkeypatch, without)
            assert cut == plain, kw
            compared += cut is not None and bool(cut[0])
    assert compared > 50
    assert without["gathered"] - with_cut["gathered"] > 300, (with_cut, without)
    assert options_left["n"] > 500


@pytest.mark.parametrize("seed", range(3))
def test_the_merged_and_exact_searches_still_find_the_brute_force_optimum(seed):
    """compose's closed-form optimum (no score) equals the least closed form of every composition, with merged
    fronts and without, on instances where entries and options tie often."""
    rng = random.Random(5200 + seed)
    checked = 0
    for _ in range(25):
        options, link, L, m, K, _ = _instance(rng)
        every = every_composition(options, link, L, m)
        if not every:
            continue
        best = min(c.latency_s for c in every)
        for merge in (False, True):
            comp = compose(options, link, L, m, merge_fronts=merge)
            assert comp is not None and math.isclose(comp.latency_s, best, rel_tol=1e-12), (merge, comp, best)
            checked += 1
    assert checked > 20


def test_an_option_covered_wherever_it_fits_is_not_offered():
    """Of two options of one slice and island, the one no faster in anything and with no more room is offered in
    front of no entry (its covered room is the other's, at least its own), and the faster one stays."""
    fast = Option(0, 2, 0, 1, 5, 1.0, 1.0, 0.0)
    slow = Option(0, 2, 0, 1, 3, 2.0, 1.5, 0.0)
    lean = Option(0, 2, 0, 1, 9, 2.0, 1.5, 0.0)  # slower, but fits where ``fast`` does not
    options = [fast, slow, lean]
    order, rooms = kernel._uncovered(options, [0, 1, 2], (), {})
    assert order == [0, 2] and rooms == [-1, 5]
