"""Floors from covers: what any plan holding an option (or using an island) costs at least, from the cheapest
covers of the layers in front of it and behind it (ignoring that an island holds one slice, links and memory).

A plan holding option o (layers [s, t)) covers [0, s) and [t, L) with other options, so

    slowest stage  >= max(o's bottleneck, least period of a cover of [0, s), least period of a cover of [t, L))
    fill           >= least fill of a cover of [0, s) + o's time + least fill of a cover of [t, L)
    tail           >= max(o's tail, least tail of either cover)
    closed form    >= (m - 1) x slowest stage + fill + tail          (compose's objective)
    iteration      >= m x slowest stage + tail                       (compose's score floor: plain or interleaved)

Above ``exact_islands`` islands the driver composes one option set in many island orders (a second or more each on
4,096 GPUs, with 265,000 options); dropping first the options no plan beating the incumbent can hold makes every
order cheaper and can leave few enough islands for the exact search. The same covers, without the island's own
options, give the floor a dropped island's reason quotes (dropped.py).
"""
from __future__ import annotations

import math
from typing import Sequence

from tangram_launch.planner.compose import Option, covers_of, pair_minima


def usable(options: Sequence[Option], idx: Sequence[int], num_layers: int) -> list[int]:
    """The options that fit somewhere and lie inside [0, L)."""
    return [oi for oi in idx if options[oi].max_after >= 0 and 0 <= options[oi].start < options[oi].stop <= num_layers]


def island_floor_s(options: Sequence[Option], idx: Sequence[int], island: int, num_layers: int,
                   num_microbatches: int) -> float:
    """A floor under the iteration (m x slowest stage + tail) of every plan from ``options[idx]`` that uses
    ``island``, its layers in front and behind covered by the other islands; inf when no plan can use it."""
    idx = usable(options, idx, num_layers)
    minima = pair_minima(options, [oi for oi in idx if options[oi].island != island])
    front = covers_of(minima, num_layers, back=False)
    back = covers_of(minima, num_layers, back=True)
    best = math.inf
    for oi in idx:
        o = options[oi]
        if o.island != island:
            continue
        period = max(o.bottleneck_s, front.period_s[o.start], back.period_s[o.stop])
        tail = max(o.tail_s, front.tail_s[o.start], back.tail_s[o.stop])
        best = min(best, num_microbatches * period + tail)
    return best


def promising(options: Sequence[Option], idx: Sequence[int], num_layers: int, num_microbatches: int,
              closed_to_beat_s: float, score_to_beat_s: float) -> list[int]:
    """The options of ``idx`` some plan holding which could still beat either bound: its closed form
    ``closed_to_beat_s`` or its iteration ``score_to_beat_s`` (compose keeps a plan while either can; what is
    dropped here it would prune at every use). In ``idx``'s order."""
    idx = usable(options, idx, num_layers)
    if closed_to_beat_s == math.inf or score_to_beat_s == math.inf:
        return idx
    m1 = num_microbatches - 1
    minima = pair_minima(options, idx)
    front = covers_of(minima, num_layers, back=False)
    back = covers_of(minima, num_layers, back=True)
    ff, fp, ft = front
    bf, bp, bt = back
    out = []
    for oi in idx:
        s, t, _, _, _, time_s, bn, tail_s = options[oi]
        period = max(bn, fp[s], bp[t])
        tail = max(tail_s, ft[s], bt[t])
        if m1 * period + ff[s] + time_s + bf[t] + tail < closed_to_beat_s or \
                num_microbatches * period + tail < score_to_beat_s:
            out.append(oi)
    return out
