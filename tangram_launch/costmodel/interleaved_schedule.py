"""The interleaved 1F1B schedule as events: every chunk's forward and backward on every pipeline rank.

This simulation is the prediction of an interleaved plan (planner/interleave.py), the ``estimate`` figure and the
timeline's bars, so the three agree to the last bit.

The schedule is the one the torch runtime runs (``torch.distributed.pipelining.ScheduleInterleaved1F1B``, the
order of Megatron-core's virtual pipeline): rank k of S holds v chunks, chunk j of rank k being virtual stage
j * S + k. Micro-batches go in rounds of g = m // max(1, m // S); rank k first runs (v - 1) g + 2 (S - k - 1)
warm-up chunk forwards (at most m v), then alternates one forward and one backward, then drains its backwards.
Its forward op i runs chunk (i // g) mod v, its backward op i chunk v - 1 - (i // g) mod v, each on that chunk's
next micro-batch.

A chunk takes 1/v of its stage's forward or backward time. A forward waits for the previous virtual stage's forward
of its micro-batch (plus the link between the two ranks; none on the wrap from the last rank to the first, which
the runtime overlaps), a backward for the next virtual stage's backward (the last virtual stage: its own forward).

The closed form m x period + (fill - period) / v (costmodel/pipeline.py) is exact for equal stages without links
but is no floor of this simulation: a first stage slower than the others is never idle, so the run takes its m
micro-batches' time, less than the closed form's m x period + (the other stages) / v. :func:`interleaved_floor_s`
is a floor.
"""
from __future__ import annotations

import functools
from typing import Sequence

from tangram_launch.costmodel.blocks import ChunkBlock

_ORDER_MAX_OPS = 40_000  # orders of longer schedules are made again per call (a kept order costs ~100 bytes an op)
# the floor sums each rank's time in another order than the simulation's chunk by chunk: keep it strictly under
FLOOR_ROUNDING = 1e-9


