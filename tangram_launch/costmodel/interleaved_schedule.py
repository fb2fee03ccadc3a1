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

import numpy as np

from tangram_launch.costmodel.blocks import ChunkBlock

_ORDER_MAX_OPS = 40_000  # orders of longer schedules are made again per call (a kept order costs ~150 bytes an op)
# the floor sums each rank's time in another order than the simulation's chunk by chunk: keep it strictly under
FLOOR_ROUNDING = 1e-9
_SIMULATIONS_KEPT = 256  # simulations kept by their stage times' values (a key holds 3 S floats)


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
def _order(S: int, m: int, v: int) -> tuple[list[int], ...]:
    """Every op of the schedule in an order where each comes after what it waits for (its dependency and the op
    before it on its rank), as columns: its end slot, rank, duration index, its dependency's end slot, link index,
    chunk, micro-batch; the 64 most recent shapes are kept.

    The order is the runtime's own lockstep (torch's ``_get_1f1b_rank_ops`` pads each rank's list so that the ranks
    move together): rank k runs its warm-up forward i at step k + i, and from step s0 = v S + 2 (S - 1 - k) its
    1F1B forward W + j at s0 + 2 j and its backward j at s0 + 2 j + 1 (W its warm-up forwards). Each op's dependency
    runs at an earlier step (tests/test_interleaved_prediction.py checks every shape up to 8 ranks), so sorting by
    step is such an order, made with a few array operations. Slot (2 (vs m + i) + backward) holds the end of virtual
    stage vs's forward or backward of micro-batch i; the slot 2 S v m stays 0.0, the dependency of virtual stage
    0's forwards. Duration index k: rank k's chunk forward, S + k: its chunk backward; link index k: the link in
    front of rank k (0: none, as on the wrap), S: none."""
    g = m // max(1, m // S)
    M = m * v  # each rank's forwards (and backwards)
    none = 2 * S * M
    k = np.repeat(np.arange(S, dtype=np.int64), M)
    i = np.tile(np.arange(M, dtype=np.int64), S)  # the rank's i-th forward, and its i-th backward
    warm = np.minimum((v - 1) * g + 2 * (S - k - 1), M)
    s0 = v * S + 2 * (S - 1 - k)
    micro = (i // (g * v)) * g + i % g  # op i's micro-batch: each chunk takes g of them in turn
    chunk_f = (i // g) % v
    chunk_b = v - 1 - chunk_f
    vs_f, vs_b = chunk_f * S + k, chunk_b * S + k
    slot_f, slot_b = 2 * (vs_f * m + micro), 2 * (vs_b * m + micro) + 1
    dep_f = np.where(vs_f > 0, 2 * ((vs_f - 1) * m + micro), none)  # the previous virtual stage's forward
    last = vs_b == v * S - 1
    dep_b = np.where(last, slot_b - 1, 2 * ((vs_b + 1) * m + micro) + 1)  # the next one's backward, or its forward
    link_b = np.where(last | (k == S - 1), S, k + 1)
    step = np.concatenate((np.where(i < warm, k + i, s0 + 2 * (i - warm)), s0 + 2 * i + 1))
    pick = np.argsort(step, kind="stable")
    return tuple(np.concatenate(pair)[pick].tolist() for pair in (
        (slot_f, slot_b), (k, k), (k, k + S), (dep_f, dep_b), (k, link_b), (chunk_f, chunk_b), (micro, micro)))


def _run(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int, v: int,
         blocks: list[ChunkBlock] | None) -> float:
    """The one simulation: one sweep over _order, every op starting at the later of its rank's previous op's end
    and its dependency's end plus the link; appends to ``blocks`` when given; returns the last end."""
    S = len(fwd_s)
    if not S:
        return 0.0
    m = max(1, m)
    _check(S, m)
    slots, ranks, ops, deps, link_at, chunks, micros = (_order(S, m, v) if 2 * S * v * m <= _ORDER_MAX_OPS
                                                        else _order.__wrapped__(S, m, v))
    durations = [f / v for f in fwd_s] + [b / v for b in bwd_s]
    links = (0.0, *p2p_s, 0.0)
    end = [0.0] * (2 * S * v * m + 1)
    free = [0.0] * S
    if blocks is None:
        for slot, k, op, dep, link in zip(slots, ranks, ops, deps, link_at):
            t = free[k]
            d = end[dep] + links[link]  # x + 0.0 is x (no link)
            if d > t:
                t = d
            end[slot] = free[k] = t + durations[op]
        return max(free)
    for slot, k, op, dep, link, c, i in zip(slots, ranks, ops, deps, link_at, chunks, micros):
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
    without building the blocks (the planner simulates the candidates it ranks). Kept by value (_simulated_s)."""
    return _simulated_s(tuple(map(float, fwd_s)), tuple(map(float, bwd_s)), tuple(map(float, p2p_s)), m, v)


@functools.lru_cache(maxsize=_SIMULATIONS_KEPT)
def _simulated_s(fwd_s: tuple[float, ...], bwd_s: tuple[float, ...], p2p_s: tuple[float, ...], m: int,
                 v: int) -> float:
    """simulated_interleaved_1f1b_s by the stage times' values: the composer scores a pipeline again in a later
    round of answers and build_plan once more, each time with new lists of the same numbers."""
    return _run(fwd_s, bwd_s, p2p_s, m, v, None)


def interleaved_floor_s(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                        v: int) -> float:
    """A floor under :func:`simulated_interleaved_1f1b_s` with ``v`` chunks per stage, in O(S): the larger of

    - per rank k: it starts with chunk 0's forward of micro-batch 0, which waits for that micro-batch's chunk-0
      forwards on ranks 0 .. k - 1 and the links between them; it then runs m v chunk forwards and backwards,
      m (f_k + b_k) in all, one at a time; its last op is chunk 0's backward of the last micro-batch (the last
      backward op's chunk is v - 1 - (m v / g - 1) mod v = 0, g dividing m), whose gradient then passes the chunk-0
      backwards of ranks k - 1 .. 0 and their links: m (f_k + b_k) + sum over j < k of ((f_j + b_j) / v + 2 p_j)
      (with fewer chunks per stage, no less);
    - micro-batch 0's way through all v S virtual stages and back: every stage's f + b, and each link v times each
      way (none on the wrap): sum of (f_j + b_j) + 2 v sum of p_j;

    less FLOOR_ROUNDING."""
    best = 0.0
    front = 0.0  # ranks 0 .. k - 1: their chunk's forward and backward, and the links both ways
    for k, (f, b) in enumerate(zip(fwd_s, bwd_s)):
        t = max(1, m) * (f + b) + front
        if t > best:
            best = t
        if k < len(p2p_s):
            front += (f + b) / v + 2.0 * p2p_s[k]
    way = sum(fwd_s) + sum(bwd_s) + 2.0 * v * sum(p2p_s)
    return (way if way > best else best) * (1.0 - FLOOR_ROUNDING)
