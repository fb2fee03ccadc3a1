"""The 1F1B models in costmodel/pipeline.py: the planner's formula and the event simulation the timeline draws,
how they relate, and a timeline whose title and bars say the same numbers (interleaved plans too)."""
from __future__ import annotations

import json
import os
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.pipeline import cycle_floor_1f1b_s, pipeline_latency_s, simulate_1f1b, simulated_1f1b_s
from tangram_launch.costmodel.interleaved_schedule import simulate_interleaved_1f1b
from tangram_launch.draw import Text, timeline_items
from tangram_launch.plan import Plan

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "plans")


def _end(blocks) -> float:
    return max(b.end_s for b in blocks)


@pytest.mark.parametrize("stages,m", [(1, 1), (1, 5), (3, 1), (4, 8), (5, 3)])
def test_equal_stages_without_links_take_m_plus_s_minus_1_slots_in_both_models(stages, m):
    f, b = 0.3, 0.7
    blocks = simulate_1f1b([f] * stages, [b] * stages, [0.0] * (stages - 1), m)
    formula = pipeline_latency_s(m, f + b, stages * (f + b), 0.0)
    assert _end(blocks) == pytest.approx(formula) == pytest.approx((m + stages - 1) * (f + b))


def test_the_formula_bounds_the_simulated_schedule_when_links_are_free():
    rng = random.Random(7)
    for _ in range(200):
        S, m = rng.randint(1, 5), rng.randint(1, 12)
        f = [rng.uniform(0.1, 1.0) for _ in range(S)]
        b = [x * rng.uniform(1.5, 2.5) for x in f]
        period = max(x + y for x, y in zip(f, b))
        formula = pipeline_latency_s(m, period, sum(f) + sum(b), 0.0)
        assert _end(simulate_1f1b(f, b, [0.0] * (S - 1), m)) <= formula * (1 + 1e-12)


def test_simulation_keeps_every_stage_busy_with_one_block_at_a_time_and_respects_dependencies():
    f, b, p2p, m = [0.2, 0.5, 0.3], [0.4, 1.0, 0.6], [0.05, 0.02], 6
    blocks = simulate_1f1b(f, b, p2p, m)
    assert len(blocks) == 2 * 3 * m
    for k in range(3):
        mine = sorted((x for x in blocks if x.stage == k), key=lambda x: x.start_s)
        assert all(a.end_s <= c.start_s + 1e-12 for a, c in zip(mine, mine[1:]))
    at = {(x.kind, x.stage, x.micro): x for x in blocks}
    for i in range(m):
        for k in range(1, 3):
            assert at[("F", k, i)].start_s >= at[("F", k - 1, i)].end_s + p2p[k - 1] - 1e-12
            assert at[("B", k - 1, i)].start_s >= at[("B", k, i)].end_s + p2p[k - 1] - 1e-12


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(FIXTURES) if f.endswith(".json")))
def test_timeline_title_and_bars_say_the_same_iteration_time(name):
    """Every example plan's timeline: the title is the plan's predicted iteration time, and the bars (last block +
    DP sync/optimizer) end there, because both are the one simulation of the schedule the plan runs: plain 1F1B,
    or interleaved 1F1B chunk by chunk (the README's C3 (iii) example is one)."""
    with open(os.path.join(FIXTURES, f"{name}.json"), encoding="utf-8") as f:
        plan = Plan.from_dict(json.load(f))
    items, _, _ = timeline_items(plan)
    texts = [it.text for it in items if isinstance(it, Text)]
    title = next(t for t in texts if " iteration " in t)
    assert f"{plan.predicted.iteration_time_s:.3f} s" in title
    schedule = "interleaved 1F1B" if plan.virtual_stages > 1 else "1F1B"
    assert f"predicted {schedule} iteration" in title  # the schedule the prediction is of
    note = next(t for t in texts if t.startswith("bars: "))
    assert note.startswith(f"bars: the simulated {schedule} schedule the prediction comes from")
    assert "is not this simulation" not in note
    drawn = float(re.search(r"ends at ([0-9.]+) s", note).group(1))
    assert drawn == pytest.approx(plan.predicted.iteration_time_s, abs=5e-4)


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(FIXTURES) if f.endswith(".json")))
def test_every_example_plans_prediction_is_the_simulation_of_its_stage_times(name):
    with open(os.path.join(FIXTURES, f"{name}.json"), encoding="utf-8") as f:
        plan = Plan.from_dict(json.load(f))
    fwd = [p.forward_s for p in plan.predicted.stages]
    bwd = [p.backward_s for p in plan.predicted.stages]
    tail = plan.predicted.breakdown["tail_s"]
    end = _end(simulate_1f1b(fwd, bwd, plan.planner["p2p_s"], plan.num_microbatches))
    if plan.virtual_stages > 1:
        # interleaved plans are predicted by the simulation of their chunks; the plain 1F1B figure they beat is the
        # simulation of the same stages
        chunked = _end(simulate_interleaved_1f1b(fwd, bwd, plan.planner["p2p_s"], plan.num_microbatches,
                                                 plan.virtual_stages))
        assert plan.predicted.iteration_time_s == chunked + tail
        assert plan.planner["plain_1f1b_iteration_s"] == pytest.approx(end + tail, rel=1e-12)
        assert plan.predicted.iteration_time_s < plan.planner["plain_1f1b_iteration_s"]
        return
    assert plan.predicted.iteration_time_s == pytest.approx(end + tail, rel=1e-12)
    assert simulated_1f1b_s(fwd, bwd, plan.planner["p2p_s"], plan.num_microbatches) == end


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 16).flatmap(lambda S: st.tuples(
    st.lists(st.floats(0.0, 2.0), min_size=S, max_size=S), st.lists(st.floats(0.0, 3.0), min_size=S, max_size=S),
    st.lists(st.sampled_from([0.0, 0.05, 0.7]), min_size=S - 1, max_size=S - 1), st.integers(1, 40))))
