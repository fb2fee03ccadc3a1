"""The wake-up cost of a waiting pipeline stage (costmodel/wake.py): charged once per micro-batch to every stage but
the slowest, on the op after the stage's wait, never more than the stage's slack; the 1F1B event simulation idles
the stages exactly before those ops; a plan on a CPU cluster with a measured wake-up cost predicts its waiting stage
slower by it, and a cluster without one plans as before."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.pipeline import simulate_1f1b
from tangram_launch.costmodel.wake import charge_wake_ups, wake_up_charges_s, wake_up_s, wake_up_wait_s
from tangram_launch.planner import PlannerOptions
from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

stage_times = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 80)), min_size=1, max_size=6)


def test_the_slowest_stage_and_equal_stages_are_charged_nothing():
    assert wake_up_charges_s([3.0, 1.0], [6.0, 2.0], [0.5, 0.5]) == [0.0, 0.5]
    assert wake_up_charges_s([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]  # nobody waits
    assert charge_wake_ups([1.0, 1.0], [2.0, 2.0], [0.5, 0.5]) == ([1.0, 1.0], [2.0, 2.0])


def test_a_charge_never_exceeds_the_stage_slack():
    # stage 1 is 0.1 s faster than stage 0: a 0.5 s wake-up would make it the slowest, which then never waits
    assert wake_up_charges_s([1.0, 1.0], [2.0, 1.9], [0.5, 0.5]) == pytest.approx([0.0, 0.1])


def test_upstream_stages_pay_on_the_backward_downstream_ones_on_the_forward():
    fwd, bwd = charge_wake_ups([1.0, 3.0, 1.0], [2.0, 6.0, 2.0], [0.25, 0.25, 0.25])
    assert fwd == [1.0, 3.0, 1.25] and bwd == [2.25, 6.0, 2.0]


def test_unmeasured_or_bad_figures_cost_nothing():
    assert wake_up_s(None) == wake_up_s({}) == wake_up_s({"wake_up_us": -3}) == wake_up_s({"wake_up_us": True}) == 0
    assert wake_up_s({"wake_up_us": "12"}) == 0.0
    assert wake_up_s({"wake_up_us": 2500}) == pytest.approx(2.5e-3)


@settings(max_examples=200, deadline=None)
@given(stage_times, st.lists(st.integers(0, 30), min_size=6, max_size=6))
def test_charges_keep_the_slowest_stage_and_stay_within_the_measured_cost(times, wakes):
    fwd, bwd = [float(f) for f, _ in times], [float(b) for _, b in times]
    wake = [float(w) for w in wakes[:len(times)]]
    charged_f, charged_b = charge_wake_ups(fwd, bwd, wake)
    before = [f + b for f, b in zip(fwd, bwd)]
    after = [f + b for f, b in zip(charged_f, charged_b)]
    assert max(after) == max(before)  # the period the slowest stage sets is unchanged
    for k, (t0, t1, w) in enumerate(zip(before, after, wake)):
        assert t0 <= t1 <= t0 + w
        if t0 == max(before):
            assert t1 == t0 and (charged_f[k], charged_b[k]) == (fwd[k], bwd[k])
        # only one of the two ops pays
        assert charged_f[k] == fwd[k] or charged_b[k] == bwd[k]


def test_a_stage_that_waits_less_than_the_profile_did_is_charged_in_proportion():
    # slack 2 s, 6 s and 10 s against a cost measured after 8 s of waiting: a quarter, three quarters, all of it
    fwd, bwd, wake = [4.0, 2.0, 1.0, 0.0], [8.0, 8.0, 5.0, 2.0], [1.0] * 4
    assert wake_up_charges_s(fwd, bwd, wake, [8.0] * 4) == pytest.approx([0.0, 0.25, 0.75, 1.0])
    assert wake_up_charges_s(fwd, bwd, wake, [0.0] * 4) == wake_up_charges_s(fwd, bwd, wake)  # wait unknown: all
    assert wake_up_wait_s({"wake_up_wait_us": 40000}) == pytest.approx(0.04)
    assert wake_up_wait_s(None) == wake_up_wait_s({"wake_up_wait_us": -1}) == wake_up_wait_s({"x": 1}) == 0.0


@settings(max_examples=200, deadline=None)
@given(stage_times, st.lists(st.integers(0, 30), min_size=6, max_size=6),
       st.lists(st.integers(0, 60), min_size=6, max_size=6))
def test_a_charge_grows_with_the_wait_up_to_the_whole_cost(times, wakes, waits):
    fwd, bwd = [float(f) for f, _ in times], [float(b) for _, b in times]
    wake, waited = [float(w) for w in wakes[:len(times)]], [float(m) for m in waits[:len(times)]]
    scaled, whole = wake_up_charges_s(fwd, bwd, wake, waited), wake_up_charges_s(fwd, bwd, wake)
    longer = wake_up_charges_s(fwd, bwd, wake, [m / 2 for m in waited])  # measured after half the wait
    for c, c_whole, c_longer in zip(scaled, whole, longer):
        assert 0.0 <= c <= c_longer <= c_whole  # a stage whose wait is long against the profile's pays more


def _idle_before(blocks, stage: int) -> dict[str, int]:
    """How many of a stage's ops start after an idle gap, by kind."""
    ops = sorted((b for b in blocks if b.stage == stage), key=lambda b: b.start_s)
    out = {"F": 0, "B": 0}
    for prev, op in zip(ops, ops[1:]):
        if op.start_s > prev.end_s:
            out[op.kind] += 1
    return out


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=4), st.data())
def test_1f1b_idles_each_stage_once_per_micro_batch_before_the_op_it_is_charged_on(units, data):
    """Each micro-batch more adds one idle gap to every stage but the unique slowest: before its backward upstream
    of the slowest, before its forward downstream, and none before its other op (a stage between the slowest and
    another slower than itself also waits before that op, but only in the fill and drain, whatever m). Backward =
    2 x forward; integer times, so ties are exact."""
    slowest = data.draw(st.integers(0, len(units) - 1))
    fwd = [float(u) for u in units]
    fwd[slowest] = float(max(units) + 1)
    bwd = [2.0 * f for f in fwd]
    idle = {m: [_idle_before(simulate_1f1b(fwd, bwd, [0.0] * (len(fwd) - 1), m), k) for k in range(len(fwd))]
            for m in (48, 64)}
    charged_f, charged_b = charge_wake_ups(fwd, bwd, [0.5] * len(fwd))
    for k in range(len(fwd)):
        more = {kind: idle[64][k][kind] - idle[48][k][kind] for kind in "FB"}
        if k == slowest:
            assert charged_f[k] == fwd[k] and charged_b[k] == bwd[k] and more == {"F": 0, "B": 0}
        else:
            assert more == ({"F": 0, "B": 16} if charged_b[k] > bwd[k] else {"F": 16, "B": 0})


