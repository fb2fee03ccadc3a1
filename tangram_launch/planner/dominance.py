"""Which DP entries and options stand for others in the composer (compose.py), and why that is safe for the closed
form: an entry (a sequence covering [j, L)) with no more fill, tail, stages behind and period than another has a
completion no worse in (m - 1) x period + fill + tail for every front part, and an option no worse than another of
the same layers and island in time, bottleneck, tail, stages and room for following stages makes such entries.

The interleaved simulation is not ordered so: it reads each stage's time, needs the stage count to divide the
micro-batches and gives a chunk one layer at least, so a dominated entry or option can score less. compose's
complete pass, where the score interleaves, uses none of these. Nor is the plain 1F1B simulation, which reads each
stage's forward and backward and the p2p on the steady state's cycle: compose's complete pass covers it too
(plain_complete.py).
"""
from __future__ import annotations

import bisect
import math
import operator
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.planner.compose import Option

AFTER = operator.itemgetter(2)  # an entry's stages behind
FILL_ORDER = operator.itemgetter(0, 1, 2, 3)  # sort key of DP entries: fill, tail, after, period


def pareto_front(entries: list, quantum: float) -> list:
    """Entries not dominated in (fill_s, tail_s, after, period): lower is better in each (fewer stages behind
    leave more memory for the options in front; a lower period lowers every completion's steady state). Returned
    sorted by ``after`` so that the entries an option fits in front of form a prefix.

    quantum > 0 compares periods by their bucket on a geometric grid of ratio 1 + quantum instead (compose's
    ``bound_step``): buckets compare transitively, so the plan kept has a period less than (1 + quantum) x that
    of any plan it stands for, and no more fill and tail."""
    if len(entries) == 1:
        return entries
    entries.sort(key=FILL_ORDER)
    scale = 1.0 / math.log1p(quantum) if quantum > 0 else 0.0
    kept: list = []
    # per "after" value, a staircase of the kept entries' (tail, period): tail ascending, period strictly
    # descending, so "a kept entry with tail <= t and period <= p" is one bisection per after value <= a
    stairs: dict[int, tuple[list, list]] = {}
    afters: list[int] = []
    for e in entries:
        tail, after, per = e[1], e[2], e[3]
        if scale:
            per = math.floor(math.log(per) * scale) if per > 0 else -math.inf
        dominated = False
        for a in afters:
            if a > after:
                break
            tails, pers = stairs[a]
            i = bisect.bisect_right(tails, tail)
            if i and pers[i - 1] <= per:
                dominated = True
                break
        if not dominated:
            kept.append(e)
            st = stairs.get(after)
            if st is None:
                st = stairs[after] = ([], [])
                bisect.insort(afters, after)
            tails, pers = st
            i = bisect.bisect_right(tails, tail)
            k = i
            while k < len(tails) and pers[k] >= per:  # points e now dominates within this after value
                k += 1
            tails[i:k] = [tail]
            pers[i:k] = [per]
    kept.sort(key=AFTER)
    return kept


def covered_rooms(options: Sequence[Option], order: Sequence[int]) -> list[int]:
    """Per option of one (stop, island) group, in the DP's order: the largest ``max_after`` of an option before it
    on the same layers with no more time, tail, stages and bottleneck (-1: none); computed in the group's own
    order, which compose's orders by floor keep for such pairs. In front of every entry that
    earlier option fits, it adds an entry with no more fill, tail, stages, period or plain_s, appended first, and
    every prune that keeps this option's entry keeps that one (the floors grow with those four numbers): pareto_front
    would drop this option's entry there, so the DP does not build it. Options differ mostly in memory (recompute,
    ZeRO): the faster one covers the entries near the back, the leaner one is needed only further forward.

    An option whose room is no less than its own max_after is not kept for the later ones: whatever it covers, the
    option that covers it covers too (no more of each of the four), with no less room, so no room changes."""
    out = []
    # start -> (-max_after, time, tail, stages, bottleneck) of earlier options, most room first: the first that
    # covers an option has the most room of those that do
    seen: dict[int, list[tuple]] = {}
    for oi in order:
        start, _stop, _island, stages, max_after, time_s, bottleneck_s, tail_s = options[oi]
        room = -1
        earlier = seen.get(start)
        if earlier is None:
            earlier = seen[start] = []
        for neg_room, t, tl, ns, bn in earlier:
            if t <= time_s and tl <= tail_s and ns <= stages and bn <= bottleneck_s:
                room = -neg_room
                break
        if room < max_after:
            bisect.insort(earlier, (-max_after, time_s, tail_s, stages, bottleneck_s))
        out.append(room)
    return out

