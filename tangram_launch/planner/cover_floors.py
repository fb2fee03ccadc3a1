"""Floors from covers: what any plan holding an option (or using an island) costs at least, from the cheapest
covers of the layers in front of it and behind it (ignoring that an island holds one slice, links and memory).

A plan holding option o (layers [s, t)) covers [0, s) and [t, L) with other options, so

    slowest stage  >= max(o's bottleneck, least period of a cover of [0, s), least period of a cover of [t, L))
    fill           >= least fill of a cover of [0, s) + o's time + least fill of a cover of [t, L)
    tail           >= max(o's tail, least tail of either cover)
    closed form    >= (m - 1) x slowest stage + fill + tail          (compose's objective)
    iteration      >= m x slowest stage + tail                       (under any score: plain or interleaved)

Above ``exact_islands`` islands the driver composes one option set in many island orders, each a full DP over
the options on a large cluster; dropping first the options no plan beating the incumbent can hold makes every
order cheaper and can leave few enough islands for the exact search. The same covers, without the island's own
options, give the floor a dropped island's reason quotes (dropped.py).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from tangram_launch.planner.bounds import covers_of, least_links, pair_minima, row_minima, score_floor_terms
from tangram_launch.planner.compose import SCORE_ANY, Option


def usable(options: Sequence[Option], idx: Sequence[int], num_layers: int) -> list[int]:
    """The options that fit somewhere and lie inside [0, L)."""
    return [oi for oi in idx if options[oi].max_after >= 0 and 0 <= options[oi].start < options[oi].stop <= num_layers]


def island_floor_s(options: Sequence[Option], idx: Sequence[int], island: int, num_layers: int,
                   num_microbatches: int) -> float:
    """A floor under the iteration (m x slowest stage + tail) of every plan from ``options[idx]`` that uses
    ``island``, its layers in front and behind covered by the other islands; inf when no plan can use it."""
    return island_floors_s(options, idx, [island], num_layers, num_microbatches)[island]


def island_floors_s(options: Sequence[Option], idx: Sequence[int], islands: Sequence[int], num_layers: int,
                    num_microbatches: int) -> dict[int, float]:
    """island_floor_s of each of ``islands``, passing over the options once: each island's options are reduced to
    their pair_minima, and the covers by the other islands read the merged minima (a few thousand pairs standing
    for up to hundreds of thousands of options)."""
    by_island: dict[int, list[int]] = {}
    for oi in usable(options, idx, num_layers):
        by_island.setdefault(options[oi][2], []).append(oi)
    minima = [pair_minima(options, lst) for lst in by_island.values()]
    # the other islands' minima merged: those before an island's and those after it, each merged once (K islands:
    # 3K merges, not K x (K - 1))
    before: list[dict] = [{}]
    for mk in minima:
        before.append(_merged(before[-1], mk))
    after: list[dict] = [{}]
    for mk in reversed(minima):
        after.append(_merged(mk, after[-1]))
    after.reverse()
    place = {k: i for i, k in enumerate(by_island)}
    out: dict[int, float] = {}
    for island in islands:
        i = place.get(island)
        others = before[-1] if i is None else _merged(before[i], after[i + 1])
        front = covers_of(others, num_layers, back=False)
        back = covers_of(others, num_layers, back=True)
        fp, ft, bp, bt = front.period_s, front.tail_s, back.period_s, back.tail_s
        best = math.inf
        for oi in by_island.get(island, ()):
            s, t, _, _, _, _, bn, tail_s = options[oi]
            v = num_microbatches * max(bn, fp[s], bp[t]) + max(tail_s, ft[s], bt[t])
            if v < best:
                best = v
        out[island] = best
    return out


def _merged(a: dict[tuple[int, int], list[float]], b: dict[tuple[int, int], list[float]]
            ) -> dict[tuple[int, int], list[float]]:
    """Per pair, the least of each number in ``a`` or ``b`` (pair_minima of a union; the lists are shared, not
    changed)."""
    if not a:
        return b
    if not b:
        return a
    out = dict(a)
    for pair, v in b.items():
        cur = out.get(pair)
        out[pair] = v if cur is None else [x if x < y else y for x, y in zip(cur, v)]
    return out


def promising(options: Sequence[Option], idx: Sequence[int], num_layers: int, num_microbatches: int,
              closed_to_beat_s: float, score_to_beat_s: float,
              link_s: Sequence[Sequence[float]] | None = None, *,
              schedules: tuple[str, ...] = SCORE_ANY, fill_weight: float = 0.0,
              rows: np.ndarray | None = None) -> list[int]:
    """The options of ``idx`` some plan holding which could still beat either bound: its closed form
    ``closed_to_beat_s`` or its iteration ``score_to_beat_s`` (compose keeps a plan while either can; what is
    dropped here it would prune at every use). In ``idx``'s order.

    ``link_s`` (compose's island links): an option not starting at layer 0 has another island's slice right in
    front of it, one not ending at L another's right behind it; the least such links then also bound the closed
    form's period, and each adds twice itself to the fill (compose counts a link per boundary that way). Not the
    iteration's floor: the plain 1F1B simulation takes a link as latency, so m x a link is not under it.

    ``schedules`` and ``fill_weight``: what the score can be, as compose's ``score_schedules`` and
    ``score_fill_weight`` (compose._dp's floors). With "plain", the option's slowest stage runs its m micro-batches
    after the least fill in front of it (bounds.plain_1f1b_floor_s); with "interleaved", after w x that fill, or the
    fill (the links in it), or m x the slowest stage of the covers, + tail (bounds.score_floor_terms), with w the
    larger of ``fill_weight`` and 1 / (n // s) for the option's n layers in s stages, and none below 2 layers per
    stage (a chunk holds a layer); with both, the lesser."""
    if rows is not None:
        return _promising_rows(rows, idx, num_layers, num_microbatches, closed_to_beat_s, score_to_beat_s, link_s,
                               schedules, fill_weight)
    idx = usable(options, idx, num_layers)
    if closed_to_beat_s == math.inf or score_to_beat_s == math.inf:
        return idx
    m1 = num_microbatches - 1
    minima = pair_minima(options, idx)
    front = covers_of(minima, num_layers, back=False)
    back = covers_of(minima, num_layers, back=True)
    ff, fp, ft = front
    bf, bp, bt = back
    L = num_layers
    # island -> least link into it from another island with options (and out of it)
    into, out_of = least_links(link_s, {options[oi].island for oi in idx}) if link_s is not None else ({}, {})
    links = any(into.values()) or any(out_of.values())
    m = num_microbatches
    plain, only_plain, w = score_floor_terms(schedules, fill_weight)  # the floors compose._dp prunes by
    known = plain or w > 0.0  # (else m x period + tail is all)
    inter = w > 0.0 and not only_plain
    out = []
    for oi in idx:
        s, t, island, ns, _, time_s, bn, tail_s = options[oi]
        stage = bn if bn > fp[s] else fp[s]
        if bp[t] > stage:
            stage = bp[t]
        tail = tail_s if tail_s > ft[s] else ft[s]
        if bt[t] > tail:
            tail = bt[t]
        least = m * stage + tail  # under every score (each floor below is at least this)
        if least < score_to_beat_s and not known:
            out.append(oi)
            continue
        period, fill = stage, ff[s] + time_s + bf[t]
        lk_in = lk_out = 0.0
        if links:
            if s:
                lk_in = lk = into[island]
                period, fill = (lk if lk > period else period), fill + 2.0 * lk
            if t < L:
                lk = lk_out = out_of[island]
                period, fill = (lk if lk > period else period), fill + 2.0 * lk
        if m1 * period + fill + tail < closed_to_beat_s:
            out.append(oi)
            continue
        if least >= score_to_beat_s:
            continue
        score = math.inf  # (known: the floors of the score's own schedules)
        if plain:
            front = ff[s] + 2.0 * lk_in + m * bn
            score = (front if front > m * stage else m * stage) + tail
        q = (t - s) // ns
        if inter and (q >= 2 or not plain):  # (interleaved only: below 2, the fill weight's floor, as _dp)
            wo = 1.0 / q if q >= 2 and q * w < 1.0 else w
            v = m * bn + wo * (ff[s] + 2.0 * lk_in)
            v = max(v, m * stage, fill + 2.0 * (lk_in + lk_out)) + tail  # (v >= 2 chunks cross each link twice more)
            score = v if v < score else score
        if score < score_to_beat_s:
            out.append(oi)
    return out


def _promising_rows(rows: np.ndarray, idx: Sequence[int], num_layers: int, num_microbatches: int,
                    closed_to_beat_s: float, score_to_beat_s: float, link_s: Sequence[Sequence[float]] | None,
                    schedules: tuple[str, ...], fill_weight: float) -> list[int]:
    """promising over ``rows`` (rows[i]: option idx[i]'s 8 fields): each step of the loop above as one operation
    on a column (max, +, x of IEEE doubles, in the loop's order: the same values, the same options kept)."""
    L = num_layers
    S, T = rows[:, 0], rows[:, 1]
    ok = (rows[:, 4] >= 0) & (S >= 0) & (S < T) & (T <= L)  # usable
    if not ok.all():
        keep_at = np.flatnonzero(ok)
        rows = rows[keep_at]
        idx = [idx[i] for i in keep_at.tolist()]
        S, T = rows[:, 0], rows[:, 1]
    else:
        idx = list(idx)
    if closed_to_beat_s == math.inf or score_to_beat_s == math.inf or not idx:
        return idx
    s_at, t_at, island = S.astype(np.intp), T.astype(np.intp), rows[:, 2].astype(np.intp)
    time_s, bn, tail_s = rows[:, 5], rows[:, 6], rows[:, 7]
    minima = _row_minima(rows, L)
    ff, fp, ft = (np.array(x) for x in covers_of(minima, L, back=False))
    bf, bp, bt = (np.array(x) for x in covers_of(minima, L, back=True))
    m = num_microbatches
    m1 = m - 1
    stage = np.maximum(np.maximum(bn, fp[s_at]), bp[t_at])
    tail = np.maximum(np.maximum(tail_s, ft[s_at]), bt[t_at])
    least = m * stage + tail
    plain, only_plain, w = score_floor_terms(schedules, fill_weight)
    period, fill = stage, ff[s_at] + time_s + bf[t_at]
    lk_in = lk_out = np.zeros(len(idx))
    if link_s is not None:
        into, out_of = least_links(link_s, set(island.tolist()))
        if any(into.values()) or any(out_of.values()):
            size = max(into) + 1
            into_of = np.array([into.get(k, 0.0) for k in range(size)])
            out_of_k = np.array([out_of.get(k, 0.0) for k in range(size)])
            front = S > 0
            lk_in = np.where(front, into_of[island], 0.0)
            period = np.where(front, np.maximum(lk_in, period), period)
            fill = np.where(front, fill + 2.0 * lk_in, fill)
            behind = T < L
            lk = out_of_k[island]
            period = np.where(behind, np.maximum(lk, period), period)
            fill = np.where(behind, fill + 2.0 * lk, fill)
            lk_out = np.where(behind, lk, 0.0)
    with np.errstate(invalid="ignore"):  # 0 x inf (m = 1, no cover in front): nan, not below it, as in the loop
        keep = m1 * period + fill + tail < closed_to_beat_s
    if not (plain or w > 0.0):  # m x the slowest stage + tail is all the score's floor
        keep |= least < score_to_beat_s
        return [idx[i] for i in np.flatnonzero(keep).tolist()]
    score = np.full(len(idx), math.inf)
    if plain:
        front_s = ff[s_at] + 2.0 * lk_in + m * bn
        score = np.maximum(front_s, m * stage) + tail
    if w > 0.0 and not only_plain:
        q = (t_at - s_at) // rows[:, 3].astype(np.intp)
        chunked = q >= 2
        wo = np.where(chunked & (q * w < 1.0), 1.0 / np.maximum(q, 1), w)
        v = np.maximum(np.maximum(m * bn + wo * (ff[s_at] + 2.0 * lk_in), m * stage), fill + 2.0 * (lk_in + lk_out))
        v = v + tail
        inter = chunked | (not plain)
        score = np.where(inter & (v < score), v, score)
    keep |= (least < score_to_beat_s) & (score < score_to_beat_s)
    return [idx[i] for i in np.flatnonzero(keep).tolist()]



def _row_minima(rows: np.ndarray, num_layers: int) -> dict:
    """pair_minima of ``rows`` (bounds.row_minima, as the dict covers_of reads)."""
    starts, stops, least = row_minima(rows, num_layers)
    return {(a, b): v for a, b, v in zip(starts.tolist(), stops.tolist(), least.tolist())}
