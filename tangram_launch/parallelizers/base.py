"""The homogeneous-parallelizer interface (paper §5): "how fast, and in how much memory, can this island run
these layers?".

A query (``costmodel.slice_plan.SliceQuery``) names a model slice (a contiguous range of transformer layers, the
model atoms) and an island. The answer is a set of slice plans (``costmodel.slice_plan.SlicePlan``), each a short
pipeline of one or more stages on (a subset of) the island, with per-stage time and memory as a function of
pipeline position. The composer reuses one slice plan at every position
where it still fits (paper §5.2), so the parallelizer is asked once per pair, not once per position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# The slice types are the cost model's; re-exported here, as parallelizers (built in and third-party) answer with them.
from tangram_launch.costmodel.slice_plan import (
    LazySlicePlan,
    SliceNumbers,
    SlicePlan,
    SliceQuery,
    StageCost,
    capacity_bytes,
)
from tangram_launch.specs.constants import GIB

# the GPU counts a slice may use (PlannerOptions.gpu_counts, MegatronParallelizer's option), the default first:
# "tiling": powers of two within a node and whole nodes; "all": every count whose stages can be placed
GPU_COUNTS = ("tiling", "all")

__all__ = ["GIB", "GPU_COUNTS", "InfeasibleSlice", "LazySlicePlan", "Parallelizer", "SliceNumbers", "SlicePlan",
           "SliceQuery", "SliceResult", "StageCost", "capacity_bytes"]


@dataclass(frozen=True)
class InfeasibleSlice:
    """Why no configuration fits: the smallest memory any configuration needs, and where it goes."""

    reasons: tuple[str, ...]
    min_memory_bytes: float = 0.0
    breakdown: dict = field(default_factory=dict, compare=False, hash=False)  # e.g. parameters/optimizer/activations

    def message(self) -> str:
        return "; ".join(self.reasons)


@dataclass(frozen=True)
class SliceResult:
    query_key: tuple  # (island, num_layers, layer kinds, has_embedding, has_head, b) for redundancy pruning
    plans: tuple[SlicePlan, ...]  # Pareto front over (bottleneck time, memory); empty when infeasible
    infeasible: InfeasibleSlice | None = None
    configs_evaluated: int = 0
    # configurations left out because they cannot beat the query's latency_bound_s (not an infeasibility: an
    # answer with no plans and bounded > 0 means "nothing here beats the plan already found")
    bounded: int = 0
    # every plan fits as the last stage and, for a bounded query, can beat one of its bounds (the parallelizer
    # screened them as query_pool.answer does, to the last bit): answer() need not screen them again
    screened: bool = field(default=False, compare=False)


@runtime_checkable
class Parallelizer(Protocol):
    """Anything with a name and ``query``; register third-party ones under the entry point group
    ``tangram_launch.parallelizers`` (value ``module:factory``)."""

    name: str

    def query(self, q: SliceQuery) -> SliceResult: ...
