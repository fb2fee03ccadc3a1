"""The adapt decision rule (unit tier): detection from timing series, the switch rule, no flapping.

A model of a pipeline stands in for the planner: each GPU a stage, layers split by speed, iteration
(m + S - 1) x the slowest stage. Timing series are generated as the workers write them (per rank, per step).
"""
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tangram_launch.launch.adapt.decide import Candidate, Controller, Policy, should_switch
from tangram_launch.launch.adapt.detect import DetectConfig, baseline, last_window

LAYERS, MICROBATCHES, LAYER_S = 12, 4, 0.01
GPUS = [("n", 0), ("n", 1), ("n", 2)]


def pipeline_plan(speeds: dict) -> dict:
    """A plan dict for the GPUs (believed slowdown each), layers in proportion to speed (largest remainder)."""
    inv = [1.0 / speeds[g] for g in GPUS]
    raw = [LAYERS * x / sum(inv) for x in inv]
    split = [max(1, int(r)) for r in raw]
    while sum(split) < LAYERS:
        split[max(range(len(split)), key=lambda i: raw[i] - split[i])] += 1
    stages = [{"forward_s": n * LAYER_S * speeds[g] / 3, "backward_s": 2 * n * LAYER_S * speeds[g] / 3}
              for n, g in zip(split, GPUS)]
    iteration = (MICROBATCHES + len(GPUS) - 1) * max(s["forward_s"] + s["backward_s"] for s in stages)
    ends = [sum(split[:i + 1]) for i in range(len(split))]
    return {"split": split, "rank_layout": [{"rank": i, "node": g[0], "local_gpu": g[1], "stage": i}
                                            for i, g in enumerate(GPUS)],
            "stages": [{"layers": [end - n, end], "gpus": [{"node": g[0], "local_gpu": g[1]}]}
                       for n, end, g in zip(split, ends, GPUS)],
            "predicted": {"stages": stages, "iteration_time_s": iteration}}


def replan(factors) -> Candidate:
    plan = pipeline_plan({g: factors.get(g, 1.0) for g in GPUS})
    return Candidate(plan=plan, plan_hash=str(plan["split"]),
                     predicted_iteration_s=plan["predicted"]["iteration_time_s"])


def timing_lines(plan: dict, step: int, true_speed: dict, noise: list[float], model_error: float) -> list[dict]:
    """One step of every rank, as stage_timing writes it: measured = predicted-at-true-speed x error x noise."""
    lines, per_stage = [], []
    for r in plan["rank_layout"]:
        g, stage = (r["node"], r["local_gpu"]), r["stage"]
        n = plan["split"][stage]
        error = model_error[r["rank"]] if isinstance(model_error, (list, tuple)) else model_error
        per_mb = 3 * n * LAYER_S / 3 * true_speed[g] * error * noise[r["rank"]]
        per_stage.append(per_mb)
        lines.append({"rank": r["rank"], "stage": stage, "step": step, "microbatches": MICROBATCHES,
                      "forward_s": per_mb * MICROBATCHES / 3, "backward_s": 2 * per_mb * MICROBATCHES / 3,
                      "backward_spans": MICROBATCHES})
    step_s = (MICROBATCHES + len(GPUS) - 1) * max(per_stage)
    for line in lines:
        line["step_s"] = step_s
    return lines


def simulate(true_speed_at, steps: int, rng: random.Random, *, noise: float, spike_p: float, model_error: float,
             switch_cost_s: float = 1.0, policy: Policy = Policy()):
    """Run the controller over a generated series, switching (a new segment, steps numbered from 1) when told.
    Returns the decisions, the segments' plans."""
    plan = pipeline_plan({g: 1.0 for g in GPUS})
    ctl = Controller(plan=plan, plan_hash=str(plan["split"]), replan=replan, policy=policy)
    timings, decisions, plans, seg_step = [], [], [plan], 0
    for step in range(1, steps + 1):
        seg_step += 1
        draw = [rng.uniform(1 - noise, 1 + noise) * (rng.uniform(2, 10) if rng.random() < spike_p else 1.0)
                for _ in GPUS]
        timings += timing_lines(ctl.plan, seg_step, true_speed_at(step), draw, model_error)
        d = ctl.observe(timings, switch_cost_s=switch_cost_s, remaining_steps=steps - step)
        if d is None:
            continue
        decisions.append((step, d))
        if d.switch:
            ctl = Controller(plan=d.new_plan, plan_hash=d.new_plan_hash, replan=replan, policy=policy)
            plans.append(d.new_plan)
            timings, seg_step = [], 0
    return decisions, plans


