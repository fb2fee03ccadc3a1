"""What a planning run may be asked to do differently (PlannerOptions), checked as it is built."""
from __future__ import annotations

from dataclasses import dataclass, field

from tangram_launch.errors import SpecError
from tangram_launch.parallelizers.base import GPU_COUNTS
from tangram_launch.planner.slices import PruningPolicy


@dataclass(frozen=True)
class PlannerOptions:
    pruning: PruningPolicy = field(default_factory=PruningPolicy)
    microbatch_sequences: tuple[int, ...] | None = None  # b values to try; default: every divisor of the batch
    max_workers: int | None = None  # process pool size; default min(2, cpu count)
    progress: bool | None = None  # None: progress on stderr only when it is a terminal
    bound_step: float = 0.0  # > 0: the composer compares periods within this relative step as equal (faster, not exact)
    atom_layers: int | None = None  # layers per model atom; None: slices.auto_atom_layers (1 up to 64 layers)
    exact_islands: int = 5  # up to this many islands the composer searches every island subset and order
    # branch and bound: queries carry the best latency found so far, and micro-batch sizes whose floor cannot beat
    # it are skipped (exact; off: every configuration is costed, as a check and for the ablation)
    branch_and_bound: bool = True
    # pipeline schedule: "1F1B", "interleaved-1F1B" (virtual stages required) or "auto" (interleave where the runtime
    # runs it and it is faster; planner/interleave.py)
    schedule: str = "auto"
    # compositions are ranked by the iteration the Plan reports (the simulated 1F1B); True also searches every plan
    # whose closed form is below the best simulated one (compose.py's score_band: slower, finds more where p2p lies on
    # the 1F1B cycle)
    score_band: bool = False
    # the GPU counts the parallelizer offers a slice (GPU_COUNTS): "tiling" (powers of two within a node, whole
    # nodes) or "all" (every count whose stages can be placed: wider, slower; docs/planner.md gives the cost)
    gpu_counts: str = "tiling"
    # a plan that leaves whole nodes of an island idle is searched once more with that island split into its used
    # and its idle nodes, two slices of different widths where one island's equal stages fit neither; the faster
    # plan is kept (planner/island_split.py; only while the split islands number at most exact_islands; off: one
    # search over the islands as built)
    split_idle_islands: bool = True

    def __post_init__(self) -> None:
        if self.microbatch_sequences is not None:
            for b in self.microbatch_sequences:
                if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                    raise SpecError("must be positive integers", field="microbatch_sequences", value=b)
        if self.atom_layers is not None and (isinstance(self.atom_layers, bool) or not isinstance(
                self.atom_layers, int) or self.atom_layers < 1):
            raise SpecError("must be a positive integer", field="atom_layers", value=self.atom_layers)
        if self.schedule not in ("auto", "1F1B", "interleaved-1F1B"):
            raise SpecError("unknown pipeline schedule", field="schedule", value=self.schedule,
                            valid="auto, 1F1B, interleaved-1F1B")
        if isinstance(self.exact_islands, bool) or not isinstance(self.exact_islands, int) or self.exact_islands < 1:
            raise SpecError("must be a positive integer", field="exact_islands", value=self.exact_islands)
        if self.gpu_counts not in GPU_COUNTS:
            raise SpecError("unknown GPU-count search space", field="gpu_counts", value=self.gpu_counts,
                            valid=", ".join(GPU_COUNTS))
        if self.bound_step < 0:
            raise SpecError("must be >= 0", field="bound_step", value=self.bound_step)
