"""An interleaved plan's prediction is the event simulation of the schedule the runtime runs
(costmodel/interleaved_schedule.py): the op order is torch's ScheduleInterleaved1F1B's, the fast sweep is the
simulation bit for bit, its floor holds for any timings (the closed form does not), and choosing the number of
chunks by floors picks what simulating every number would."""
from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.interleaved_schedule import (_order, _rank_order, interleaved_floor_s,
                                                           simulate_interleaved_1f1b, simulated_interleaved_1f1b_s)
from tangram_launch.costmodel.pipeline import pipeline_latency_s
from tangram_launch.planner.interleave import ScheduleChoice, fastest_virtual_stages

_SECONDS = st.one_of(st.just(0.0), st.floats(0.0, 4.0, allow_nan=False, allow_infinity=False, allow_subnormal=False))


@st.composite
def pipelines(draw, most_v: int = 5):
    """(forward, backward, p2p seconds, m, v): S ranks, m a multiple of S (as the runtimes require)."""
    S = draw(st.integers(1, 6))
    m = S * draw(st.integers(1, 4))
    v = draw(st.integers(2, most_v))
    fwd = draw(st.lists(_SECONDS, min_size=S, max_size=S))
    bwd = draw(st.lists(_SECONDS, min_size=S, max_size=S))
    p2p = draw(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 2.0, allow_subnormal=False)), min_size=S - 1,
                        max_size=S - 1))
    return fwd, bwd, p2p, m, v


@pytest.mark.parametrize("S, m, v", [(2, 4, 2), (4, 8, 3), (3, 12, 4), (1, 3, 2), (4, 4, 8)])
def test_each_ranks_op_order_is_torchs_interleaved_1f1b(S, m, v):
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    torch_schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)  # its order needs no stages
    torch_schedule.pp_group_size, torch_schedule.n_local_stages, torch_schedule._n_microbatches = S, v, m
    torch_schedule.number_of_rounds = max(1, m // S)
    torch_schedule.microbatches_per_round = m // torch_schedule.number_of_rounds
    for k in range(S):
        theirs = [(a.computation_type == _ComputationType.FORWARD, a.stage_index // S, a.microbatch_index)
                  for a in torch_schedule._calculate_single_rank_operations(k) if a is not None]
        nxt: dict = {}
        ours = []
        for forward, c in _rank_order(k, S, m, v):
            i = nxt[(forward, c)] = nxt.get((forward, c), -1) + 1
            ours.append((forward, c, i))
        assert ours == theirs
        assert all(a.stage_index % S == k for a in torch_schedule._calculate_single_rank_operations(k) if a)


@pytest.mark.parametrize("S", range(1, 9))
def test_the_lockstep_order_puts_every_op_after_what_it_waits_for(S):
    for m in (S, 2 * S, 3 * S, 4 * S):
        for v in range(2, 9):
            slots, ranks, ops, deps, _, chunks, _ = _order(S, m, v)
            done = {2 * S * v * m}  # the dependency of virtual stage 0's forwards
            for slot, dep in zip(slots, deps):
                assert dep in done, (S, m, v, slot)
                done.add(slot)
            assert len(done) == 2 * S * v * m + 1
            for k in range(S):  # each rank's ops in its own order
                assert [(op < S, c) for r, op, c in zip(ranks, ops, chunks) if r == k] == _rank_order(k, S, m, v)


def _reference(fwd, bwd, p2p, m, v) -> dict:
    """The schedule run the plain way: every rank advances through its order while what each op waits for has
    ended, round after round; (forward, virtual stage, micro-batch) -> end."""
    S = len(fwd)
    orders = [_rank_order(k, S, m, v) for k in range(S)]
    end: dict = {}
    pos, free, seen = [0] * S, [0.0] * S, [dict() for _ in range(S)]
    while any(p < len(o) for p, o in zip(pos, orders)):
        for k in range(S):
            while pos[k] < len(orders[k]):
                forward, c = orders[k][pos[k]]
                i = seen[k].get((forward, c), 0)
                vs = c * S + k
                if forward:
                    dep, link = ((True, vs - 1, i), p2p[k - 1] if k else 0.0) if vs else (None, 0.0)
                elif vs == v * S - 1:
                    dep, link = (True, vs, i), 0.0
                else:
                    dep, link = (False, vs + 1, i), (p2p[k] if k < S - 1 else 0.0)
                if dep is not None and dep not in end:
                    break
                start = max(free[k], end[dep] + link if dep is not None else 0.0)
                free[k] = end[(forward, vs, i)] = start + (fwd[k] if forward else bwd[k]) / v
                seen[k][(forward, c)] = i + 1
                pos[k] += 1
    return end


@settings(max_examples=100, deadline=None)
@given(pipelines())
def test_the_sweep_ends_every_op_where_the_plain_event_simulation_does(case):
    fwd, bwd, p2p, m, v = case
    S = len(fwd)
    got = {(b.kind == "F", b.chunk * S + b.stage, b.micro): b.end_s for b in simulate_interleaved_1f1b(
        fwd, bwd, p2p, m, v)}
    assert got == _reference(fwd, bwd, p2p, m, v)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(pipelines())
def test_the_sweep_is_the_simulation_bit_for_bit_and_runs_each_rank_in_its_order(case):
    fwd, bwd, p2p, m, v = case
    S = len(fwd)
    blocks = simulate_interleaved_1f1b(fwd, bwd, p2p, m, v)
    assert simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, v) == max(b.end_s for b in blocks)
    assert len(blocks) == 2 * S * m * v
    for k in range(S):
        mine = [b for b in blocks if b.stage == k]  # in the order the sweep ran them
        assert [(b.kind == "F", b.chunk) for b in mine] == _rank_order(k, S, m, v)
        assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:]))
        assert all(b.end_s - b.start_s == pytest.approx((fwd[k] if b.kind == "F" else bwd[k]) / v, abs=1e-12)
                   for b in mine)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(pipelines())
