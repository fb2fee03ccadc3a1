"""Stragglers from the workers' stage timings: which GPU runs slower than the plan expects, and by how much.

Each timing line (``runtime_adapters.stage_timing``) gives one rank's forward and backward seconds of one step. Its
*ratio* is that time per micro-batch over the plan's prediction for the rank's stage, divided by the rank's
*expected* ratio: what the run has learned is normal for that GPU (1 where nothing was learned yet). The cost
model's error is not a straggler (a placeholder cluster file, a stage whose head or embedding the model prices
roughly), so the first full window of a segment sets each rank's expectation to its own ratio (:func:`baseline`):
detection acts on changes, and a GPU slow from the start is what ``tangram-launch calibrate`` is for.

A rank is a straggler when the lower quartile of its ratios over the last ``window_steps`` steps exceeds
``1 + threshold``: at least three steps in four were slow, so a one-off spike (a page fault, a checkpoint, another
process) never flags it. Its effective rate is the lower quartile of the window's later half (a slowdown that began
inside the window is measured at its full size): the factor the re-plan divides that GPU's figures by, per GPU
(per rank on CPU), so a slow GPU becomes its own island.

Every rate is a lower quartile because spikes only ever add time: a median of a few steps is moved by spikes in
half of them, which a short burst does (a baseline window read as several times normal would hide any later
slowdown below it). The baseline is the whole first window's lower quartile, as robust to spikes as detection.

Per-rank attribution needs per-rank spans: in a pipeline, a stage's hooks time its own compute (receives happen
between them). Replicas whose collectives run inside the stage's forward (ZeRO-3 gathers) wait for the slowest
replica inside their spans, so a slow replica flags its whole group and the re-plan scales the group together.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping

GpuKey = tuple[str, int]  # (plan node, local GPU)

DEFAULT_THRESHOLD = 0.15
DEFAULT_WINDOW_STEPS = 20


@dataclass(frozen=True)
class DetectConfig:
    threshold: float = DEFAULT_THRESHOLD  # relative slowdown that counts (0.15: 15 % slower than expected)
    window_steps: int = DEFAULT_WINDOW_STEPS  # steps a slowdown must last

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 10:
            raise ValueError(f"adapt threshold must be in (0, 10), got {self.threshold}")
        if self.window_steps < 4:
            raise ValueError(f"adapt window must be at least 4 steps, got {self.window_steps}")


@dataclass(frozen=True)
class RankRate:
    rank: int
    gpu: GpuKey
    stage: int
    ratio: float  # lower quartile over the window's later half of measured / (predicted x expected)
    low_quartile: float  # over the whole window
    slow: bool


@dataclass(frozen=True)
class Window:
    """The last ``window_steps`` steps every rank has timed: per-rank rates and the slowest rank's step time."""

    first_step: int
    last_step: int
    rates: tuple[RankRate, ...]
    step_s: float  # median over the window of the slowest rank's train_step

    @property
    def stragglers(self) -> tuple[RankRate, ...]:
        return tuple(r for r in self.rates if r.slow)

    def factors(self) -> dict[GpuKey, float]:
        """Per GPU: how much slower than expected it ran over the window (1.0: as expected)."""
        return {r.gpu: r.ratio for r in self.rates}


def rank_places(plan: Mapping) -> dict[int, tuple[GpuKey, int]]:
    """rank -> ((node, local GPU), stage), from the plan's rank layout."""
    return {int(r["rank"]): ((str(r["node"]), int(r["local_gpu"])), int(r["stage"]))
            for r in plan.get("rank_layout", ())}


def stage_predicted_s(plan: Mapping) -> list[float]:
    """Per stage: predicted forward + backward seconds per micro-batch."""
    return [float(s["forward_s"]) + float(s["backward_s"]) for s in plan["predicted"]["stages"]]


def step_ratios(timings: Iterable[Mapping], plan: Mapping) -> dict[int, dict[int, float]]:
    """rank -> step -> measured / predicted (forward + backward per micro-batch); the first step is left out
    (shape inference, warm-up), and lines without a backward span (a stage that has not run one) too."""
    predicted = stage_predicted_s(plan)
    out: dict[int, dict[int, float]] = {}
    for t in timings:
        if t.get("step", 0) <= 1 or not t.get("microbatches") or not t.get("backward_spans", 1):
            continue
        stage = int(t["stage"])
        if not 0 <= stage < len(predicted) or predicted[stage] <= 0:
            continue
        per_mb = (float(t["forward_s"]) + float(t["backward_s"])) / int(t["microbatches"])
        out.setdefault(int(t["rank"]), {})[int(t["step"])] = per_mb / predicted[stage]
    return out


def _quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def last_window(timings: list[Mapping], plan: Mapping, expected: Mapping[GpuKey, float],
                config: DetectConfig) -> Window | None:
    """The last full window every rank of the plan has timed, or None (not enough steps yet)."""
    places = rank_places(plan)
    ratios = step_ratios(timings, plan)
    if not places or set(places) - set(ratios):
        return None
    last = min(max(steps) for steps in ratios.values())
    first = last - config.window_steps + 1
    rates = []
    for rank in sorted(places):
        gpu, stage = places[rank]
        values = [v / expected.get(gpu, 1.0) for s, v in sorted(ratios[rank].items()) if first <= s <= last]
        if len(values) < config.window_steps:
            return None
        low = _quartile(values)
        rates.append(RankRate(rank=rank, gpu=gpu, stage=stage, ratio=_quartile(values[len(values) // 2:]),
                              low_quartile=low, slow=low > 1.0 + config.threshold))
    walls: dict[int, float] = {}
    for t in timings:
        if first <= t.get("step", 0) <= last and t.get("step_s") is not None:
            walls[t["step"]] = max(walls.get(t["step"], 0.0), float(t["step_s"]))
    step_s = statistics.median(walls.values()) if walls else float("nan")
    return Window(first_step=first, last_step=last, rates=tuple(rates), step_s=step_s)


def baseline(window: Window) -> dict[GpuKey, float]:
    """Every rank's expectation after a segment's first window (read with no expectation): its ratio over the
    whole window (the segment began there, so no slowdown started inside it)."""
    return {r.gpu: r.low_quartile for r in window.rates}
