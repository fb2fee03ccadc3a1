"""The interleaved 1F1B schedule as events: every chunk's forward and backward on every pipeline rank.

The schedule is the one the torch runtime runs (``torch.distributed.pipelining.ScheduleInterleaved1F1B``, the
order of Megatron-core's virtual pipeline): rank k of S holds v chunks, chunk j of rank k being virtual stage
j * S + k. Micro-batches go in rounds of g = m // max(1, m // S); rank k first runs (v - 1) g + 2 (S - k - 1)
warm-up chunk forwards (at most m v), then alternates one forward and one backward, then drains its backwards.
Its forward op i runs chunk (i // g) mod v, its backward op i chunk v - 1 - (i // g) mod v, each on that chunk's
next micro-batch.

A chunk takes 1/v of its stage's forward or backward time. A forward waits for the previous virtual stage's forward
of its micro-batch (plus the link between the two ranks; none on the wrap from the last rank to the first, which
the runtime overlaps, as the closed form in pipeline.py assumes), a backward for the next virtual stage's backward
(the last virtual stage: its own forward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tangram_launch.costmodel.pipeline import Block


@dataclass(frozen=True)
class ChunkBlock(Block):
    chunk: int = 0  # the model chunk of the stage (0 .. v - 1)


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


def simulate_interleaved_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
                              v: int) -> list[ChunkBlock]:
    """Start and end of every chunk forward and backward (see the module docstring)."""
    S = len(fwd_s)
    m = max(1, m)
    if S > 1 and m % S:
        raise ValueError(f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of the stages ({S})")
    orders = [_rank_order(k, S, m, v) for k in range(S)]
    end: dict[tuple[bool, int, int, int], float] = {}  # (forward, virtual stage, micro) -> end
    nxt = [[[0] * v for _ in range(2)] for _ in range(S)]  # [k][backward][chunk]: its next micro-batch
    pos, free = [0] * S, [0.0] * S
    blocks: list[ChunkBlock] = []
    last_vs = v * S - 1
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for k in range(S):
            while pos[k] < len(orders[k]):
                forward, c = orders[k][pos[k]]
                i = nxt[k][0 if forward else 1][c]
                vs = c * S + k
                if forward:
                    dep_key = (True, vs - 1, i) if vs else None
                    link = p2p_s[k - 1] if k else 0.0
                else:
                    dep_key = (True, vs, i) if vs == last_vs else (False, vs + 1, i)
                    link = 0.0 if vs == last_vs or k == S - 1 else p2p_s[k]
                if dep_key is not None and dep_key not in end:
                    break
                dep = end[dep_key] + link if dep_key is not None else 0.0
                start = max(free[k], dep)
                free[k] = start + (fwd_s[k] if forward else bwd_s[k]) / v
                end[(forward, vs, i)] = free[k]
                blocks.append(ChunkBlock(k, "F" if forward else "B", i, start, free[k], c))
                nxt[k][0 if forward else 1][c] += 1
                pos[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedule has no deadlock; guard against a bad input
            raise RuntimeError("interleaved 1F1B simulation stalled")
    return blocks
