"""The wake-up cost of a stage that waits: one measured figure per device, charged per micro-batch.

In a 1F1B pipeline of unequal stages every stage runs at the pace of the slowest. Each other stage idles once per
micro-batch in the steady state: downstream of the slowest it waits for its forward's input, upstream of it for its
backward's gradient (the event simulation in costmodel/pipeline.py shows the idle gaps there). The compute after
such a wait runs cold (the profiler's ``wake_up_us``: a stage-like micro-batch after a sleep against back to back,
profiler/wake.py), while the layer times are measured back to back. So each stage but the slowest pays the device's
wake-up cost once per micro-batch, on the op after its wait: its backward upstream of the slowest stage, its forward
downstream. The slowest never waits and pays nothing.

The charge is capped at the stage's slack (the slowest stage's time minus its own): a stage the charge would make
the slowest computes without pause, so it does not wait, and its cost is no longer cold. The charge therefore
never changes the steady state's period; it lengthens the fill and drain, and the stage times the run report
compares with. Where nothing is measured (GPU profiles so far, catalog clusters) the cost is 0 and plans are
unchanged.
"""
from __future__ import annotations

from typing import Mapping, Sequence

WAKE_UP_KEY = "wake_up_us"  # GPUSpec.measured: the profiler's wake-up cost per micro-batch, microseconds


def wake_up_s(measured: Mapping | None) -> float:
    """A device's measured wake-up cost in seconds (0 where it has none or the figure is not a positive number)."""
    value = (measured or {}).get(WAKE_UP_KEY)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return 0.0
    return float(value) * 1e-6


def wake_up_charges_s(fwd_s: Sequence[float], bwd_s: Sequence[float], wake_s: Sequence[float]) -> list[float]:
    """Per stage, the seconds per micro-batch its waits cost: min(wake, slowest - own time); 0 for the slowest."""
    times = [f + b for f, b in zip(fwd_s, bwd_s)]
    if not times:
        return []
    slowest = max(times)
    return [min(w, slowest - t) if t < slowest and w > 0 else 0.0 for t, w in zip(times, wake_s)]


def charge_wake_ups(fwd_s: Sequence[float], bwd_s: Sequence[float],
                    wake_s: Sequence[float]) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per micro-batch with each waiting stage's wake-up charge on the op after its
    wait: the backward upstream of the (first) slowest stage, the forward from there on."""
    charges = wake_up_charges_s(fwd_s, bwd_s, wake_s)
    fwd, bwd = list(fwd_s), list(bwd_s)
    if not charges or not any(charges):
        return fwd, bwd
    times = [f + b for f, b in zip(fwd_s, bwd_s)]
    first_slowest = times.index(max(times))
    for k, c in enumerate(charges):
        if k < first_slowest:
            bwd[k] += c
        else:
            fwd[k] += c
    return fwd, bwd
