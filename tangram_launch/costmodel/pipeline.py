"""The 1F1B iteration time: one event simulation for every prediction, one closed form for the search.

The Plan's predicted iteration, ``tangram-launch estimate`` and the timeline picture all come from
:func:`simulate_1f1b` (:func:`simulated_1f1b_s` runs the same simulation without keeping the blocks), so a picture's
bars end where its title says. The composer's dynamic program searches with the closed form below (cheap, and an
upper bound of the simulation when links are free); with p2p latency on the steady state's path the simulation can
end later, and the Plan reports the simulation.

A non-interleaved 1F1B pipeline of m micro-batches (Narayanan et al. 2021, sec. 2.2: (m + p - 1) slots for equal
stages) takes the time for the first micro-batch to pass forward and backward through every stage and link (the
fill), plus (m - 1) periods of the slowest stage or link, plus the slowest stage's per-iteration data-parallel
sync and optimizer step (the tail)::

    iteration = (m - 1) x period + fill + tail

The interleaved 1F1B schedule (Narayanan et al. 2021, sec. 2.2.2; Megatron-core's
``virtual_pipeline_model_parallel_size``) gives every pipeline rank ``v`` model chunks of 1/v of its layers; a
micro-batch visits the ranks v times, so the fill and drain shrink by v while the steady state is unchanged
(bubble (p - 1) / v x (t_f + t_b) for p equal stages)::

    iteration = m x period + (fill - period) / v + tail          (v = 1: the formula above)

That closed form is exact for equal stages without links only; an interleaved plan's prediction is the event
simulation of the schedule the runtime runs (costmodel/interleaved_schedule.py), which the closed form does not
bound either way (a slow first stage is never idle: less; links crossed v times: more).

It costs activation memory: rank k of p starts with 2 (p - k - 1) + (v - 1) p warm-up chunk forwards (Megatron-core's
``get_num_warmup_microbatches`` for the interleaved schedule), each 1/v of the stage's activations, so the first
rank holds about p (1 + 1/v) micro-batches' worth instead of p. Point-to-point sends grow v-fold; Megatron-core
overlaps them with compute in this schedule (``overlap_p2p_comm``), so they are not added to the period.
"""
from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from tangram_launch.costmodel.blocks import Block
from tangram_launch.costmodel.interleaved_schedule import simulated_interleaved_1f1b_s
from tangram_launch.costmodel.slice_plan import StageCost
from tangram_launch.specs.constants import SCHEDULES  # noqa: F401 (re-exported)

_SIMULATIONS_KEPT = 256  # simulations kept by their stage times' values (a key holds 3 S floats)


def pipeline_latency_s(num_microbatches: int, period_s: float, fill_s: float, tail_s: float,
                       virtual_stages: int = 1) -> float:
    """(m - 1) x period + fill + tail; interleaved with v chunks per rank: m x period + (fill - period) / v + tail."""
    if virtual_stages <= 1:
        return (num_microbatches - 1) * period_s + fill_s + tail_s
    return num_microbatches * period_s + (fill_s - period_s) / virtual_stages + tail_s


