"""planner/bounds.py's floors against brute force (reference.every_composition on small random instances), and the
slice bounds' scalar and array forms against each other. The other rows of bounds.py's table are checked where
their search is (the table names each test)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import capabilities_for
from tangram_launch.costmodel.interleaved_schedule import simulated_interleaved_1f1b_s
from tangram_launch.costmodel.pipeline import simulated_1f1b_s
from tangram_launch.planner.bounds import (beyond, beyond_array, beyond_each, beyond_floors, chain_score_floor_s,
                                           latency_floor_of, lower_bound, score_floor_of, slack_cut)
from tangram_launch.planner.compose import Option
from tangram_launch.planner.reference import every_composition

from helpers_compose import scheduled


def _instance(rng: random.Random):
    """A small random option set: up to 6 layers, 3 islands, options of 1-3 stages, links between islands."""
    L, K = rng.randint(1, 6), rng.randint(1, 3)
    m = rng.choice([1, 2, 3, 4, 8])
    options = []
    for a in range(L):
        for b in range(a + 1, L + 1):
            for k in range(K):
                for _ in range(rng.choice([0, 1, 2])):
                    ns = rng.choice([1, 2, 3])
                    bn = rng.uniform(0.1, 2.0) * (b - a) / ns
                    options.append(Option(a, b, k, ns, rng.choice([-1, 0, 2, 1 << 30]), bn * rng.uniform(1.0, ns),
                                          bn, rng.choice([0.0, rng.uniform(0, 3)])))
    link = [[0.0 if i == j else rng.choice([0.0, rng.uniform(0, 1.5)]) for j in range(K)] for i in range(K)]
    return options, link, L, m


@pytest.mark.parametrize("seed", range(4))
def test_lower_bound_is_under_every_composition(seed):
    """lower_bound (an option set is tried, or skipped, by it) lies under the closed form of every composition of
    the set, and is reached by some instance's optimum (it is not vacuous)."""
    rng = random.Random(seed)
    compositions = tight = 0
    for _ in range(120):
        options, link, L, m = _instance(rng)
        floor = lower_bound(options, L, m)
        every = every_composition(options, link, L, m)
        compositions += len(every)
        for c in every:
            assert floor <= c.latency_s * (1 + 1e-12), (seed, floor, c)
        if every and floor == pytest.approx(min(c.latency_s for c in every), rel=1e-12):
            tight += 1
    assert compositions > 100 and tight > 0


@pytest.mark.parametrize("seed", range(4))
def test_a_slice_plans_floors_are_under_every_pipeline_holding_it(seed):
    """An option's own (m - 1) x bottleneck + time + tail and m x bottleneck + tail (the slice floors a parallelizer
    drops a plan by) lie under the closed form, and under the plain 1F1B simulation and the interleaved iteration of
    every composition holding it (helpers_compose.scheduled: stage times consistent with each option's numbers)."""
    rng = random.Random(100 + seed)
    held = 0
    for _ in range(80):
        options, link, L, m = _instance(rng)
        score = scheduled(options, link, m)
        for c in every_composition(options, link, L, m):
            sim = score(c.options, c.metrics)
            for oi in c.options:
                o = options[oi]
                held += 1
                assert latency_floor_of(o.bottleneck_s, o.time_s, o.tail_s, m) <= c.latency_s * (1 + 1e-12)
                assert score_floor_of(o.bottleneck_s, o.tail_s, m) <= sim * (1 + 1e-12)
    assert held > 100


@given(st.lists(st.tuples(st.floats(0, 1e3), st.floats(0, 1e3), st.floats(0, 1e3)), min_size=1, max_size=20),
       st.integers(1, 64), st.floats(0, 1e5), st.floats(0, 1e5))
@settings(max_examples=200, deadline=None)
def test_the_array_forms_give_the_scalar_forms_answers_bit_for_bit(rows, m, lat_bound, score_bound):
    """latency_floor_of / score_floor_of over arrays are the scalar floors element by element (the same float
    operations), and beyond_array is beyond per element at the same cuts (and beyond_floors, the fused scalar form,
    and beyond_each, its form over lists)."""
    bn, fill, tail = (np.array(col, dtype=np.float64) for col in zip(*rows))
    lat, score = latency_floor_of(bn, fill, tail, m), score_floor_of(bn, tail, m)
    lat_cut, score_cut = slack_cut(lat_bound), slack_cut(score_bound)
    got = beyond_array(lat, score, lat_cut, score_cut)
    for i, (b, f, t) in enumerate(rows):
        assert lat[i] == latency_floor_of(b, f, t, m) and score[i] == score_floor_of(b, t, m)
        assert bool(got[i]) == beyond(latency_floor_of(b, f, t, m), score_floor_of(b, t, m), lat_cut, score_cut)
        assert bool(got[i]) == beyond_floors(b, f, t, m, lat_cut, score_cut)
    assert beyond_each(*map(list, zip(*rows)), m, lat_cut, score_cut) == [bool(x) for x in got]


