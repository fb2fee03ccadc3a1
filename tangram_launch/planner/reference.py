"""Brute-force composer: every sequence of options, for checking the DP on small instances (<= 8 layers, <= 3
islands). Exponential; never used for planning."""
from __future__ import annotations

from typing import Sequence

from tangram_launch.planner.compose import Composition, Metrics, Option, evaluate


def brute_force(options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int,
                num_microbatches: int, *, allowed_mask: int | None = None, required_mask: int = 0,
                max_stages: int | None = None, island_order: Sequence[int] | None = None) -> Composition | None:
    """The lowest-latency feasible sequence, by enumerating all covers of [0, L) with distinct islands."""
    by_start: dict[int, list[int]] = {}
    for i, o in enumerate(options):
        if allowed_mask is None or allowed_mask >> o.island & 1:
            by_start.setdefault(o.start, []).append(i)
    best: list[Composition | None] = [None]

    def walk(pos: int, used: int, seq: list[int], stages: int) -> None:
        if pos == num_layers:
            if used & required_mask != required_mask:
                return
            m = evaluate(seq, options, link_s, num_microbatches)
            if m is not None and (best[0] is None or m.latency_s < best[0].latency_s):
                best[0] = Composition(tuple(seq), m, m.period_s)
            return
        for oi in by_start.get(pos, ()):
            o = options[oi]
            if used >> o.island & 1 or o.stop > num_layers:
                continue
            if island_order is not None and seq:
                last = options[seq[-1]].island
                if o.island not in island_order or island_order.index(o.island) <= island_order.index(last):
                    continue
            if max_stages is not None and stages + o.num_stages > max_stages:
                continue
            seq.append(oi)
            walk(o.stop, used | 1 << o.island, seq, stages + o.num_stages)
            seq.pop()

    walk(0, 0, [], 0)
    return best[0]


def feasible_sequences(options: Sequence[Option], link_s: Sequence[Sequence[float]], num_layers: int,
                       num_microbatches: int) -> list[tuple[tuple[int, ...], Metrics]]:
    """Every front-to-back sequence covering [0, L) with distinct islands that fits in memory, with its metrics
    (to check floors such as dropped.island_floor_s against every plan)."""
    by_start: dict[int, list[int]] = {}
    for i, o in enumerate(options):
        by_start.setdefault(o.start, []).append(i)
    out: list[tuple[tuple[int, ...], Metrics]] = []

    def walk(pos: int, used: int, seq: list[int]) -> None:
        if pos == num_layers:
            m = evaluate(seq, options, link_s, num_microbatches)
            if m is not None:
                out.append((tuple(seq), m))
            return
        for oi in by_start.get(pos, ()):
            o = options[oi]
            if used >> o.island & 1 or o.stop > num_layers:
                continue
            seq.append(oi)
            walk(o.stop, used | 1 << o.island, seq)
            seq.pop()

    walk(0, 0, [])
    return out