def inflight_microbatches(stages_after: int, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches' worth of activations a stage holds at its peak, with ``stages_after`` stages behind it.

    1F1B: min(stages_after + 1, m) (Narayanan et al. 2021, sec. 2.2). Interleaved: (warm-up chunk forwards + 1)
    chunks of 1/v each, the warm-up being 2 (p - k - 1) + (v - 1) p, capped at all m v chunks.
    """
    m = max(1, num_microbatches)
    if virtual_stages <= 1:
        return float(min(stages_after + 1, m))
    v = virtual_stages
    warmup = 2 * stages_after + (v - 1) * num_stages
    return min(warmup + 1, m * v) / v


def stage_memory_bytes(stage: StageCost, stages_after: int, num_stages: int, num_microbatches: int,
                       virtual_stages: int = 1) -> float:
    """Peak memory per GPU of a stage under either schedule (StageCost.memory_bytes is the 1F1B case)."""
    if virtual_stages <= 1:
        return stage.memory_bytes(stages_after, num_microbatches)
    return stage.static_bytes + stage.activation_bytes * inflight_microbatches(stages_after, num_stages,
                                                                               num_microbatches, virtual_stages)


def iteration_time_s(stages: Sequence[StageCost], num_microbatches: int, virtual_stages: int = 1) -> dict:
    """One slice plan's iteration (no links between its stages beyond what the stages' times hold): the event
    simulation of its stage times under 1F1B or interleaved 1F1B plus the slowest stage's DP sync and optimizer
    step."""
    m = max(1, num_microbatches)
    bottleneck = max(s.time_s for s in stages)
    tail = max(s.dp_sync_s + s.optimizer_s for s in stages)
    times = ([s.forward_s for s in stages], [s.backward_s for s in stages], [0.0] * (len(stages) - 1))
    if virtual_stages <= 1:
        iteration = simulated_1f1b_s(*times, m) + tail
    else:
        iteration = simulated_interleaved_1f1b_s(*times, m, virtual_stages) + tail
    pipeline = iteration - tail
    return {"iteration_s": iteration, "pipeline_s": pipeline, "bubble_s": pipeline - m * bottleneck,
            "sync_s": tail, "bottleneck_s": bottleneck}


def simulate_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int) -> list[Block]:
    """Start and end of every forward and backward of a non-interleaved 1F1B schedule (Narayanan et al. 2021).

    Stage k runs min(S - k - 1, m) warm-up forwards, then alternates one forward and one backward, then drains
    its backwards. A forward needs the previous stage's forward of that micro-batch plus the p2p time of the link
    between them; a backward needs the next stage's backward (the last stage: its own forward).
    """
    blocks: list[Block] = []
    _run_1f1b(fwd_s, bwd_s, p2p_s, m, blocks)
    return blocks


def simulated_1f1b_s(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int) -> float:
    """When the last block of :func:`simulate_1f1b`'s schedule ends (the same run, without building the blocks):
    the Plan's predicted pipeline time, so the timeline's bars end where its title says.

    Every op of _run_1f1b starts at the later of its stage's previous op's end and its dependency's end (plus the
    link), so its end is fixed by the dependency graph, whatever order the ops are taken in as long as each comes
    after what it waits for: here in the order _order_1f1b gives from the schedule's shape alone, one pass and the
    same float operations, without _run_1f1b's rounds of readiness checks (the planner simulates hundreds of
    candidate pipelines); from _LEVELS_MIN_STAGES stages on, that order's levels at once (_levels_1f1b). Kept by
    the stage times' values: the composer scores a pipeline again in later rounds, and build_plan once more."""
    return _simulated_1f1b_s(tuple(map(float, fwd_s)), tuple(map(float, bwd_s)), tuple(map(float, p2p_s)), m)


@functools.lru_cache(maxsize=_SIMULATIONS_KEPT)
def _simulated_1f1b_s(fwd_s: tuple[float, ...], bwd_s: tuple[float, ...], p2p_s: tuple[float, ...],
                      m: int) -> float:
    """simulated_1f1b_s by value."""
    S = len(fwd_s)
    if not S:
        return 0.0
    m = max(1, m)
    if S >= _LEVELS_MIN_STAGES:
        return _levels_1f1b(fwd_s, bwd_s, p2p_s, m)
    order = _order_1f1b(S, m) if 2 * S * m <= _ORDER_MAX_OPS else _order_1f1b.__wrapped__(S, m)
    durations = (*fwd_s, *bwd_s)  # [k]: stage k's forward, [S + k]: its backward
    links = (0.0, *p2p_s, 0.0)  # [k]: the link in front of stage k (none in front of stage 0, behind the last)
    end = [0.0] * (2 * S * m + 1)  # by op slot; the last one stays 0.0: the dependency of stage 0's forwards
    free = [0.0] * S
    for slot, k, op, dep, link in order:
        t = free[k]
        d = end[dep] + links[link]  # x + 0.0 is x (no link: links[0] or links[S])
        if d > t:
            t = d
        t += durations[op]
        end[slot] = free[k] = t
    return max(free)


