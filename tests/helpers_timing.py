"""Timing assertions that a shared, loaded machine does not turn into coin flips."""
from __future__ import annotations

from typing import Any, Callable


def layer_times_in_order(time_once: Callable[[], dict[str, Any]], *, tries: int = 5) -> dict[str, Any]:
    """``time_layer``'s result once forward+backward reads slower than forward (fastest repetitions compared).

    A busy machine only adds time, but it can add it to one pass's every repetition (a stretch of preemption
    longer than a pass), so a pass is timed again up to ``tries`` times; a profiler that really timed forward at
    least as slow as forward+backward fails every try."""
    seen = []
    for _ in range(tries):
        out = time_once()
        fwd, fwd_bwd = out["forward"].timing.min_s, out["forward_backward"].timing.min_s
        if fwd_bwd > fwd > 0:
            return out
        seen.append((fwd, fwd_bwd))
    raise AssertionError(f"forward+backward never timed slower than forward in {tries} tries (forward, "
                         f"forward+backward seconds): {seen}")
