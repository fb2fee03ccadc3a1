"""The homogeneous-parallelizer interface (paper §5): "how fast, and in how much memory, can this island run
these layers?".

A query names a model slice (a contiguous range of transformer layers, the model atoms) and an island. The answer
is a set of slice plans, each a short pipeline of one or more stages on (a subset of) the island, with per-stage
forward/backward time per micro-batch and memory as a function of pipeline position: under 1F1B the stage at global
position p of S holds min(S - p, m) micro-batches of activations (Narayanan et al. 2021, §2.2), so memory is
``static_bytes + activation_bytes * min(stages_after + 1, m)``. The composer reuses one slice plan at every position
where it still fits (paper §5.2), so the parallelizer is asked once per pair, not once per position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from tangram_launch.capabilities import RuntimeCapabilities, StageShape

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import Island
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec

GIB = 1024**3


@dataclass(frozen=True)
class SliceQuery:
    model: "ModelSpec"
    training: "TrainingSpec"
    layers: tuple[int, int]  # [start, stop) over transformer layers
    island: "Island"
    microbatch_sequences: int  # b: sequences per pipeline micro-batch = micro_batch_size * dp of every stage
    capabilities: RuntimeCapabilities
    max_stages: int | None = None  # cap on pipeline stages inside this slice
    pipelined: bool = True  # whether the global plan may have more than one stage (ZeRO limits with PP)

    @property
    def num_microbatches(self) -> int:
        return self.training.global_batch // self.microbatch_sequences

    @property
    def has_embedding(self) -> bool:
        return self.layers[0] == 0

    @property
    def has_head(self) -> bool:
        return self.layers[1] == self.model.num_layers

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage of a slice plan, costed per GPU."""

    layers: tuple[int, int]
    shape: StageShape  # tp, dp, cp, ep, zero_stage, recompute, offload
    micro_batch_size: int  # per DP replica
    forward_s: float  # per micro-batch, incl. TP/CP/EP communication
    backward_s: float  # per micro-batch, incl. recompute and its communication
    static_bytes: float  # parameters + gradients + optimizer state + runtime overhead, per GPU
    activation_bytes: float  # per in-flight micro-batch, per GPU
    dp_sync_s: float = 0.0  # gradient all-reduce / reduce-scatter (+ all-gather) per iteration
    optimizer_s: float = 0.0  # optimizer step per iteration
    p2p_bytes: float = 0.0  # activation bytes sent to the next stage per micro-batch (whole micro-batch)
    breakdown: dict = field(default_factory=dict, compare=False, hash=False)  # name -> seconds or bytes

    @property
    def num_gpus(self) -> int:
        return self.shape.tp * self.shape.dp * self.shape.cp

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    def memory_bytes(self, stages_after: int, num_microbatches: int) -> float:
        """Peak memory per GPU at a pipeline position with ``stages_after`` stages behind it (1F1B)."""
        return self.static_bytes + self.activation_bytes * min(stages_after + 1, num_microbatches)


@dataclass(frozen=True)
class SlicePlan:
    island: str
    layers: tuple[int, int]
    stages: tuple[StageCost, ...]
    parallelizer: str = ""

    @property
    def num_gpus(self) -> int:
        return sum(s.num_gpus for s in self.stages)

    @property
    def bottleneck_s(self) -> float:
        return max(s.time_s for s in self.stages)

    def fits(self, stages_after: int, num_microbatches: int, capacity_bytes: float) -> bool:
        """Whether every stage fits when ``stages_after`` global stages follow this slice's last stage."""
        n = len(self.stages)
        return all(
            st.memory_bytes(stages_after + (n - 1 - j), num_microbatches) <= capacity_bytes
            for j, st in enumerate(self.stages)
        )

    def max_stages_after(self, num_microbatches: int, capacity_bytes: float) -> int:
        """Largest number of following stages at which the slice still fits; -1 if it never fits.

        Memory grows with stages_after only until min(., m) saturates, so beyond m - 1 more stages change nothing:
        the answer is capped at a large sentinel when it fits at saturation.
        """
        if not self.fits(0, num_microbatches, capacity_bytes):
            return -1
        if self.fits(num_microbatches, num_microbatches, capacity_bytes):
            return 1 << 30
        lo, hi = 0, num_microbatches  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(mid, num_microbatches, capacity_bytes):
                lo = mid
            else:
                hi = mid
        return lo


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


@runtime_checkable
class Parallelizer(Protocol):
    """Anything with a name and ``query``; register third-party ones under the entry point group
    ``tangram_launch.parallelizers`` (value ``module:factory``)."""

    name: str

    def query(self, q: SliceQuery) -> SliceResult: ...


def capacity_bytes(island: "Island", *, reserve_fraction: float = 0.0) -> float:
    """Usable memory per GPU on an island."""
    return island.gpu.memory_gib * GIB * (1.0 - reserve_fraction)
