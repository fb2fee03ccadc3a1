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
carries one in each entry's plain_s, in every pass where a plain score counts (behind_path_s, from an option's
numbers: its slowest stage, its other stages (own_stages_s), its stages, the fill behind it), and adds micro-batch
0's way to a boundary to its round trips; the driver's floors read every stage's forward and backward
(path_floor_1f1b_s), its first one with the island matrix's p2p (floor_stage_times: no GPU placement for each near
tie), and leave the interleaved floor out where a pipeline cannot interleave (can_interleave).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.planner.build import Candidates
    from tangram_launch.planner.compose import Option


def plain_counts(schedules: tuple[str, ...]) -> bool:
    """Whether compose's score can be the plain 1F1B simulation (``score_schedules`` holding "plain"): its search
    then ends with the complete pass over every sequence, not only those that can interleave."""
    return "plain" in schedules


def behind_path_s(plain_s: float, m: int, bottleneck_s: float, own_s: float, fill_behind_s: float,
                  most_warmup: int) -> float:
    """A DP entry's plain_s (compose.Entry: max over its options of a floor + the fill in front of the option
    within the sequence) with the option just added in front: costmodel.plain_1f1b_paths' paths through its slowest
    stage t with w <= ``most_warmup`` stages behind it, the fill behind the option (its link into the sequence
    behind, both ways, and that sequence's fill) standing for the stages behind: (m - w) t + 2 x that fill +
    ``own_s`` (own_stages_s: the option's other stages on the path) where w <= m - 2, (m - w) t + that fill where
    w = m - 1 (f, b <= t)."""
    if most_warmup <= m - 2:
        v = (m - most_warmup) * bottleneck_s + 2.0 * fill_behind_s + own_s
    elif most_warmup == m - 1:
        v = bottleneck_s + fill_behind_s
    else:
        return plain_s
    return v if v > plain_s else plain_s


def behind_paths_s(plain_s: np.ndarray, m: int, bottleneck_s: float, own_s: float, fill_behind_s: np.ndarray,
                   most_warmup: np.ndarray) -> np.ndarray:
    """behind_path_s over arrays of entries (``plain_s``, ``fill_behind_s``, ``most_warmup`` elementwise), for the
    composer's big states (compose._entries_at_once): the same float operations in the same order, so the same
    values."""
    v = np.where(most_warmup <= m - 2, (m - most_warmup) * bottleneck_s + 2.0 * fill_behind_s + own_s,
                 np.where(most_warmup == m - 1, bottleneck_s + fill_behind_s, -np.inf))
    return np.where(v > plain_s, v, plain_s)


def own_stages_s(time_s: float, bottleneck_s: float) -> float:
    """What an option's other stages add to behind_path_s's path through its slowest stage (t = ``bottleneck_s``,
    a stage's time as SlicePlan.bottleneck_s is) where w <= m - 2: with r = ``time_s`` - t (the other stages and the
    option's internal p2p, both ways) and the slowest stage j-th of the option, the path runs through the j stages
    in front of it (pre, once) and those behind it (R, twice; pre + R = r), and j fewer warm-ups add j t: at j = 0,
    2 r; else at least t + r. So r + min(r, t), 0 for one stage."""
    rest = time_s - bottleneck_s
    if rest <= 0.0:
        return 0.0
    return rest + (rest if rest < bottleneck_s else bottleneck_s)


def floor_stage_times(cand: "Candidates", seq: Sequence[int], per_option: dict) -> tuple[list, list, list]:
    """Forward and backward seconds of every stage of a sequence of options (``cand``'s indices) and a floor of the
    one-way p2p at each stage boundary: the island matrix's (Candidates.link_matrix, under the exact boundaries
    that Candidates.stage_times reads from the stages' GPUs), 0.0 inside a slice plan. Every plain 1F1B floor that
    is a path of the schedule (a longest path grows with every time) lies under the simulation with these times,
    and they need no GPU placement: the composer's complete pass asks for thousands of near ties. ``per_option``:
    a dict the caller keeps, an option -> its stages' forward and backward seconds."""
    fwd: list[float] = []
    bwd: list[float] = []
    p2p: list[float] = []
    links, options = cand.link_matrix, cand.options
    for n, oi in enumerate(seq):
        hit = per_option.get(oi)
        if hit is None:
            stages = cand.sources[oi][1].stages
            hit = per_option[oi] = ([s.forward_s for s in stages], [s.backward_s for s in stages])
        if n:
            p2p.append(links[options[seq[n - 1]].island][options[oi].island])
        p2p.extend([0.0] * (len(hit[0]) - 1))
        fwd.extend(hit[0])
        bwd.extend(hit[1])
    return fwd, bwd, p2p


def can_interleave(seq: Sequence[int], options: Sequence["Option"], m: int) -> bool:
    """Whether a sequence of options may interleave at all (interleave.choose_virtual_stages): 2 stages at least,
    dividing the m micro-batches, and 2 layers a stage at least (an option of n layers in s stages has a stage of
    at most n // s). Where it may not and a plain score counts, the score is the plain simulation, and only the plain
    floors lie under it."""
    stages = sum(options[oi].num_stages for oi in seq)
    return stages >= 2 and m % stages == 0 and all(
        (options[oi].stop - options[oi].start) // options[oi].num_stages >= 2 for oi in seq)
