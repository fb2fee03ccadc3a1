"""What the cost model answers about one model slice on one island: the query (``SliceQuery``), and the costed
pipeline it returns (``SlicePlan`` of ``StageCost``s), with per-stage forward/backward time per micro-batch and
memory as a function of pipeline position. Under 1F1B the stage at global position p of S holds min(S - p, m)
micro-batches of activations (Narayanan et al. 2021, §2.2), so memory is
``static_bytes + activation_bytes * min(stages_after + 1, m)``.

These are the cost model's types; ``parallelizers/base.py`` defines the protocol that answers with them.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel.slice_bounds import beyond, latency_floor_of, score_floor_of, slack_cut
from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import DEFAULT_MEMORY_HEADROOM_FRACTION, GIB
from tangram_launch.specs.shape import StageShape

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import Island
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(StageShape):
    """One configuration of a slice: a stage shape (the (tp, cp, dp) grid and memory savers of every stage) and
    the number of pipeline stages ``pp`` inside the slice. Keyword-only, validated by the shape."""

    pp: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1:
            raise SpecError("must be a positive integer", field="pp", value=self.pp, valid="an integer >= 1")

    @property
    def num_gpus(self) -> int:
        return self.stage_gpus * self.pp

    def shape(self) -> StageShape:
        """The shape every stage of this configuration has."""
        return self.as_shape()

    def describe(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} cp={self.cp} ep={self.ep} zero={self.zero_stage} "
                f"recompute={self.recompute} offload={'yes' if self.offload else 'no'}")


class SliceNumbers(NamedTuple):
    """What a consumer that only ranks and places slice plans reads of one (the composer's view), stage by stage:
    enough to judge a plan without building its StageCosts (the parallelizer's costly step)."""

    shapes: tuple[StageShape, ...]
    micro_batch_sizes: tuple[int, ...]
    time_s: tuple[float, ...]  # forward_s + backward_s
    static_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    tail_s: tuple[float, ...]  # dp_sync_s + optimizer_s
    # optional: (m, capacity bytes, costmodel.grid.fit_depth of these stages at them), when the answer computed it
    depth_hint: tuple[int, float, int] | None = None


def latency_floor_s(numbers: SliceNumbers, num_microbatches: int) -> float:
    """The least 1F1B latency of any pipeline holding this slice plan: (m - 1) x its bottleneck + its stage times +
    its tail (the pipeline's period, fill and tail are at least these; compose.py's closed form)."""
    times = numbers.time_s
    return latency_floor_of(max(times), sum(times), max(numbers.tail_s), num_microbatches)


def score_floor_s(numbers: SliceNumbers, num_microbatches: int) -> float:
    """The least predicted iteration of any pipeline holding this slice plan: its slowest stage runs m forwards and
    m backwards (the simulated 1F1B, and interleaving's m x period, are at least that), then the tail."""
    return score_floor_of(max(numbers.time_s), max(numbers.tail_s), num_microbatches)


def numbers_fit(numbers: SliceNumbers, stages_after: int, num_microbatches: int, capacity_bytes: float) -> bool:
    """SlicePlan.fits on a plan's numbers (the same arithmetic, so the same answer to the last bit)."""
    m = num_microbatches
    inflight = stages_after + len(numbers.static_bytes)
    for static, act in zip(numbers.static_bytes, numbers.activation_bytes):
        if static + act * (inflight if inflight < m else m) > capacity_bytes:
            return False
        inflight -= 1
    return True


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
    # the planner's bounds so far: the composer's closed-form latency to beat (a slice plan whose own (m - 1) x
    # bottleneck + sum of stage times + tail is larger is part of no pipeline the composer still considers:
    # ``latency_floor_s``) and the best predicted iteration (the simulated 1F1B the planner ranks by, at least m x
    # the slowest stage + tail: ``score_floor_s``); a plan beyond both need not be answered; inf: answer everything
    latency_bound_s: float = math.inf
    score_bound_s: float = math.inf
    # score_bounds_s[i]: the score bound for a slice plan whose least stage has at most i layers (a pipeline holding
    # it interleaves in at most i chunks, so less of the fill hides), for i below its length; beyond, score_bound_s.
    # [0] (and [1]): for one in no pipeline that interleaves, as one of more stages than micro-batches (interleaved
    # 1F1B needs the stages to divide them: capabilities.schedule_problems)
    score_bounds_s: tuple[float, ...] = ()

    @property
    def num_microbatches(self) -> int:
        return self.training.global_batch // self.microbatch_sequences

    @property
    def bounded(self) -> bool:
        return self.latency_bound_s != math.inf and self.score_bound_s != math.inf

    def score_bound_at(self, num_stages: int) -> float:
        """The score bound for a slice plan of ``num_stages`` stages: its least stage has at most layers //
        stages layers, and with more stages than micro-batches no pipeline holding it interleaves
        (score_bounds_s)."""
        return self.score_bounds_at((num_stages,))[0]

    def score_bounds_at(self, stage_counts: Sequence[int]) -> list[float]:
        """score_bound_at of each of ``stage_counts`` (a grid list's distinct pp: the query's numbers read once)."""
        layers, m, bounds, rest = self.num_layers, self.num_microbatches, self.score_bounds_s, self.score_bound_s
        out = []
        for num_stages in stage_counts:
            i = layers // num_stages if num_stages <= m else 0
            out.append(bounds[i] if i < len(bounds) else rest)
        return out

    def beyond_bound(self, latency_floor_s: float, score_floor_s: float, num_stages: int | None = None) -> bool:
        """Whether a slice plan with these floors (of ``num_stages`` stages, where known) can be part of no
        pipeline that beats either bound (a relative 1e-9 of slack keeps plans that tie a bound up to float
        rounding)."""
        score_bound_s = self.score_bound_s if num_stages is None else self.score_bound_at(num_stages)
        return beyond(latency_floor_s, score_floor_s, slack_cut(self.latency_bound_s), slack_cut(score_bound_s))

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
        return self.shape.stage_gpus

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

    def numbers(self) -> SliceNumbers:
        """The plan's SliceNumbers (from its stages)."""
        st = self.stages
        return SliceNumbers(tuple(s.shape for s in st), tuple(s.micro_batch_size for s in st),
                            tuple(s.time_s for s in st), tuple(s.static_bytes for s in st),
                            tuple(s.activation_bytes for s in st), tuple(s.dp_sync_s + s.optimizer_s for s in st))

    def fits(self, stages_after: int, num_microbatches: int, capacity_bytes: float) -> bool:
        """Whether every stage fits when ``stages_after`` global stages follow this slice's last stage."""
        m = num_microbatches
        inflight = stages_after + len(self.stages)  # stage j holds min(stages_after + n - j, m): memory_bytes inlined
        for st in self.stages:
            if st.static_bytes + st.activation_bytes * (inflight if inflight < m else m) > capacity_bytes:
                return False
            inflight -= 1
        return True

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


class LazySlicePlan(SlicePlan):
    """A SlicePlan whose StageCosts are built on first use (``build``); ``numbers()`` needs no building. The
    planner ranks every answered plan by its numbers and places only a few, so most are never built. Equal to, and
    pickled as, the built SlicePlan."""

    def __init__(self, island: str, layers: tuple[int, int], stages: tuple[StageCost, ...] | None = None,
                 parallelizer: str = "", *, numbers: SliceNumbers | None = None,
                 build: "Callable[[], tuple[StageCost, ...]] | None" = None) -> None:
        if stages is None and (numbers is None or build is None):
            raise ValueError("a LazySlicePlan needs its stages, or its numbers and a way to build the stages")
        object.__setattr__(self, "island", island)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "parallelizer", parallelizer)
        object.__setattr__(self, "_stages", stages)
        object.__setattr__(self, "_numbers", numbers)
        object.__setattr__(self, "_build", build)

    @classmethod
    def of_numbers(cls, island: str, layers: tuple[int, int], parallelizer: str, numbers: SliceNumbers,
                   build: "Callable[[], tuple[StageCost, ...]]") -> "LazySlicePlan":
        """LazySlicePlan(island, layers, parallelizer=..., numbers=..., build=...), the same attributes set at once
        (a parallelizer's answers make many of them; both are given here, so nothing to check)."""
        plan = object.__new__(cls)
        plan.__dict__.update(island=island, layers=layers, parallelizer=parallelizer, _stages=None, _numbers=numbers,
                             _build=build)
        return plan

    @property  # type: ignore[override]
    def stages(self) -> tuple[StageCost, ...]:
        st = self._stages
        if st is None:
            st = self._build()
            object.__setattr__(self, "_stages", st)
            object.__setattr__(self, "_build", None)  # let the cost tables it held go
        return st

    def numbers(self) -> SliceNumbers:
        return self._numbers if self._numbers is not None else super().numbers()

    def built(self) -> SlicePlan:
        return SlicePlan(self.island, self.layers, self.stages, self.parallelizer)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SlicePlan):
            return (self.island, self.layers, self.stages, self.parallelizer) == (
                other.island, other.layers, other.stages, other.parallelizer)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.island, self.layers, self.stages, self.parallelizer))

    def __reduce__(self):
        return (SlicePlan, (self.island, self.layers, self.stages, self.parallelizer))


def capacity_bytes(island: "Island", training: "TrainingSpec | None" = None, *,
                   reserve_fraction: float | None = None) -> float:
    """Memory per GPU a plan may fill on an island: the capacity less the headroom (the training spec's
    ``memory_headroom_fraction``, else ``reserve_fraction``, else DEFAULT_MEMORY_HEADROOM_FRACTION)."""
    if training is not None:
        reserve_fraction = training.memory_headroom_fraction
    elif reserve_fraction is None:
        reserve_fraction = DEFAULT_MEMORY_HEADROOM_FRACTION
    return island.gpu.memory_gib * GIB * (1.0 - reserve_fraction)
