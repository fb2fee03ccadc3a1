"""Interleaved 1F1B for a composed pipeline: how many model chunks per stage (virtual stages) to give it.

The composer (compose.py) builds the pipeline under plain 1F1B; this step then costs the same stages with v = 2, 3,
... chunks per stage and keeps the fastest v that the runtime runs, that every stage has the layers for (one layer
per chunk at least) and whose memory fits under the plan's headroom (costmodel/pipeline.py: early stages hold more
activations). Under ``schedule="1F1B"`` nothing changes; under ``"interleaved-1F1B"`` v >= 2 is required (an error
with reasons when none fits); under ``"auto"`` v = 1 competes.

A v is costed by the event simulation of the schedule the runtime runs (costmodel/interleaved_schedule.py), the
figure the Plan reports and the timeline draws. It is simulated only where its floor
(``interleaved_floor_s``) beats the best found so far: the choice is the one simulating every v would make.

The planner's composer ranks pipelines by this choice's latency (its score) and, where that can interleave, ends its
search with a pass no dominance prunes over the pipelines that can interleave (compose.py): a compose call returns
a plan no slower than any interleaved schedule of every composition of the options (and island order) it is given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from tangram_launch.costmodel.interleaved_schedule import interleaved_floor_s, simulated_interleaved_1f1b_s
from tangram_launch.costmodel.pipeline import pipeline_latency_s, stage_memory_bytes
from tangram_launch.costmodel.slice_plan import capacity_bytes

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.capabilities import RuntimeCapabilities
    from tangram_launch.costmodel.slice_plan import StageCost
    from tangram_launch.islands import Island
    from tangram_launch.specs.training import TrainingSpec

PLANNER_SCHEDULES = ("auto", "1F1B", "interleaved-1F1B")
MAX_VIRTUAL_STAGES = 8  # beyond this the extra p2p sends outweigh the smaller bubble (Narayanan et al. 2021, Fig. 12)


def most_virtual_stages(fewest_layers: int) -> int:
    """The most chunks per stage a pipeline whose smallest stage has ``fewest_layers`` layers can take (one layer
    per chunk at least); below 2, it cannot interleave. Also a cap for any pipeline holding a slice of that many
    layers (its stages have no more), which the planner's score floors use."""
    return min(MAX_VIRTUAL_STAGES, fewest_layers)


@dataclass(frozen=True)
class ScheduleChoice:
    virtual_stages: int  # 1 = plain 1F1B
    latency_s: float
    rejected: tuple[str, ...] = ()  # why larger v were not taken

    @property
    def schedule(self) -> str:
        return "interleaved-1F1B" if self.virtual_stages > 1 else "1F1B"