def test_the_floor_is_under_the_simulation_for_any_timings(case):
    fwd, bwd, p2p, m, v = case
    assert interleaved_floor_s(fwd, bwd, p2p, m, v) <= simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, v)


def test_the_floor_is_the_simulation_when_stages_are_equal():
    S, m, v, t = 4, 8, 2, 3.0
    sim = simulated_interleaved_1f1b_s([1.0] * S, [2.0] * S, [0.0] * (S - 1), m, v)
    assert sim == pytest.approx(m * t + (S - 1) * t / v)
    assert interleaved_floor_s([1.0] * S, [2.0] * S, [0.0] * (S - 1), m, v) == pytest.approx(sim, rel=1e-8)


def test_the_closed_form_is_no_floor_of_the_simulation_nor_a_ceiling():
    """A first stage slower than the rest never idles: the run is its m micro-batches, under the closed form's
    m x period + (the rest) / v. A link is crossed v times per micro-batch each way: above the closed form, which
    divides it by v."""
    fwd, bwd, m, v = [1.0, 0.5], [2.0, 1.0], 4, 2
    sim = simulated_interleaved_1f1b_s(fwd, bwd, [0.0], m, v)
    assert sim == m * 3.0 < pipeline_latency_s(m, 3.0, 4.5, 0.0, v)
    fwd, bwd, p2p = [1.0, 1.0], [2.0, 2.0], [1.0]
    sim = simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, v)
    assert sim > pipeline_latency_s(m, 3.0, 6.0 + 2.0, 0.0, v)


def _every_v(fwd, bwd, p2p, m, tail, most, beat, floor_only: bool = False) -> ScheduleChoice | None:
    """The reference: every v simulated (``floor_only``: every v's floor), the least below ``beat`` (the smaller v
    on ties)."""
    best = None
    for v in range(2, most + 1):
        t = (interleaved_floor_s if floor_only else simulated_interleaved_1f1b_s)(fwd, bwd, p2p, m, v) + tail
        if t < beat and (best is None or t < best.latency_s):
            best = ScheduleChoice(v, t)
    return best


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(pipelines(most_v=8), st.floats(0.0, 2.0), st.one_of(st.just(math.inf), st.floats(0.0, 80.0)))
def test_choosing_v_by_floors_picks_what_simulating_every_v_picks(case, tail, beat):
    fwd, bwd, p2p, m, most = case
    assert fastest_virtual_stages(fwd, bwd, p2p, m, tail, most, beat_s=beat) == \
        _every_v(fwd, bwd, p2p, m, tail, most, beat)
    floor = fastest_virtual_stages(fwd, bwd, p2p, m, tail, most, beat_s=beat, floor_only=True)
    exact = _every_v(fwd, bwd, p2p, m, tail, most, beat)
    if exact is not None:  # the floor-only answer is under the real one
        assert floor is not None and floor.latency_s <= exact.latency_s


@settings(max_examples=150, deadline=None)
@given(pipelines(most_v=8), st.floats(0.0, 2.0), st.one_of(st.just(math.inf), st.floats(0.0, 80.0)),
       st.booleans())
