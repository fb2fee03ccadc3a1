"""Whether to re-plan and switch: the gain over the horizon against the measured cost of switching.

When a window flags a straggler (:mod:`.detect`), the run is re-planned with every GPU's measured rate (``replan``,
passed in: the launcher's planner on the cluster with each GPU's figures divided by its slowdown, or a model in
tests). A slowdown is relative to the segment's first window, GPU by GPU: the cost model's own error (compute
against communication, a stage it prices roughly) stays as it was when the current plan was chosen, and is
``tangram-launch calibrate``'s business. Both plans are then priced in that frame (the current one by
:func:`iteration_under`: its pipeline follows its slowest stage) and the ratio is applied to the step time the run
measures now, so the cost model's error common to both plans cancels::

    new_step_s      = current_step_s * new_predicted_s / current_predicted_s      (both with the measured rates)
    gain_s_per_step = current_step_s - new_step_s
    switch  <=>  gain_s_per_step * horizon_steps > switch_cost_s
                 and gain_s_per_step >= min_relative_gain * current_step_s     (the cost model's noise)
                 and the new plan differs from the current one

``switch_cost_s`` is what the run measured: checkpoint save, worker restart and resume (reshard) times, or the
downtime of its last switch. After any decision the rates it used become the expectation, and the next decision
needs a fresh window: a slowdown is acted on once, and noise around a steady rate never triggers (no flapping).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tangram_launch.launch.adapt.detect import (DetectConfig, GpuKey, Window, baseline, last_window, rank_places,
                                                stage_predicted_s)

DEFAULT_MIN_RELATIVE_GAIN = 0.10  # below it, a re-plan's gain is within the cost model's error


@dataclass(frozen=True)
class Candidate:
    """A re-plan: the plan (as its file's dict), its hash and predicted iteration seconds (the cost model's)."""

    plan: Mapping[str, Any]
    plan_hash: str
    predicted_iteration_s: float
    same_as_current: bool = False  # the same layout (only predictions differ): nothing to switch to
    plan_path: str | None = None  # where the launcher wrote it, and the calibrated cluster it was made from
    cluster_path: str | None = None


Replan = Callable[[Mapping[GpuKey, float]], Candidate]  # per-GPU slowdown (1.0: as believed) -> the best plan


@dataclass(frozen=True)
class Policy:
    detect: DetectConfig = DetectConfig()
    horizon_steps: int | None = None  # --adapt-horizon; else the steps left (when the script says), else as many
    #                                   steps as the run has done so far
    min_relative_gain: float = DEFAULT_MIN_RELATIVE_GAIN


@dataclass(frozen=True)
class Decision:
    step: int  # the last step of the window decided on
    cause: str
    switch: bool
    reason: str
    current_step_s: float
    predicted_step_s: float  # the new plan's, in the run's seconds
    horizon_steps: int
    switch_cost_s: float
    factors: Mapping[GpuKey, float]  # per GPU, slowdown since the segment's first window (what the re-plan used)
    old_plan_hash: str
    new_plan_hash: str
    new_plan: Mapping[str, Any] | None = None
    candidate: Candidate | None = None

    @property
    def gain_s_per_step(self) -> float:
        return self.current_step_s - self.predicted_step_s

    @property
    def predicted_gain_s(self) -> float:
        return self.gain_s_per_step * self.horizon_steps

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cause": self.cause, "switch": self.switch, "reason": self.reason,
                "old_plan_hash": self.old_plan_hash, "new_plan_hash": self.new_plan_hash,
                "current_step_s": self.current_step_s, "predicted_step_s": self.predicted_step_s,
                "predicted_gain_s_per_step": self.gain_s_per_step, "horizon_steps": self.horizon_steps,
                "predicted_gain_s": self.predicted_gain_s, "switch_cost_s": self.switch_cost_s,
                "factors": [{"node": n, "local_gpu": g, "slowdown": f} for (n, g), f in sorted(self.factors.items())]}


def should_switch(*, current_step_s: float, predicted_step_s: float, horizon_steps: int, switch_cost_s: float,
                  min_relative_gain: float = DEFAULT_MIN_RELATIVE_GAIN, same_plan: bool = False) -> tuple[bool, str]:
    """The rule of the module doc, with the reason in words."""
    gain = current_step_s - predicted_step_s
    if same_plan:
        return False, "the re-plan is the current plan"
    if not gain > 0:
        return False, f"the re-plan is not faster ({predicted_step_s:.3f} s against {current_step_s:.3f} s per step)"
    if gain < min_relative_gain * current_step_s:
        return False, (f"the gain ({gain / current_step_s:.1%} per step) is within the cost model's noise "
                       f"({min_relative_gain:.0%})")
    total = gain * horizon_steps
    if not total > switch_cost_s:
        return False, (f"{gain:.3f} s per step over {horizon_steps} steps ({total:.1f} s) does not pay for the "
                       f"switch ({switch_cost_s:.1f} s)")
    return True, (f"{gain:.3f} s per step over {horizon_steps} steps ({total:.1f} s) pays for the switch "
                  f"({switch_cost_s:.1f} s)")


def iteration_under(plan: Mapping[str, Any], factors: Mapping[GpuKey, float]) -> float:
    """The plan's predicted iteration with every stage's compute scaled by its slowest GPU's factor: the
    pipeline's period is its slowest stage, so the iteration scales with the slowest scaled stage."""
    times = stage_predicted_s(plan)
    slowest: dict[int, float] = {}
    for gpu, stage in rank_places(plan).values():
        slowest[stage] = max(slowest.get(stage, 0.0), factors.get(gpu, 1.0))
    if not times or max(times) <= 0:
        return 0.0
    scaled = max(t * slowest.get(i, 1.0) for i, t in enumerate(times))
    return float(plan["predicted"]["iteration_time_s"]) * scaled / max(times)