def _rank_order(k: int, S: int, m: int, v: int) -> list[tuple[bool, int]]:
    """Rank k's ops in order: (is_forward, chunk); the micro-batch is each chunk's next one."""
    g = m // max(1, m // S)
    total = m * v
    warm = min((v - 1) * g + 2 * (S - k - 1), total)
    fwd = [(True, (i // g) % v) for i in range(total)]
    bwd = [(False, v - 1 - (i // g) % v) for i in range(total)]
    ops = fwd[:warm]
    for i in range(total - warm):
        ops += [fwd[warm + i], bwd[i]]
    return ops + bwd[total - warm:]


def _check(S: int, m: int) -> None:
    if S > 1 and m % S:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of the stages ({S})")


@functools.lru_cache(maxsize=64)
def _order(S: int, m: int, v: int) -> tuple[tuple[int, int, int, int, int, int, int], ...]:
    """Every op of the schedule in an order where each comes after what it waits for (its dependency and the op
    before it on its rank), as (its end slot, rank, duration index, its dependency's end slot, link index,
    chunk, micro-batch); the 64 most recent shapes are kept.

    Made once per shape by advancing every rank through its own order as far as its dependencies have run, round
    after round (the schedule has no deadlock). Slot (2 (vs m + i) + backward) holds the end of virtual stage vs's
    forward or backward of micro-batch i; the slot 2 S v m stays 0.0, the dependency of virtual stage 0's forwards.
    Duration index k: rank k's chunk forward, S + k: its chunk backward; link index k: the link in front of rank k
    (0: none, as on the wrap), S: none."""
    orders = [_rank_order(k, S, m, v) for k in range(S)]
    none = 2 * S * v * m
    done = bytearray(none + 1)
    done[none] = 1
    nxt = [[0] * (2 * v) for _ in range(S)]  # [k][2 c + backward]: that chunk's next micro-batch
    pos = [0] * S
    out: list[tuple[int, int, int, int, int, int, int]] = []
    last_vs = v * S - 1
    while len(out) < none:
        progressed = False
        for k in range(S):
            ops, p, seen = orders[k], pos[k], nxt[k]
            while p < len(ops):
                forward, c = ops[p]
                vs = c * S + k
                i = seen[2 * c + (not forward)]
                if forward:
                    dep, link = (2 * ((vs - 1) * m + i) if vs else none), k
                elif vs == last_vs:
                    dep, link = 2 * (vs * m + i), S  # its own forward
                else:
                    dep, link = 2 * ((vs + 1) * m + i) + 1, (k + 1 if k < S - 1 else S)
                if not done[dep]:
                    break
                slot = 2 * (vs * m + i) + (not forward)
                done[slot] = 1
                out.append((slot, k, k if forward else S + k, dep, link, c, i))
                seen[2 * c + (not forward)] = i + 1
                p += 1
            if p != pos[k]:
                pos[k] = p
                progressed = True
        if not progressed:  # pragma: no cover - the schedule has no deadlock; guard against a bad input
            raise RuntimeError("interleaved 1F1B simulation stalled")
    return tuple(out)


def _run(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int, v: int,
         blocks: list[ChunkBlock] | None) -> float:
    """The one simulation: one sweep over _order, every op starting at the later of its rank's previous op's end
    and its dependency's end plus the link; appends to ``blocks`` when given; returns the last end."""
    S = len(fwd_s)
    if not S:
        return 0.0
    m = max(1, m)
    _check(S, m)
    order = _order(S, m, v) if 2 * S * v * m <= _ORDER_MAX_OPS else _order.__wrapped__(S, m, v)
    durations = [f / v for f in fwd_s] + [b / v for b in bwd_s]
    links = (0.0, *p2p_s, 0.0)
    end = [0.0] * (2 * S * v * m + 1)
    free = [0.0] * S
    if blocks is None:
        for slot, k, op, dep, link, _, _ in order:
            t = free[k]
            d = end[dep] + links[link]  # x + 0.0 is x (no link)
            if d > t:
                t = d
            end[slot] = free[k] = t + durations[op]
        return max(free)
    for slot, k, op, dep, link, c, i in order:
        t = free[k]
        d = end[dep] + links[link]
        if d > t:
            t = d
        end[slot] = free[k] = t + durations[op]
        blocks.append(ChunkBlock(k, "F" if op < S else "B", i, t, free[k], c))
    return max(free)


def simulate_interleaved_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                              v: int) -> list[ChunkBlock]:
    """Start and end of every chunk forward and backward (see the module docstring), in a dependency order."""
    blocks: list[ChunkBlock] = []
    _run(fwd_s, bwd_s, p2p_s, m, v, blocks)
    return blocks


def simulated_interleaved_1f1b_s(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                                 v: int) -> float:
    """When the last op of :func:`simulate_interleaved_1f1b`'s schedule ends: the same sweep and float operations,
    without building the blocks (the planner simulates the candidates it ranks)."""
    return _run(fwd_s, bwd_s, p2p_s, m, v, None)


def interleaved_floor_s(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                        v: int) -> float:
    """A floor under :func:`simulated_interleaved_1f1b_s` for any v' <= ``v`` chunks per stage, in O(S).

    Rank k starts with chunk 0's forward of micro-batch 0, which waits for that micro-batch's chunk-0 forwards on
    ranks 0 .. k - 1 and the links between them; it then runs m v chunk forwards and backwards, m (f_k + b_k) in
    all, one at a time; its last op is chunk 0's backward of the last micro-batch (the last backward op's chunk is
    v - 1 - (m v / g - 1) mod v = 0, g dividing m), whose gradient then passes the chunk-0 backwards of ranks
    k - 1 .. 0 and their links. A chunk takes (f + b) / v' >= (f + b) / v of a rank's time, so the run takes at
    least max over k of m (f_k + b_k) + sum over j < k of ((f_j + b_j) / v + 2 p_j) (less FLOOR_ROUNDING)."""
    best = 0.0
    front = 0.0  # ranks 0 .. k - 1: their chunk's forward and backward, and the links both ways
    for k, (f, b) in enumerate(zip(fwd_s, bwd_s)):
        t = max(1, m) * (f + b) + front
        if t > best:
            best = t
        if k < len(p2p_s):
            front += (f + b) / v + 2.0 * p2p_s[k]
    return best * (1.0 - FLOOR_ROUNDING)