def test_the_floor_order_changes_no_answer_even_on_ties(case, tail, beat, equal):
    """fastest_virtual_stages visits the v by their floors: the same answer as every v in turn, floor-only too,
    also where stages are equal (floors and simulations of several v then tie)."""
    fwd, bwd, p2p, m, most = case
    if equal:
        fwd, bwd, p2p = [1.0] * len(fwd), [2.0] * len(fwd), [0.0] * len(p2p)
    assert fastest_virtual_stages(fwd, bwd, p2p, m, tail, most, beat_s=beat) == \
        _every_v(fwd, bwd, p2p, m, tail, most, beat)
    assert fastest_virtual_stages(fwd, bwd, p2p, m, tail, most, beat_s=beat, floor_only=True) == \
        _every_v(fwd, bwd, p2p, m, tail, most, beat, floor_only=True)


def test_a_uniform_plain_plan_beaten_by_interleaving_only_where_the_simulation_says():
    S, m = 4, 8
    fwd, bwd, p2p = [1.0] * S, [2.0] * S, [0.0] * (S - 1)
    plain = m * 3.0 + (S - 1) * 3.0  # 1F1B: (m + S - 1) slots
    best = fastest_virtual_stages(fwd, bwd, p2p, m, 0.0, 4, beat_s=plain)
    assert best == ScheduleChoice(4, simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, 4))
    assert fastest_virtual_stages(fwd, bwd, p2p, m, 0.0, 4, beat_s=m * 3.0) is None  # none beats the busy time


def _fixtures() -> list[str]:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "plans")
    return sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".json"))


@pytest.mark.parametrize("path", _fixtures(), ids=os.path.basename)
def test_the_plan_table_breaks_the_prediction_down_into_the_simulated_schedule(path):
    from tangram_launch.plan import Plan
    from tangram_launch.planner.report import format_plan_table

    with open(path, encoding="utf-8") as f:
        plan = Plan.from_dict(json.load(f))
    v, bd = plan.virtual_stages, plan.predicted.breakdown
    schedule = f"interleaved 1F1B ({v} chunks per stage)" if v > 1 else "1F1B"
    assert bd["pipeline_s"] + bd["tail_s"] == pytest.approx(plan.predicted.iteration_time_s, rel=1e-12)
    assert (f"= simulated {schedule} pipeline {bd['pipeline_s']:.3f} s" in
            format_plan_table(plan, cluster_name=plan.cluster["name"], num_islands=len(plan.islands_used)))


# ------------------------------------------------------------------------------------------- in a CPU plan

PROFILED_TINY = os.path.join(os.path.dirname(__file__), "fixtures", "clusters", "profiled-cpu-2-tiny-layers.yaml")


@pytest.mark.parametrize("schedule", ["interleaved-1F1B", "auto"])
def test_an_interleaved_plan_is_priced_on_the_plans_own_stage_times(schedule):
    """A CPU profile (the README's main job, `tangram-launch --profile --model tiny`, on this machine) scales stages
    by its stage-like sequence factor and charges waiting stages their wake-up (costmodel/measured_layers.py,
    costmodel/wake.py), on the Plan's stage times. The interleaved schedule is simulated on those same times: on
    the StageCosts' parts alone it was priced below its own stages' work (24.3 ms predicted, 45.5 measured, where
    plain 1F1B of the same stages predicted 45.1), and `auto` picked it for that."""
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    plan = search(ClusterSpec.load(PROFILED_TINY), load_model("tiny"),
                  TrainingSpec(global_batch=8, seq_len=64, dtype="bf16"), runtime="torch",
                  options=PlannerOptions(schedule=schedule, max_workers=1, progress=False)).plan
    stages, m, v = plan.predicted.stages, plan.num_microbatches, plan.virtual_stages
    if schedule == "interleaved-1F1B":
        assert v == 2
    fwd, bwd = [s.forward_s for s in stages], [s.backward_s for s in stages]
    p2p = list(plan.planner["p2p_s"])
    run = simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, v) if v > 1 else None
    if run is not None:  # the prediction is the simulation of the stage times the plan prints
        assert plan.predicted.breakdown["pipeline_s"] == pytest.approx(run, rel=1e-12)
    # no stage does its m micro-batches' work in less time than that work takes
    assert plan.predicted.breakdown["pipeline_s"] >= m * max(s.time_s for s in stages) * (1 - 1e-9)
    assert plan.predicted.breakdown["bubble_fraction"] >= -1e-9
