"""Exact against the plain 1F1B simulation: when compose's complete pass covers every sequence.

The DP's dominance (dominance.py) is sound for the closed form only. The plain 1F1B simulation
(costmodel.pipeline.simulated_1f1b_s) reads more than an entry's fill, tail, stages behind and period: each stage's
forward and backward apart, the exact p2p at each boundary (the composer's link matrix holds a floor of it), and
where the slow stages sit. So a dominated entry can simulate faster, and which entries survive depends on the bounds
a query brings: the same size searched alone and searched after another size gave two plans. A search whose score
can be the plain simulation therefore ends with compose's complete pass, as one whose score interleaves does: no
entry or option stands for another, only the safe score floors prune, and every sequence takes part (not only
those that can interleave).

What keeps that pass cheap where many pipelines score within a few per cent of the best (layer splits shifted by
one): floors that count the stages behind a slow stage, as the simulation does (costmodel.plain_1f1b_paths). The DP
carries one in each entry's plain_s (behind_path_s, from an option's numbers: its slowest stage, its stages, the
fill behind it), and the driver's fine floor reads every stage's forward and backward (path_floor_1f1b_s).
"""
from __future__ import annotations


def plain_counts(schedules: tuple[str, ...]) -> bool:
    """Whether compose's score can be the plain 1F1B simulation (``score_schedules`` holding "plain"): its search
    then ends with the complete pass over every sequence, not only those that can interleave."""
    return "plain" in schedules


def behind_path_s(plain_s: float, m: int, bottleneck_s: float, fill_behind_s: float, most_warmup: int) -> float:
    """A DP entry's plain_s (compose.Entry: max over its options of a floor + the fill in front of the option
    within the sequence) with the option just added in front: costmodel.plain_1f1b_paths' paths through its slowest
    stage t with w <= ``most_warmup`` stages behind it, the fill behind the option (its link into the sequence
    behind, both ways, and that sequence's fill) standing for the stages behind: (m - w) t + 2 x that fill where
    w <= m - 2, (m - w) t + that fill where w = m - 1 (f, b <= t)."""
    if most_warmup <= m - 2:
        v = (m - most_warmup) * bottleneck_s + 2.0 * fill_behind_s
    elif most_warmup == m - 1:
        v = bottleneck_s + fill_behind_s
    else:
        return plain_s
    return v if v > plain_s else plain_s