def cycle_floor_1f1b_s(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int) -> float:
    """A floor under simulated_1f1b_s from the round trips across each stage boundary (0.0 where none applies).

    In the steady state stage k + 1 runs F(a) then B(a - w'), and stage k runs B(j) then F(w + j + 1), with w = S - k
    - 1 its warm-up forwards and w' = w - 1 stage k + 1's. So from the end of F_k(a) a path of the schedule's
    dependencies reaches the end of F_k(a + 2): the link, F_k+1(a), B_k+1(a - w'), the link back, B_k(a - w'),
    F_k(a + 2), i.e. t_k + t_k+1 + 2 p per two micro-batches, which a slow link between two stages makes longer
    than any stage. The longest such path, as every op starts no earlier than the end of what it waits for:

        micro-batch 0's forwards to stage k, its warm-up forwards F_k(1..w'), c = (m - 1 - w') // 2 round trips,
        one more trip to B_k, and that backward's way back to stage 0."""
    S = len(fwd_s)
    best = 0.0
    front = 0.0  # micro-batch 0's forwards through stages 0..k, with the links between them
    back = 0.0  # a backward's way from stage k to stage 0: the links and backwards in front of k
    for k in range(S - 1):
        front += fwd_s[k]
        w = S - k - 2  # stage k + 1's warm-up forwards (stage k's: w + 1)
        if w + 1 <= m and w <= m - 1:
            p = p2p_s[k]
            trip = 2.0 * p + fwd_s[k + 1] + bwd_s[k + 1] + bwd_s[k]
            c = (m - 1 - w) // 2
            total = front + w * fwd_s[k] + c * (trip + fwd_s[k]) + trip + back
            if total > best:
                best = total
        front += p2p_s[k]
        back += bwd_s[k] + p2p_s[k]
    return best


_LEVELS_MIN_STAGES = 12  # from this many stages on, a level's ops (one per stage) are taken at once with numpy
_ORDER_MAX_OPS = 40_000  # orders of longer schedules are made again per call (a kept order costs ~100 bytes an op)


@functools.lru_cache(maxsize=16)
def _order_1f1b(S: int, m: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """Every op of a 1F1B schedule of S stages and m micro-batches in an order where each one comes after the ops
    it waits for, as (its end slot, stage, duration index, its dependency's end slot, link index); the 16 most
    recent shapes are kept.

    Stage k runs its w = min(S - k - 1, m) warm-up forwards, then F(w + j), B(j) alternately, then drains its
    backwards (_run_1f1b). Ordered by the key 2i + k + 1 for the forward F(i) of stage k and 2i + 2S - k for its
    backward B(i), every op comes after (1) the forward of its micro-batch on the stage before (key one less), (2)
    the backward of its micro-batch on the stage after (key one less; the last stage: its own forward, one less),
    and (3) the op before it on its own stage: its forwards' keys rise by 2 per micro-batch, its backwards' too,
    and F(w + j) < B(j) < F(w + j + 1) because 2w + k + 1 <= 2S - k - 1 (w <= S - k - 1); a forward and a backward
    of one stage never share a key (their keys' parities differ). The slot 2 S m is the dependency of stage 0's
    forwards, which wait for nothing (its end stays 0.0)."""
    k = np.repeat(np.arange(S, dtype=np.int64), m)
    i = np.tile(np.arange(m, dtype=np.int64), S)
    f_slot = (k * m + i) * 2
    keys = np.concatenate((2 * i + k + 1, 2 * i + 2 * S - k))
    slots = np.concatenate((f_slot, f_slot + 1))
    stages = np.concatenate((k, k))
    ops = np.concatenate((k, k + S))
    f_dep = np.where(k > 0, f_slot - 2 * m, 2 * S * m)  # the stage before's forward of micro-batch i
    b_dep = np.where(k < S - 1, f_slot + 2 * m + 1, f_slot)  # the stage after's backward, or its own forward
    deps = np.concatenate((f_dep, b_dep))
    links = np.concatenate((k, k + 1))  # links[0] and links[S] are 0.0
    pick = np.argsort(keys, kind="stable")
    return tuple(zip(slots[pick].tolist(), stages[pick].tolist(), ops[pick].tolist(), deps[pick].tolist(),
                     links[pick].tolist()))


def _levels_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int) -> float:
    """simulated_1f1b_s level by level: the ops of one _order_1f1b key (level) wait only for ops of the level
    before -- the forward of stage k - 1 or the backward of stage k + 1 of the same micro-batch, the last stage's
    own forward -- and each stage has at most one op per level (a forward where k and the level differ in parity,
    else a backward), so a level is a few array operations over the stages: the same float operations per op
    (a dependency's end + its link, the later of that and the stage's last end, + the op's duration)."""
    S = len(fwd_s)
    k = np.arange(S)
    fwd, bwd = np.asarray(fwd_s, dtype=np.float64), np.asarray(bwd_s, dtype=np.float64)
    links = np.concatenate(([0.0], np.asarray(p2p_s, dtype=np.float64), [0.0]))  # [k]: the link in front of k
    src, link, dur, forward = [], [], [], []
    for par in (0, 1):  # by the level's parity: per stage, the slot its dependency ended in, the link, the duration
        f = (k % 2) != par  # the stages running a forward at this level
        forward.append(f)
        # a forward waits for stage k - 1's (stage 0: for nothing, the slot S that stays 0.0), a backward for stage
        # k + 1's (the last stage: for its own forward), each over the link between them (none: + 0.0, exact)
        src.append(np.where(f, np.where(k > 0, k - 1, S), np.minimum(k + 1, S - 1)))
        link.append(np.where(f, links[k], links[k + 1]))
        dur.append(np.where(f, fwd, bwd))
    ends = (np.zeros(S + 1), np.zeros(S + 1))  # the last two levels' ends by stage, + the slot S (0.0)
    views = (ends[0][:S], ends[1][:S])
    free = np.zeros(S)
    dep = np.empty(S)
    last = 2 * m + 2 * S - 2
    # levels 2S .. 2m - 1 (the steady state): every stage runs an op, the rest only the stages whose micro-batch
    # is in range: those levels take the general step
    for levels, steady in ((range(1, min(2 * S, last + 1)), False), (range(2 * S, 2 * m), True),
                           (range(max(2 * S, 2 * m), last + 1), False)):
        for level in levels:
            par = level & 1
            np.take(ends[1 - par], src[par], out=dep)  # the level before's ends: in the other buffer
            dep += link[par]
            end = views[par]
            np.maximum(free, dep, out=end)
            end += dur[par]
            if steady:
                free = end  # read before this buffer is written again, two levels on
                continue
            lo_f, hi_f = level - 2 * m + 1, level - 1  # the stages whose forward, backward key is this level
            lo_b, hi_b = 2 * S - level, 2 * S - level + 2 * m - 2
            active = np.where(forward[par], (k >= lo_f) & (k <= hi_f), (k >= lo_b) & (k <= hi_b))
            free = np.where(active, end, free)
    return float(free.max())


