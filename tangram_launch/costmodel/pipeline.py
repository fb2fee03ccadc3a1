"""The 1F1B iteration time, one formula for the whole project (the planner's composition, the Plan's prediction,
``tangram-launch estimate``).

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

It costs activation memory: rank k of p starts with 2 (p - k - 1) + (v - 1) p warm-up chunk forwards (Megatron-core's
``get_num_warmup_microbatches`` for the interleaved schedule), each 1/v of the stage's activations, so the first
rank holds about p (1 + 1/v) micro-batches' worth instead of p. Point-to-point sends grow v-fold; Megatron-core
overlaps them with compute in this schedule (``overlap_p2p_comm``), so they are not added to the period.

``simulate_1f1b`` places every forward and backward of the same stage times on a timeline (the timeline picture).
It puts p2p latency on the steady state's critical path as well, so with links it ends later than the formula;
without links it never ends later (the formula bounds it: tests/test_costmodel_pipeline.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tangram_launch.costmodel.slice_plan import StageCost
from tangram_launch.specs.constants import SCHEDULES  # noqa: F401 (re-exported)




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
    """The formula for the stages of one slice plan (no links between them beyond what the stages' times hold)."""
    m = max(1, num_microbatches)
    bottleneck = max(s.time_s for s in stages)
    fill = sum(s.time_s for s in stages)
    tail = max(s.dp_sync_s + s.optimizer_s for s in stages)
    iteration = pipeline_latency_s(m, bottleneck, fill, tail, virtual_stages)
    pipeline = iteration - tail
    return {"iteration_s": iteration, "pipeline_s": pipeline, "bubble_s": pipeline - m * bottleneck,
            "sync_s": tail, "bottleneck_s": bottleneck}


@dataclass(frozen=True)
class Block:
    stage: int
    kind: str  # "F" | "B"
    micro: int
    start_s: float
    end_s: float


def simulate_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float], m: int) -> list[Block]:
    """Start and end of every forward and backward of a non-interleaved 1F1B schedule (Narayanan et al. 2021).

    Stage k runs min(S - k - 1, m) warm-up forwards, then alternates one forward and one backward, then drains
    its backwards. A forward needs the previous stage's forward of that micro-batch plus the p2p time of the link
    between them; a backward needs the next stage's backward (the last stage: its own forward).
    """
    S = len(fwd_s)
    order: list[list[tuple[str, int]]] = []
    for k in range(S):
        warm = min(S - k - 1, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", i) for i in range(m - warm, m)]
        order.append(ops)
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * S
    free = [0.0] * S
    blocks: list[Block] = []
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for k in range(S):
            while pos[k] < len(order[k]):
                kind, i = order[k][pos[k]]
                if kind == "F":
                    dep = 0.0 if k == 0 else done.get(("F", k - 1, i))
                    if dep is not None and k > 0:
                        dep += p2p_s[k - 1]
                else:
                    dep = done.get(("F", k, i)) if k == S - 1 else done.get(("B", k + 1, i))
                    if dep is not None and k < S - 1:
                        dep += p2p_s[k]
                if dep is None:
                    break
                start = max(free[k], dep)
                end = start + (fwd_s[k] if kind == "F" else bwd_s[k])
                done[(kind, k, i)] = end
                free[k] = end
                blocks.append(Block(k, kind, i, start, end))
                pos[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B has no deadlock; guard against a bad input
            raise RuntimeError("1F1B simulation stalled")
    return blocks
