"""The profiler's wake-up cost (profiler/wake.py): a call that costs more after a pause than back to back reads that
much more, one that does not reads about nothing, and the stage-like sequence is one micro-batch's forward and
backward through the embedding, a layer and the head."""
from __future__ import annotations

import time

import torch

from profiler.layer import LayerShape
from profiler.wake import stage_layers, stage_sequence, time_wake_up
from tangram_launch.specs.model import load_model


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _ColdAfterPause:
    """A call of 1 ms that costs ``cold_s`` more when more than 5 ms passed since the last call ended."""

    def __init__(self, cold_s: float):
        self.cold_s, self.last = cold_s, time.perf_counter()

    def __call__(self) -> None:
        _spin(1e-3 + (self.cold_s if time.perf_counter() - self.last > 5e-3 else 0.0))
        self.last = time.perf_counter()


def test_a_cold_start_after_a_wait_is_measured_and_a_steady_call_reads_near_zero():
    cpu = torch.device("cpu")
    calls = []
    cold = time_wake_up(_ColdAfterPause(3e-3), cpu, budget_s=0.5, between=lambda: calls.append(1))
    assert 2400 < cold.value < 4500 and cold.unit == "us"
    detail = dict(cold.detail)
    assert detail["after_sleep_s"] > detail["back_to_back_s"] and len(calls) == (1 + detail["calls"]) * detail["rounds"]
    steady = time_wake_up(_ColdAfterPause(0.0), cpu, budget_s=0.5)
    assert steady.value < 600


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