def test_the_shape_order_gives_the_simulations_end_bit_for_bit(case):
    """simulated_1f1b_s takes the ops in an order made from the schedule's shape instead of re-checking readiness
    round after round (the event simulation): the same float operations, so the same end to the last bit."""
    fwd, bwd, p2p, m = case
    end = max(b.end_s for b in simulate_1f1b(fwd, bwd, p2p, m))
    # the first call makes the shape's order, the next ones take the kept one
    assert [simulated_1f1b_s(fwd, bwd, p2p, m) for _ in range(2)] == [end] * 2


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 50))
def test_the_shape_order_runs_each_op_once_after_what_it_waits_for(S, m):
    """_order_1f1b lists each op of the 1F1B schedule once, each stage's in _run_1f1b's order for that stage, and
    every op after its dependency (the previous stage's forward, the next stage's backward, the last stage's own
    forward): the condition under which one pass gives every op's end."""
    from tangram_launch.costmodel.pipeline import _order_1f1b

    order = _order_1f1b.__wrapped__(S, m)
    assert sorted(o[0] for o in order) == list(range(2 * S * m))
    done = {2 * S * m}  # the slot stage 0's forwards wait for
    per_stage: dict[int, list] = {}
    for slot, k, op, dep, link in order:
        assert dep in done
        done.add(slot)
        forward = slot % 2 == 0
        i = slot // 2 - k * m
        assert (op, link) == ((k, k) if forward else (S + k, k + 1))
        per_stage.setdefault(k, []).append((forward, i))
    for k in range(S):  # _run_1f1b's op order of stage k
        warm = min(S - k - 1, m)
        want = [(True, i) for i in range(warm)]
        for i in range(m - warm):
            want += [(True, warm + i), (False, i)]
        want += [(False, i) for i in range(m - warm, m)]
        assert per_stage[k] == want


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 50).flatmap(lambda S: st.tuples(
    st.lists(st.floats(0.0, 2.0), min_size=S, max_size=S), st.lists(st.floats(0.0, 3.0), min_size=S, max_size=S),
    st.lists(st.sampled_from([0.0, 0.05, 0.7]), min_size=S - 1, max_size=S - 1), st.integers(1, 40))))
def test_level_by_level_simulation_gives_the_simulations_end_bit_for_bit(case):
    """_levels_1f1b (simulated_1f1b_s from _LEVELS_MIN_STAGES stages on) takes each level's ops at once with numpy:
    the same end as the event simulation to the last bit, for any number of stages."""
    from tangram_launch.costmodel.pipeline import _levels_1f1b, _run_1f1b

    fwd, bwd, p2p, m = case
    assert _levels_1f1b(fwd, bwd, p2p, m) == _run_1f1b(fwd, bwd, p2p, m, None)


def test_long_schedules_made_per_call_give_the_simulations_end():
    """Above _ORDER_MAX_OPS ops the order is made per call and not kept: the same end as the event simulation."""
    from tangram_launch.costmodel import pipeline

    S, m = 8, 4000
    assert 2 * S * m > pipeline._ORDER_MAX_OPS and S < pipeline._LEVELS_MIN_STAGES
    fwd = [0.01 + 0.001 * (k % 5) for k in range(S)]
    bwd = [2.1 * f for f in fwd]
    p2p = [0.0005 * (k % 3) for k in range(S - 1)]
    end = pipeline._run_1f1b(fwd, bwd, p2p, m, None)
    kept = pipeline._order_1f1b.cache_info()
    assert simulated_1f1b_s(fwd, bwd, p2p, m) == end
    after = pipeline._order_1f1b.cache_info()
    assert (after.hits, after.misses) == (kept.hits, kept.misses)  # not looked up, not kept


@settings(max_examples=300, deadline=None)
@given(S=st.integers(1, 14), m=st.sampled_from([1, 2, 3, 4, 5, 8, 16, 33, 64]), seed=st.integers(0, 2 ** 32 - 1))
def test_the_round_trip_floor_lies_under_the_simulation(S, m, seed):
    """cycle_floor_1f1b_s is a path of the 1F1B schedule's dependencies, so the simulation can never end before
    it, whatever the stage times and links (some links slower than every stage)."""
    rng = random.Random(seed)
    fwd = [rng.uniform(0.01, 1.0) for _ in range(S)]
    bwd = [f * rng.uniform(1.0, 3.0) for f in fwd]
    p2p = [rng.choice([0.0, rng.uniform(0.0, 0.2), rng.uniform(0.5, 3.0)]) for _ in range(S - 1)]
    assert cycle_floor_1f1b_s(fwd, bwd, p2p, m) <= simulated_1f1b_s(fwd, bwd, p2p, m) * (1 + 1e-12)


def test_the_round_trip_floor_sees_a_slow_link_the_slowest_stage_does_not():
    """Eight even stages and one slow link in the middle: every micro-batch pays the round trip over it, and the
    floor (which the planner uses to skip simulating candidates that cannot win) says so: within 10 % of the
    simulation, where m x the slowest stage and the fill lie far under it."""
    fwd, bwd, m = [1.0] * 8, [2.0] * 8, 64
    p2p = [0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0]
    sim = simulated_1f1b_s(fwd, bwd, p2p, m)
    floor = cycle_floor_1f1b_s(fwd, bwd, p2p, m)
    naive = m * 3.0 + sum(fwd) + sum(bwd) + 2 * sum(p2p)
    assert naive < 0.6 * sim
    assert 0.9 * sim <= floor <= sim