def _run_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int,
              blocks: list[Block] | None) -> float:
    """The one 1F1B event simulation; appends to ``blocks`` when given; returns the end of the last block.

    Every stage advances through its own op order as far as its dependencies allow, round after round; end times
    live in flat per-stage lists (-1: not run yet), so a 128-stage, 1,024-micro-batch pipeline takes well under a
    second.
    """
    S = len(fwd_s)
    m = max(1, m)
    orders: list[list[tuple[bool, int]]] = []  # per stage: (is_forward, micro-batch) in 1F1B order
    for k in range(S):
        warm = min(S - k - 1, m)
        ops = [(True, i) for i in range(warm)]
        for i in range(m - warm):
            ops += [(True, warm + i), (False, i)]
        ops += [(False, i) for i in range(m - warm, m)]
        orders.append(ops)
    end_f = [[-1.0] * m for _ in range(S)]
    end_b = [[-1.0] * m for _ in range(S)]
    pos = [0] * S
    free = [0.0] * S
    remaining = 2 * S * m
    while remaining:
        progressed = False
        for k in range(S):
            ops, p, t = orders[k], pos[k], free[k]
            n = len(ops)
            while p < n:
                forward, i = ops[p]
                if forward:
                    if k == 0:
                        dep = 0.0
                    else:
                        dep = end_f[k - 1][i]
                        if dep < 0.0:
                            break
                        dep += p2p_s[k - 1]
                else:
                    if k == S - 1:
                        dep = end_f[k][i]  # its own forward, earlier in its order
                    else:
                        dep = end_b[k + 1][i]
                        if dep < 0.0:
                            break
                        dep += p2p_s[k]
                start = t if t > dep else dep
                t = start + (fwd_s[k] if forward else bwd_s[k])
                (end_f if forward else end_b)[k][i] = t
                if blocks is not None:
                    blocks.append(Block(k, "F" if forward else "B", i, start, t))
                p += 1
            if p != pos[k]:
                remaining -= p - pos[k]
                pos[k], free[k] = p, t
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B has no deadlock; guard against a bad input
            raise RuntimeError("1F1B simulation stalled")
    return max(free) if free else 0.0