def test_no_switch_when_the_gain_does_not_pay_for_the_downtime():
    ok, why = should_switch(current_step_s=1.0, predicted_step_s=0.5, horizon_steps=10, switch_cost_s=6.0)
    assert not ok and "does not pay" in why
    ok, _ = should_switch(current_step_s=1.0, predicted_step_s=0.5, horizon_steps=13, switch_cost_s=6.0)
    assert ok
    slow = {("n", 0): 1.0, ("n", 1): 3.0, ("n", 2): 1.0}
    decisions, plans = simulate(lambda s: slow if s > 30 else {g: 1.0 for g in GPUS}, 120, random.Random(0),
                                noise=0.03, spike_p=0.0, model_error=2.0, switch_cost_s=1e6)
    assert decisions and not any(d.switch for _, d in decisions) and len(plans) == 1
    assert "does not pay" in decisions[0][1].reason


def test_a_slowdown_is_flagged_within_the_window_and_the_replan_isolates_the_slow_gpu():
    slow = {("n", 0): 1.0, ("n", 1): 3.0, ("n", 2): 1.0}
    decisions, plans = simulate(lambda s: slow if s > 30 else {g: 1.0 for g in GPUS}, 150, random.Random(1),
                                noise=0.03, spike_p=0.05, model_error=1.7)
    step, first = decisions[0]
    assert 30 < step <= 30 + DetectConfig().window_steps + 1
    assert first.switch and "rank 1 (n:1" in first.cause
    assert first.factors[("n", 1)] == pytest.approx(3.0, rel=0.1)  # slowdown since the first window, per GPU
    assert first.factors[("n", 0)] == pytest.approx(1.0, rel=0.1)
    assert plans[-1]["split"][1] < plans[-1]["split"][0]  # the slow GPU's stage got fewer layers
    assert sum(d.switch for _, d in decisions) == 1


def test_a_uniform_model_error_is_no_straggler():
    window = last_window(sum((timing_lines(pipeline_plan({g: 1.0 for g in GPUS}), s, {g: 1.0 for g in GPUS},
                                           [1, 1, 1], 2.5) for s in range(1, 30)), []),
                         pipeline_plan({g: 1.0 for g in GPUS}), {}, DetectConfig())
    assert all(r.slow for r in window.rates)  # against the raw prediction every rank is 2.5x slow ...
    expected = baseline(window)
    assert list(expected.values()) == pytest.approx([2.5] * len(GPUS))  # ... which the first window takes as normal


def test_spikes_in_half_the_first_window_leave_the_baseline_and_the_rate_at_the_quiet_level():
    """Spikes only add time: a rate read from a median of the later half would be several times normal here."""
    plan, speed = pipeline_plan({g: 1.0 for g in GPUS}), {g: 1.0 for g in GPUS}
    spiked = {7, 12, 14, 15, 18, 19, 20}  # 5 of the window's later half (steps 12..21)
    timings = sum((timing_lines(plan, s, speed, [6.0 if s in spiked else 1.0, 1, 1], 1.3) for s in range(1, 22)), [])
    window = last_window(timings, plan, {}, DetectConfig())
    assert (window.first_step, window.last_step) == (2, 21)
    assert baseline(window)[GPUS[0]] == pytest.approx(1.3)
    assert window.rates[0].ratio == pytest.approx(1.3)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise=st.floats(0.0, 0.1), spike_p=st.floats(0.0, 0.15),
       model_error=st.floats(0.3, 5.0) | st.lists(st.floats(0.3, 5.0), min_size=3, max_size=3))
def test_no_decision_under_noisy_timings_of_a_steady_cluster(seed, noise, spike_p, model_error):
    """Noise, spikes, and a cost model off by any factor (the same for every stage, or one per stage)."""
    steady = {g: 1.0 for g in GPUS}
    decisions, plans = simulate(lambda s: steady, 150, random.Random(seed), noise=noise, spike_p=spike_p,
                                model_error=model_error)
    assert decisions == [] and len(plans) == 1


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), slow_gpu=st.sampled_from(GPUS), factor=st.floats(2.0, 4.0),
       at=st.integers(25, 80), noise=st.floats(0.0, 0.08), spike_p=st.floats(0.0, 0.1))
# spikes on the slowed GPU in 5 of the first window's last 10 steps (a baseline read from their median hid the 2x)
@example(seed=6495310, slow_gpu=("n", 0), factor=2.0, at=25, noise=0.0, spike_p=0.078125)
def test_one_slowdown_gives_one_switch_and_never_a_switch_back(seed, slow_gpu, factor, at, noise, spike_p):
    slow = {g: (factor if g == slow_gpu else 1.0) for g in GPUS}
    decisions, plans = simulate(lambda s: slow if s > at else {g: 1.0 for g in GPUS}, 200, random.Random(seed),
                                noise=noise, spike_p=spike_p, model_error=1.3)
    assert sum(d.switch for _, d in decisions) == 1
    assert len(plans) == 2 and plans[1]["split"] != plans[0]["split"]


def test_detect_config_refuses_a_window_too_short_to_tell_a_spike():
    with pytest.raises(ValueError, match="window"):
        DetectConfig(window_steps=2)