@dataclass
class Controller:
    """One segment (one plan) of a run: feed it the timings as they grow; it answers a Decision when a window
    flags a straggler. The launcher acts on ``switch`` (with ``--adapt``) or only logs it."""

    plan: Mapping[str, Any]
    plan_hash: str
    replan: Replan
    policy: Policy = Policy()
    expected: dict[GpuKey, float] = field(default_factory=dict)  # per GPU: the normal measured/predicted ratio
    baseline_step_s: float | None = None  # the segment's first window: its measured step time
    base: dict[GpuKey, float] = field(default_factory=dict)  # and each GPU's measured / predicted then
    next_step: int = 0  # the first step the next window may end at
    decisions: list[Decision] = field(default_factory=list)

    def observe(self, timings: list[Mapping], *, switch_cost_s: float,
                remaining_steps: int | None = None) -> Decision | None:
        window = last_window(timings, self.plan, self.expected, self.policy.detect)
        if window is None or window.last_step < self.next_step:
            return None
        if self.baseline_step_s is None:  # the segment's first window: what normal is
            self.expected = baseline(window)
            self.base = dict(self.expected)
            self.baseline_step_s = window.step_s
            self.next_step = window.last_step + 1
            return None
        if not window.stragglers:
            return None
        decision = self._decide(window, switch_cost_s, remaining_steps)
        self.decisions.append(decision)
        # what was measured becomes normal; the next decision needs a window of its own
        self.expected = {r.gpu: r.ratio * self.expected.get(r.gpu, 1.0) for r in window.rates}
        self.next_step = window.last_step + self.policy.detect.window_steps
        return decision

    def horizon(self, window: Window, remaining_steps: int | None) -> int:
        if self.policy.horizon_steps is not None:
            return self.policy.horizon_steps
        if remaining_steps is not None:
            return max(0, remaining_steps)
        return window.last_step

    def _decide(self, window: Window, switch_cost_s: float, remaining_steps: int | None) -> Decision:
        factors = {r.gpu: r.ratio * self.expected.get(r.gpu, 1.0) / self.base.get(r.gpu, 1.0) for r in window.rates}
        slow = sorted(window.stragglers, key=lambda r: -r.ratio)
        cause = "straggler: " + ", ".join(f"rank {r.rank} ({r.gpu[0]}:{r.gpu[1]}, stage {r.stage}) "
                                          f"{r.ratio:.2f}x its expected time" for r in slow)
        candidate = self.replan(factors)
        current = iteration_under(self.plan, factors)
        predicted_s = window.step_s * candidate.predicted_iteration_s / current if current > 0 else float("inf")
        horizon = self.horizon(window, remaining_steps)
        switch, reason = should_switch(current_step_s=window.step_s, predicted_step_s=predicted_s,
                                       horizon_steps=horizon, switch_cost_s=switch_cost_s,
                                       min_relative_gain=self.policy.min_relative_gain,
                                       same_plan=candidate.same_as_current
                                       or candidate.plan_hash == self.plan_hash)
        return Decision(step=window.last_step, cause=cause, switch=switch, reason=reason,
                        current_step_s=window.step_s, predicted_step_s=predicted_s, horizon_steps=horizon,
                        switch_cost_s=switch_cost_s, factors=factors, old_plan_hash=self.plan_hash,
                        new_plan_hash=candidate.plan_hash, new_plan=candidate.plan if switch else None,
                        candidate=candidate)
