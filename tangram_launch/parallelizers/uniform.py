"""``uniform``: the naive baseline (the paper's "Galvatron-uniform", §6.2).

Uniform DP, TP and PP over the *whole* island (tp x dp x pp = all its GPUs, tp inside a node, mbs = b / dp) and
no memory savers: ZeRO 0, no recompute, no offload, no context parallelism. For MoE models the experts are sharded
over the data-parallel replicas (ep = the largest divisor of dp that divides the expert count), as the fully
sharded expert parallelism the paper's baseline uses. The same cost model as ``megatron`` prices every candidate;
the answer is the Pareto front of the few uniform configurations that fit, or why none does.
"""
from __future__ import annotations

import math
from typing import Iterator

from tangram_launch.capabilities import StageShape
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.parallelizers.megatron import MegatronParallelizer, divisors, stages_placeable


class UniformParallelizer(MegatronParallelizer):
    """Whole island, uniform grid, no memory savers."""

    name = "uniform"

    def grids(self, q: SliceQuery, coster: SliceCoster) -> Iterator[ParallelConfig]:
        isl, model, caps = q.island, q.model, q.capabilities
        n, g = isl.num_gpus, isl.gpus_per_node
        max_pp = q.num_layers
        for limit in (q.max_stages, caps.max_stages):
            if limit is not None:
                max_pp = min(max_pp, limit)
        for pp in divisors(n):
            if pp > max_pp or self.gpu_counts == "all" and not stages_placeable(n, pp, g, True):
                continue  # (the default's tiling rule is check's shape problem, named when nothing fits)
            sg = n // pp
            for tp in divisors(math.gcd(sg, g)):
                if tp > 1 and not caps.tensor_parallel:
                    continue
                dp = sg // tp
                ep = 1
                if model.is_moe and caps.expert_parallel:
                    ep = max(e for e in divisors(dp) if model.num_experts % e == 0)
                yield ParallelConfig(tp=tp, pp=pp, dp=dp, ep=ep)

    def savers(self, q: SliceQuery, grid: ParallelConfig) -> list[tuple[int, int, bool]]:
        shape = StageShape(tp=grid.tp, dp=grid.dp, cp=grid.cp, ep=grid.ep)
        ok = q.capabilities.allows_stage(shape, pipelined=q.pipelined or grid.pp > 1)
        return [(0, 0, False)] if ok else []