# ------------------------------------------------------------------------------------------------ in a plan

TINY_2STAGE = {"stages": [{"layers": [0, 1], "island": "cpu", "dp": 1}, {"layers": [1, 4], "island": "cpu", "dp": 1}]}


def _plan(wake_up_us: float | None, wake_up_wait_us: float | None = None):
    node = {"name": "local", "host": "localhost", "gpu": "cpu", "count": 2}
    if wake_up_us is not None:
        node["measured"] = {"wake_up_us": wake_up_us}
    if wake_up_wait_us is not None:
        node.setdefault("measured", {})["wake_up_wait_us"] = wake_up_wait_us
    model = load_model("tiny")
    manual = parse_manual_plan({**TINY_2STAGE, "microbatch_sequences": 8}, num_layers=model.num_layers,
                               island_names=["cpu"])
    return cost_manual_plan(manual, ClusterSpec.from_dict({"name": "cpu-2", "nodes": [node]}), model,
                            TrainingSpec(global_batch=64, seq_len=32, dtype="fp32"), runtime="torch",
                            options=PlannerOptions(max_workers=1, progress=False))


def test_a_measured_wake_up_cost_slows_the_waiting_stage_and_the_iteration_only():
    plain, woken = _plan(None), _plan(2000.0)
    p, w = plain.predicted.stages, woken.predicted.stages
    slow = max(range(2), key=lambda k: p[k].time_s)
    fast = 1 - slow
    assert w[slow].forward_s == p[slow].forward_s and w[slow].backward_s == p[slow].backward_s
    charge = min(2e-3, p[slow].time_s - p[fast].time_s)
    assert w[fast].time_s == pytest.approx(p[fast].time_s + charge)
    # the fill and drain hold the waiting stage's ops: the iteration grows, by less than m charges
    assert plain.predicted.iteration_time_s < woken.predicted.iteration_time_s
    assert woken.predicted.iteration_time_s < plain.predicted.iteration_time_s + 8 * charge
    assert _plan(0.0).predicted == plain.predicted  # measured as none: predicted as without the figure
    # measured after twice the stage's wait: half the charge
    slack_us = (p[slow].time_s - p[fast].time_s) * 1e6
    half = _plan(2000.0, wake_up_wait_us=2 * slack_us).predicted.stages
    assert half[fast].time_s == pytest.approx(p[fast].time_s + min(1e-3, charge))
