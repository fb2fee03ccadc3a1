"""A small, deterministic parallelizer with configurable per-layer time and memory per island.

For tests and planner benchmarks: it answers in microseconds, so planner behaviour (pruning, composition, island
elimination) can be studied apart from a cost model. Not a cost model: its numbers are whatever you configure.
It enumerates 1 or 2 pipeline stages (split as evenly as possible), TP over powers of two inside a node, DP over
divisors of the micro-batch, and recompute none/full; it returns the Pareto front over (slowest stage, memory).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from tangram_launch.capabilities import StageShape
from tangram_launch.specs.constants import GIB
from tangram_launch.parallelizers.base import (
    InfeasibleSlice,
    SlicePlan,
    SliceQuery,
    SliceResult,
    StageCost,
    capacity_bytes,
)



@dataclass(frozen=True)
class SyntheticParallelizer:
    # seconds for forward+backward of one layer for one sequence on one GPU, by island name or GPU type
    layer_time_s: Mapping[str, float] = field(default_factory=dict)
    default_layer_time_s: float = 0.01
    layer_static_bytes: float = 1.0 * GIB  # parameters+gradients+optimizer of one layer (unsharded)
    layer_activation_bytes: float = 0.25 * GIB  # per layer per sequence in flight
    embedding_static_bytes: float = 0.5 * GIB  # on the stage holding layer 0 (and again on the head stage)
    head_time_s: float = 0.0  # extra per sequence on the last stage
    tp_overhead: float = 0.08  # relative slowdown per doubling of TP
    dp_sync_s_per_layer: float = 0.001  # per layer when dp > 1
    max_stages_per_slice: int = 2
    shard_static_over_dp: bool = False  # static memory divided by dp too (as a ZeRO-3-like sharding would)
    name: str = "synthetic"

    def _per_layer_s(self, q: SliceQuery) -> float:
        isl = q.island
        return self.layer_time_s.get(isl.name, self.layer_time_s.get(isl.gpu.type, self.default_layer_time_s))

    def _stage(self, q: SliceQuery, start: int, stop: int, tp: int, dp: int, recompute: str) -> StageCost:
        b = q.microbatch_sequences
        mbs = b // dp
        n = stop - start
        tp_factor = (1.0 + self.tp_overhead * (tp.bit_length() - 1)) / tp
        t = n * self._per_layer_s(q) * mbs * tp_factor
        if stop == q.model.num_layers:
            t += self.head_time_s * mbs
        t *= 4.0 / 3.0 if recompute == "full" else 1.0
        static = n * self.layer_static_bytes / tp
        if start == 0:
            static += self.embedding_static_bytes
        if stop == q.model.num_layers:
            static += self.embedding_static_bytes
        if self.shard_static_over_dp:
            static /= dp
        act = n * self.layer_activation_bytes * mbs / tp * (0.1 if recompute == "full" else 1.0)
        return StageCost(
            layers=(start, stop), shape=StageShape(tp=tp, dp=dp, recompute=recompute), micro_batch_size=mbs,
            forward_s=t / 3.0, backward_s=2.0 * t / 3.0, static_bytes=static, activation_bytes=act,
            dp_sync_s=self.dp_sync_s_per_layer * n if dp > 1 else 0.0, optimizer_s=0.0001 * n,
            p2p_bytes=float(b * q.training.seq_len * q.model.hidden_size * q.training.param_bytes))

    def query(self, q: SliceQuery) -> SliceResult:
        isl = q.island
        caps = q.capabilities
        start, stop = q.layers
        b = q.microbatch_sequences
        m = q.num_microbatches
        cap = capacity_bytes(isl, q.training)
        tps = [t for t in (1, 2, 4, 8) if t <= isl.gpus_per_node and isl.gpus_per_node % t == 0
               and (t == 1 or caps.tensor_parallel)]
        dps = [d for d in range(1, b + 1) if b % d == 0]
        modes = [r for r in ("none", "full") if r in caps.recompute_modes]
        max_ns = min(self.max_stages_per_slice, q.num_layers, q.max_stages or self.max_stages_per_slice)
        plans: list[SlicePlan] = []
        evaluated = 0
        for ns in range(1, max_ns + 1):
            if ns > 1 and not q.pipelined:
                continue
            cuts = [start + (q.num_layers * k) // ns for k in range(ns + 1)]
            for tp in tps:
                for dp in dps:
                    if tp * dp * ns > isl.num_gpus:
                        continue
                    for rc in modes:
                        evaluated += 1
                        stages = tuple(self._stage(q, cuts[k], cuts[k + 1], tp, dp, rc) for k in range(ns))
                        plan = SlicePlan(isl.name, (start, stop), stages, self.name)
                        if plan.fits(0, m, cap):
                            plans.append(plan)
        if not plans:
            return SliceResult(self.key(q), (), InfeasibleSlice((f"{isl.name}: layers {start}-{stop} do not fit",)),
                               evaluated)
        return SliceResult(self.key(q), _pareto(plans, m), None, evaluated)

    @staticmethod
    def key(q: SliceQuery) -> tuple:
        kinds = tuple(q.model.layer_kind(i) for i in range(*q.layers))
        return (q.island.name, q.num_layers, kinds, q.has_embedding, q.has_head, q.microbatch_sequences)


def _pareto(plans: list[SlicePlan], m: int) -> tuple[SlicePlan, ...]:
    """Plans not dominated in (slowest stage, peak memory, total time, GPUs)."""
    keyed = []
    for p in plans:
        mem = max(s.memory_bytes(len(p.stages) - 1 - j, m) for j, s in enumerate(p.stages))
        keyed.append((p.bottleneck_s, mem, sum(s.time_s for s in p.stages), p.num_gpus, p))
    keyed.sort(key=lambda k: k[:4])
    out: list[tuple] = []
    for k in keyed:
        if not any(o[1] <= k[1] and o[2] <= k[2] and o[3] <= k[3] for o in out):
            out.append(k)
    return tuple(k[4] for k in out)