def test_a_floor_that_ties_a_bound_up_to_rounding_is_not_beyond_it():
    assert not beyond(1.0 + 1e-12, 1.0 + 1e-12, slack_cut(1.0), slack_cut(1.0))
    assert beyond(1.0 + 1e-6, 1.0 + 1e-6, slack_cut(1.0), slack_cut(1.0))
    assert not beyond(1.0 + 1e-6, 0.5, slack_cut(1.0), slack_cut(1.0))  # the score can still beat its bound


@pytest.mark.slow
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10), st.floats(0, 3)), min_size=1, max_size=8),
       st.integers(1, 24), st.integers(2, 8), st.floats(0, 5))
@settings(max_examples=300, deadline=None)
def test_one_micro_batch_chain_is_under_every_schedules_score(stages, m, v, tail_s):
    """chain_score_floor_s(m x the slowest stage, the stages' forward + backward seconds) lies under the plain 1F1B
    simulation and, where the runtime may interleave (m a multiple of the stages), under the interleaved
    prediction (its event simulation): what lets a micro-batch size with few micro-batches be skipped by its
    compute alone."""
    fwd = [f for f, _b, _p in stages]
    bwd = [b for _f, b, _p in stages]
    p2p = [p for _f, _b, p in stages[:-1]]
    times = [f + b for f, b in zip(fwd, bwd)]
    floor = chain_score_floor_s(m * max(times), sum(times))
    assert floor <= (simulated_1f1b_s(fwd, bwd, p2p, m) + tail_s) * (1 + 1e-12)
    S = len(stages)
    if S > 1 and m % S == 0:
        assert floor <= (simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, v) + tail_s) * (1 + 1e-12)


@pytest.mark.parametrize("runtime", ["torch", "megatron"])
def test_interleaving_needs_the_micro_batches_to_be_a_multiple_of_the_stages(runtime):
    """What the interleaved simulation (and so chain_score_floor_s's interleaved case) assumes: each runtime that
    interleaves refuses m not a multiple of S."""
    caps = capabilities_for(runtime)
    assert "interleaved-1F1B" in caps.schedules
    assert caps.schedule_problems("interleaved-1F1B", num_stages=4, num_microbatches=6)
    assert caps.schedule_problems("interleaved-1F1B", num_stages=4, num_microbatches=2)
    assert not caps.schedule_problems("interleaved-1F1B", num_stages=4, num_microbatches=8)


@given(st.lists(st.tuples(st.floats(0.01, 10), st.floats(0.01, 10), st.floats(0, 3)), min_size=2, max_size=6),
       st.integers(1, 24), st.sampled_from(["auto", "interleaved-1F1B"]), st.floats(0, 5))
@settings(max_examples=60, deadline=None)
def test_the_schedule_the_plan_reports_lies_above_the_compute_chain(stages, m, schedule, tail_s):
    """chain_score_floor_s under the schedule build_plan reports (interleave.choose_virtual_stages, given the plain
    1F1B simulation as the plain prediction), whatever it counts the interleaved pipeline as: the same claim as
    above, through the function that chooses."""
    from tangram_launch.capabilities import StageShape
    from tangram_launch.islands import build_islands
    from tangram_launch.parallelizers.base import StageCost
    from tangram_launch.planner.interleave import choose_virtual_stages
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.training import TrainingSpec

    cluster = ClusterSpec.from_dict({"name": "one", "network": {"default": {"bandwidth_GBps": 50, "latency_us": 2}},
                                     "nodes": [{"name": "n0", "gpu": "a100-80gb", "count": 8}]})
    island = build_islands(cluster, dtype="bf16").islands[0]
    fwd = [f for f, _b, _p in stages]
    bwd = [b for _f, b, _p in stages]
    p2p = [p for _f, _b, p in stages[:-1]]
    times = [f + b for f, b in zip(fwd, bwd)]
    costs = [(StageCost(layers=(8 * k, 8 * k + 8), shape=StageShape(), micro_batch_size=1, forward_s=f,
                        backward_s=b, static_bytes=0.0, activation_bytes=0.0), island)
             for k, (f, b) in enumerate(zip(fwd, bwd))]
    choice = choose_virtual_stages(costs, num_microbatches=m, period_s=max(times + p2p),
                                   fill_s=sum(times) + 2.0 * sum(p2p), tail_s=tail_s, schedule=schedule,
                                   capabilities=capabilities_for("megatron"),
                                   training=TrainingSpec(global_batch=m, seq_len=128, dtype="bf16"),
                                   plain_latency_s=simulated_1f1b_s(fwd, bwd, p2p, m) + tail_s)
    assert chain_score_floor_s(m * max(times), sum(times)) <= choice.latency_s * (1 + 1e-12)
