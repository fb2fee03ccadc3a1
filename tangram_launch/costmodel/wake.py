"""The wake-up cost of a stage that waits: one measured figure per device, charged per micro-batch.

In a 1F1B pipeline of unequal stages every stage runs at the pace of the slowest. Each other stage idles once per
micro-batch in the steady state: downstream of the slowest it waits for its forward's input, upstream of it for its
backward's gradient (the event simulation in costmodel/pipeline.py shows the idle gaps there). The compute after
such a wait runs cold (the profiler's ``wake_up_us``: a stage-like micro-batch after a sleep against back to back,
profiler/wake.py), while the layer times are measured back to back. So each stage but the slowest pays the device's
wake-up cost once per micro-batch, on the op after its wait: its backward upstream of the slowest stage, its forward
downstream. The slowest never waits and pays nothing.

The charge grows with the wait: on a host with other work, that work evicts the stage's working set while the stage
waits, so a stage that waits half as long as the profiler's devices did (``wake_up_wait_us``: its collective's wait
for slower peers and its sleep) is charged half the cost, one that waits as long or longer the whole of it. A stage
waits, per micro-batch in the steady state, the slowest stage's time minus its own (its slack). Without the wait
figure (profiles from before it) the whole cost is charged.

The charge is capped at the stage's slack (the slowest stage's time minus its own): a stage the charge would make
the slowest computes without pause, so it does not wait, and its cost is no longer cold. The charge therefore
never changes the steady state's period; it lengthens the fill and drain, and the stage times the run report
compares with. Where nothing is measured (GPU profiles so far, catalog clusters) the cost is 0 and plans are
unchanged.
"""
from __future__ import annotations

from typing import Mapping, Sequence

WAKE_UP_KEY = "wake_up_us"  # GPUSpec.measured: the profiler's wake-up cost per micro-batch, microseconds
WAKE_UP_WAIT_KEY = "wake_up_wait_us"  # GPUSpec.measured: how long the profiler's devices waited before it


def _positive_us_s(measured: Mapping | None, key: str) -> float:
    value = (measured or {}).get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return 0.0
    return float(value) * 1e-6


def wake_up_s(measured: Mapping | None) -> float:
    """A device's measured wake-up cost in seconds (0 where it has none or the figure is not a positive number)."""
    return _positive_us_s(measured, WAKE_UP_KEY)


def wake_up_wait_s(measured: Mapping | None) -> float:
    """How long the device waited before its wake-up cost was measured, seconds (0: not known)."""
    return _positive_us_s(measured, WAKE_UP_WAIT_KEY)


def wake_up_charges_s(fwd_s: Sequence[float], bwd_s: Sequence[float], wake_s: Sequence[float],
                      waited_s: Sequence[float] | None = None) -> list[float]:
    """Per stage, the seconds per micro-batch its waits cost: the wake-up cost times min(1, its wait / the wait it
    was measured after; 1 where that is unknown), its wait being the slowest stage's time minus its own, capped at
    that wait; 0 for the slowest."""
    times = [f + b for f, b in zip(fwd_s, bwd_s)]
    if not times:
        return []
    slowest = max(times)
    waited = list(waited_s) if waited_s is not None else [0.0] * len(times)
    out = []
    for t, w, m in zip(times, wake_s, waited):
        slack = slowest - t
        if not (t < slowest and w > 0):
            out.append(0.0)
            continue
        out.append(min(w * (min(1.0, slack / m) if m > 0 else 1.0), slack))
    return out


def charge_wake_ups(fwd_s: Sequence[float], bwd_s: Sequence[float], wake_s: Sequence[float],
                    waited_s: Sequence[float] | None = None) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per micro-batch with each waiting stage's wake-up charge on the op after its
    wait: the backward upstream of the (first) slowest stage, the forward from there on."""
    charges = wake_up_charges_s(fwd_s, bwd_s, wake_s, waited_s)
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
