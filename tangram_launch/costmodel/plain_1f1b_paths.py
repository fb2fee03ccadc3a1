"""Floors under the plain 1F1B simulation (costmodel.pipeline.simulated_1f1b_s) from paths of its schedule.

The simulation's end is the longest path through its ops (each op starts at the later of its stage's previous op's
end and its dependency's end + the link), so the length of any path of the schedule lies under it. Stage k of S runs
w = min(S - k - 1, m) warm-up forwards, then F(w + j), B(j) in turn, then drains its backwards. With ``pre`` the
forwards and backwards of the stages in front of k and their links (micro-batch 0's way to k, micro-batch m - 1's way
back) and ``behind`` the stages behind k and their links, both ways (F_k(i) -> F_k+1(i) ... F_S-1(i), B_S-1(i) ...
B_k+1(i) -> B_k(i)), four paths through stage k:

    all of stage k's ops                                   pre + m t_k
    micro-batch 0 behind, then stage k from B_k(0) on      pre + m t_k - w f_k + behind
    stage k up to F_k(m - 1), then m - 1 behind            pre + m t_k - w b_k + behind           (w <= m - 1)
    both (B_k(0) comes before F_k(m - 1))                  pre + (m - w) t_k + 2 behind           (w <= m - 2)

where t = f + b. The first is bounds.plain_1f1b_floor_s's; the others count the stages behind a slow stage, which
its warm-up hides only in part: a slow first stage with w stages behind it waits for the first backward to come
back and, at the end, for the last. For one slow stage whose neighbours keep up that is the simulation itself.
"""
from __future__ import annotations

from typing import Sequence


def path_floor_1f1b_s(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int) -> float:
    """The longest of the four paths (the module docstring) over every stage: under simulated_1f1b_s of the same
    times (up to the rounding of sums taken in another order)."""
    S = len(fwd_s)
    m = max(1, m)
    behind = [0.0] * S
    acc = 0.0
    for k in range(S - 1, 0, -1):
        acc += fwd_s[k] + bwd_s[k] + 2.0 * p2p_s[k - 1]
        behind[k - 1] = acc
    best = pre = 0.0
    for k in range(S):
        f, b = fwd_s[k], bwd_s[k]
        t = f + b
        w = min(S - k - 1, m)
        bh = behind[k]
        idle_first = bh - w * f  # waiting for micro-batch 0's backward
        idle_last = bh - w * b if w <= m - 1 else 0.0  # waiting for micro-batch m - 1's
        if w <= m - 2:
            v = m * t + max(0.0, idle_first) + max(0.0, idle_last)
        else:
            v = m * t + max(0.0, idle_first, idle_last)
        v += pre
        if v > best:
            best = v
        pre += t + (2.0 * p2p_s[k] if k < S - 1 else 0.0)
    return best
