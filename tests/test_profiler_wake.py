"""The profiler's wake-up cost (profiler/wake.py): a call that costs more after a pause than back to back reads that
much more (a fake clock: exact under any load), one that does not or runs faster reads nothing, and the stage-like
sequence is one micro-batch's forward and backward through the embedding, the model's first layers and the head."""
from __future__ import annotations

import pytest
import torch

from profiler.layer import LayerShape
from profiler.wake import stage_layers, stage_sequence, time_wake_up
from tangram_launch.specs.model import load_model


class _Clock:
    """A fake clock: sleeping and calling advance it, so the timing is exact whatever the host's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _ColdAfterPause:
    """A call of 1 ms that costs ``cold_s`` more when more than 5 ms passed since the last call ended."""

    def __init__(self, clock: _Clock, cold_s: float):
        self.clock, self.cold_s, self.last = clock, cold_s, 0.0

    def __call__(self) -> None:
        self.clock.now += 1e-3 + (self.cold_s if self.clock.now - self.last > 5e-3 else 0.0)
        self.last = self.clock.now


def test_a_cold_start_after_a_wait_is_measured_and_a_steady_call_reads_nothing():
    cpu, clock, calls = torch.device("cpu"), _Clock(), []
    cold = time_wake_up(_ColdAfterPause(clock, 3e-3), cpu, budget_s=0.5, between=lambda: calls.append(1),
                        clock=clock, sleep=clock.sleep)
    assert cold.value == pytest.approx(3000.0) and cold.unit == "us"
    detail = dict(cold.detail)
    assert detail["after_sleep_s"] == pytest.approx(4e-3) and detail["back_to_back_s"] == pytest.approx(1e-3)
    assert len(calls) == (1 + detail["calls"]) * detail["rounds"]  # one before each block and each sleep
    assert detail["waited_s"] == pytest.approx(detail["sleep_s"])  # idle before each timed call: here the sleep
    steady = time_wake_up(_ColdAfterPause(clock, 0.0), cpu, budget_s=0.5, clock=clock, sleep=clock.sleep)
    assert steady.value == pytest.approx(0.0, abs=1e-6)


def test_the_wait_counts_a_collective_that_waits_for_slower_peers():
    clock = _Clock()

    def slow_peers() -> None:  # the collective returns once a peer 7 ms slower has caught up
        clock.now += 7e-3

    got = time_wake_up(_ColdAfterPause(clock, 3e-3), torch.device("cpu"), budget_s=0.5, between=slow_peers,
                       sleep_s=0.02, clock=clock, sleep=clock.sleep)
    assert dict(got.detail)["waited_s"] == pytest.approx(0.027)


def test_a_call_faster_after_a_wait_costs_nothing():
    clock = _Clock()

    def warmer_after_a_pause() -> None:
        clock.now += 1e-3 if clock.now - getattr(warmer_after_a_pause, "last", 0.0) > 5e-3 else 2e-3
        warmer_after_a_pause.last = clock.now

    got = time_wake_up(warmer_after_a_pause, torch.device("cpu"), budget_s=0.5, clock=clock, sleep=clock.sleep)
    assert got.value == 0.0 and dict(got.detail)["after_sleep_s"] < dict(got.detail)["back_to_back_s"]


def test_rounds_follow_the_agreed_count():
    seen = []
    got = time_wake_up(lambda: None, torch.device("cpu"), budget_s=10.0, sleep_s=1e-4,
                       agree=lambda n: seen.append(n) or 3)
    assert seen and dict(got.detail)["rounds"] == 3 and len(got.timing.samples_s) == 3 * dict(got.detail)["calls"]


def test_the_stage_like_sequence_runs_forward_and_backward():
    fn = stage_sequence(load_model("tiny"), LayerShape(2, 16, "fp32"), torch.device("cpu"), layers=2)
    fn()  # a whole micro-batch, its backward included: a second call must not fail on a freed graph
    fn()


def test_a_cpu_stage_holds_as_many_layers_as_the_budget_affords_and_the_node_agrees():
    model, shape, cpu = load_model("tiny"), LayerShape(2, 16, "fp32"), torch.device("cpu")
    assert stage_layers(model, shape, cpu, budget_s=60.0) == model.num_layers  # all of them fit
    assert stage_layers(model, shape, cpu, budget_s=1e-6) == 1  # at least one
    assert stage_layers(model, shape, cpu, budget_s=60.0, agree=lambda n: min(n, 2)) == 2