def choose_virtual_stages(stages: Sequence[tuple["StageCost", "Island"]], *, num_microbatches: int,
                          period_s: float, fill_s: float, tail_s: float, schedule: str,
                          capabilities: "RuntimeCapabilities", training: "TrainingSpec",
                          plain_latency_s: float | None = None, p2p_s: Sequence[float] | None = None,
                          floor_only: bool = False, fwd_s: Sequence[float] | None = None,
                          bwd_s: Sequence[float] | None = None) -> ScheduleChoice:
    """The best number of virtual stages for a composed pipeline (``stages`` front to back with their islands,
    ``p2p_s`` the one-way link seconds at each boundary, default none; ``fwd_s`` / ``bwd_s`` each stage's times as
    the plain prediction ran them, default the StageCosts' own: a CPU profile's stage-like sequence factor and
    wake-up charges are on the Plan's stage times, not on the StageCosts, and an interleaved schedule simulated
    without them was priced below its own stages' work).

    ``plain_latency_s``: the plain 1F1B prediction to beat (the Plan's: the event simulation); default the closed
    form. A v's latency is its simulation + ``tail_s``; with ``floor_only``, a floor under it (no simulation), so
    the choice's latency is a floor under the choice's."""
    if schedule not in PLANNER_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} (known: {', '.join(PLANNER_SCHEDULES)})")
    m, S = num_microbatches, len(stages)
    shapes = [st.shape for st, _ in stages]
    plain_problems = tuple(capabilities.schedule_problems("1F1B", num_stages=S, num_microbatches=m, shapes=shapes))
    plain = ScheduleChoice(1, math.inf if plain_problems else plain_latency_s if plain_latency_s is not None
                           else pipeline_latency_s(m, period_s, fill_s, tail_s), plain_problems)
    if schedule == "1F1B":
        return plain
    rejected: list[str] = list(plain_problems)
    problems = capabilities.schedule_problems("interleaved-1F1B", num_stages=S, num_microbatches=m, shapes=shapes)
    if S < 2:
        problems = ["a single pipeline stage has nothing to interleave"]
    if problems:  # under auto a runtime without the schedule is no news; when insisted on, say why
        return ScheduleChoice(1, plain.latency_s, tuple(problems) if schedule == "interleaved-1F1B" else ())
    fewest_layers = min(st.layers[1] - st.layers[0] for st, _ in stages)
    fitting = 1  # the most chunks per stage whose memory fits
    for v in range(2, most_virtual_stages(fewest_layers) + 1):
        over = [f"stage {k} needs {stage_memory_bytes(st, S - 1 - k, S, m, v) / 2**30:.1f} GiB with {v} virtual "
                f"stages > {capacity_bytes(isl, training) / 2**30:.1f} GiB usable on {isl.name}"
                for k, (st, isl) in enumerate(stages)
                if stage_memory_bytes(st, S - 1 - k, S, m, v) > capacity_bytes(isl, training)]
        if over:
            rejected.append(over[0])
            break  # memory only grows with v
        fitting = v
    best = fastest_virtual_stages(list(fwd_s) if fwd_s is not None else [st.forward_s for st, _ in stages],
                                  list(bwd_s) if bwd_s is not None else [st.backward_s for st, _ in stages],
                                  list(p2p_s) if p2p_s is not None else [0.0] * (S - 1), m, tail_s, fitting,
                                  beat_s=plain.latency_s if schedule == "auto" else math.inf, floor_only=floor_only)
    if fewest_layers < 2:
        rejected.append(f"a stage with {fewest_layers} layer cannot be split into chunks")
    if best is None:
        return ScheduleChoice(1, plain.latency_s, tuple(rejected))
    if schedule == "auto" and plain.latency_s <= best.latency_s:
        return plain
    return ScheduleChoice(best.virtual_stages, best.latency_s, tuple(rejected))


def fastest_virtual_stages(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                           tail_s: float, most: int, *, beat_s: float = math.inf,
                           floor_only: bool = False) -> ScheduleChoice | None:
    """The v in 2 .. ``most`` whose interleaved simulation + ``tail_s`` is least (the smaller v on ties), if it
    is less than ``beat_s``; None if none is. The v are taken in the order of their floors (interleaved_floor_s,
    O(S) each), least first, and a v is simulated only while its floor could still win: no less than the best so
    far (on a tie, only a smaller v wins) and less than ``beat_s``; from the first that cannot, no later one can.
    A large pipeline's floors and simulations usually fall together as v grows, so the least floor's v is often
    the answer and one or two of the simulations are run instead of every one; the answer is the one simulating
    every v gives, whatever the order (a floor + tail is no more than its simulation + tail, rounding being
    monotone). With ``floor_only`` a v's floor stands for its simulation (none is run): the answer's latency is
    then a floor under the real answer's, or under ``beat_s``."""
    floors = sorted((interleaved_floor_s(fwd_s, bwd_s, p2p_s, m, v) + tail_s, v) for v in range(2, most + 1))
    best: ScheduleChoice | None = None
    for t, v in floors:
        if t >= beat_s or (best is not None and (t > best.latency_s or (t == best.latency_s
                                                                          and v > best.virtual_stages))):
            break  # its simulation, and every later v's, is no less: none of them can win
        if not floor_only:
            t = simulated_interleaved_1f1b_s(fwd_s, bwd_s, p2p_s, m, v) + tail_s
            if t >= beat_s:
                continue
        if best is None or t < best.latency_s or (t == best.latency_s and v < best.virtual_stages):
            best = ScheduleChoice(v, t)
    return best
