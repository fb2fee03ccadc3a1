"""Model slices, model-slice/island pairs, and the three pruning policies of paper §5.1.

Model atoms are transformer layers (the embedding rides with the first layer, the head with the last); for models
deeper than 64 layers, atoms group consecutive layers (``auto_atom_layers``; paper §5: coarser atoms plan faster
and balance a little worse). A slice is a contiguous range ``[start, stop)`` of atoms; a pair is a slice on an
island. There are A(A+1)/2 slices of A atoms per island, so before asking the parallelizer anything, pairs are
pruned:

* **incompatible / infeasible**: the island cannot run the training dtype (T4/V100 have no bf16), or the slice's
  parameters, gradients and optimizer state alone exceed the island's total memory (a lower bound on what any
  sharding, TP or ZeRO stage needs, so the pair can never fit);
* **unbalanced**: the slice's share of the model's FLOPs is far from the island's share of compute. Because the
  composer may leave islands out, "share" is taken against every subset S of islands that contains the island:
  share_S = c_island / sum_{j in S} c_j. A pair is kept when for some S
  ``share_S / (1 + tol) - one_layer <= flops_share <= share_S * (1 + tol) + one_layer``, where ``one_layer`` is the
  largest single atom's share (slices move in whole layers). S = {island} gives share 1, so the full-model slice
  (single-island plans) always survives, and S = all islands keeps the balanced all-islands slices;
* **redundant**: slices with the same layer count, the same sequence of layer kinds (dense/MoE) and the same
  embedding/head presence on the same island are interchangeable: one is queried and its plans are reused for the
  others by shifting layer indices.

Each policy can be switched off (the ablation of paper Fig. 12); ``PairSet.counts`` says how many pairs each removed.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from tangram_launch.errors import SpecError
from tangram_launch.islands import compute_tflops
from tangram_launch.parallelizers.base import GIB
from tangram_launch.specs.cluster import math_mode
from tangram_launch.specs.constants import DTYPE_NEEDS, DTYPES

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.capabilities import RuntimeCapabilities
    from tangram_launch.islands import Island
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec

logger = logging.getLogger(__name__)

# Default balance tolerance: a slice may carry up to 2x (or down to 1/2) its island's compute share. Measured
# efficiencies differ between GPU generations (PCIe T4s reach a smaller fraction of peak than NVLink V100s) and
# memory pushes layers towards big-memory islands, so a tight band would cut good plans; the pruning ablation
# (benchmarks/bench_planner_pruning.py) checks that plans do not get worse at this setting.
DEFAULT_BALANCE_TOLERANCE = 1.0
_MAX_SUBSET_ISLANDS = 12  # beyond this, only "alone", "all" and "all but one" subsets are used for shares


@dataclass(frozen=True)
class PruningPolicy:
    """Which pruning policies run (paper §5.1); switch any off for the ablation."""

    redundant: bool = True
    unbalanced: bool = True
    infeasible: bool = True  # also covers incompatible pairs (dtype not supported on the island)
    balance_tolerance: float = DEFAULT_BALANCE_TOLERANCE

    def __post_init__(self) -> None:
        tol = self.balance_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
            raise SpecError("must be a number >= 0", field="balance_tolerance", value=tol)


@dataclass(frozen=True)
class Pair:
    """A model slice on an island; ``key`` names its redundancy class."""

    layers: tuple[int, int]  # [start, stop) over transformer layers
    island: int  # index into the island list
    key: tuple  # (island name, num_layers, layer kinds, has_embedding, has_head)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class PairSet:
    pairs: tuple[Pair, ...]  # pairs that survive pruning (the composer sees all of them)
    queries: tuple[Pair, ...]  # pairs to query: one representative per key when redundancy pruning is on
    counts: dict  # total, incompatible, infeasible, unbalanced, redundant, queries (per microbatch size b)
    island_notes: dict = field(default_factory=dict)  # island name -> why all its pairs were pruned


class ModelAtoms:
    """Per-layer FLOPs and static bytes of a model, with prefix sums for O(1) slice totals."""

    def __init__(self, model: "ModelSpec", training: "TrainingSpec") -> None:
        self.model = model
        self.training = training
        L = model.num_layers
        s = training.seq_len
        self.kinds = tuple(model.layer_kind(i) for i in range(L))
        flops = [model.layer_forward_flops_per_token(i, s) for i in range(L)]
        params = [model.layer_params(i) for i in range(L)]
        self._flops_prefix = [0.0, *itertools.accumulate(flops)]
        self._params_prefix = [0, *itertools.accumulate(params)]
        self.embedding_flops = model.embedding_forward_flops_per_token()
        self.head_flops = model.head_forward_flops_per_token()
        self.total_flops = self._flops_prefix[-1] + self.embedding_flops + self.head_flops
        self.max_atom_share = max(max(flops) + max(self.embedding_flops, self.head_flops), 1e-30) / self.total_flops
        # bytes per parameter that must live somewhere in the island's GPU memory when nothing is offloaded
        self.state_bytes_per_param = training.param_bytes + training.grad_bytes + training.optimizer_state_bytes

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    def flops_share(self, start: int, stop: int) -> float:
        f = self._flops_prefix[stop] - self._flops_prefix[start]
        if start == 0:
            f += self.embedding_flops
        if stop == self.num_layers:
            f += self.head_flops
        return f / self.total_flops

    def slice_params(self, start: int, stop: int) -> int:
        """Parameters a pipeline stage holding [start, stop) stores (a tied output embedding is a second copy)."""
        m = self.model
        p = self._params_prefix[stop] - self._params_prefix[start]
        if start == 0:
            p += m.embedding_params()
        if stop == self.num_layers:
            p += m.head_params()
            if m.tied_embeddings and start != 0:
                p += m.output_embedding_params()
        return p

    def min_static_bytes(self, start: int, stop: int, *, offload: bool) -> float:
        """Lower bound on the GPU memory any configuration needs for the slice's training state, summed over GPUs.

        Without offload every byte of parameters, gradients and optimizer state sits on some GPU of the island
        (sharding only spreads it); with offload, the optimizer state may live in host memory.
        """
        per_param = self.training.param_bytes + self.training.grad_bytes if offload else self.state_bytes_per_param
        return float(self.slice_params(start, stop)) * per_param

    def model_state_bytes(self) -> float:
        return self.min_static_bytes(0, self.num_layers, offload=False)


def island_shares(compute: Sequence[float]) -> list[list[float]]:
    """For each island, its compute share within every subset of usable islands (compute > 0) that contains it,
    sorted and unique; an unusable island gets no shares."""
    usable = [i for i, c in enumerate(compute) if c > 0]
    k = len(usable)
    if k <= _MAX_SUBSET_ISLANDS:
        subsets = [s for r in range(1, k + 1) for s in itertools.combinations(usable, r)]
    else:
        everyone = tuple(usable)
        subsets = [(i,) for i in usable] + [everyone] + [tuple(j for j in everyone if j != i) for i in usable]
    out: list[list[float]] = []
    for i in range(len(compute)):
        if compute[i] <= 0:
            out.append([])
            continue
        out.append(sorted({compute[i] / sum(compute[j] for j in s) for s in subsets if i in s}))
    return out


def is_balanced(share: float, shares: Sequence[float], tolerance: float, slack: float) -> bool:
    return any(s / (1.0 + tolerance) - slack <= share <= s * (1.0 + tolerance) + slack for s in shares)


def island_compute_tflops(island: "Island", dtype: str) -> float:
    return compute_tflops(island.gpu, dtype) * island.num_gpus


def dtype_problem(island: "Island", dtype: str) -> str | None:
    """Why the island cannot train in ``dtype`` (no bf16 on T4/V100), else None; tf32 runs everywhere (FP32
    matmuls where the GPU lacks TF32, specs.cluster.math_mode)."""
    if island.gpu.tflops.get(math_mode(island.gpu, dtype)):
        return None
    supported = [d for d in DTYPES if island.gpu.tflops.get(d)]
    need = f", which needs {DTYPE_NEEDS[dtype]}" if dtype in DTYPE_NEEDS else ""
    return (f"{island.name}: {island.gpu.type} has no {dtype} support{need} (it runs {', '.join(supported)}; "
            f"train with --dtype {supported[0]} to use it)" if supported else
            f"{island.name}: {island.gpu.type} has no {dtype} support{need}")


def atom_boundaries(num_layers: int, atom_layers: int) -> list[int]:
    """Where slices may start and stop: every ``atom_layers`` layers (the last atom takes the remainder)."""
    return list(range(0, num_layers, atom_layers)) + [num_layers]


def auto_atom_layers(num_layers: int) -> int:
    """Layers per atom by default: one up to 64 layers, then enough to keep about 64 atoms (paper §5: coarser
    atoms cut planning time at some cost in balance; Llama-3 405B's 126 layers become 63 atoms of 2)."""
    return max(1, -(-num_layers // 64))


def build_pairs(atoms: ModelAtoms, islands: Sequence["Island"], capabilities: "RuntimeCapabilities",
                policy: PruningPolicy, *, atom_layers: int = 1) -> PairSet:
    """All slice/island pairs, pruned by ``policy`` (see the module docstring for the rules and their order)."""
    L = atoms.num_layers
    cuts = atom_boundaries(L, atom_layers)
    slack = atoms.max_atom_share * atom_layers  # slices move by whole atoms
    dtype = atoms.training.dtype
    compute = [island_compute_tflops(isl, dtype) if dtype_problem(isl, dtype) is None else 0.0 for isl in islands]
    usable = [c > 0 for c in compute]
    shares = island_shares(compute)
    counts = {"total": 0, "incompatible": 0, "infeasible": 0, "unbalanced": 0, "redundant": 0, "queries": 0}
    notes: dict[str, str] = {}
    kept: list[Pair] = []
    for k, isl in enumerate(islands):
        problem = dtype_problem(isl, dtype)
        total_mem = isl.gpu.memory_gib * GIB * isl.num_gpus
        island_kept = 0
        island_infeasible = 0
        smallest_need = None
        for a, start in enumerate(cuts[:-1]):
            for stop in cuts[a + 1:]:
                counts["total"] += 1
                if policy.infeasible:
                    if problem is not None:
                        counts["incompatible"] += 1
                        continue
                    need = atoms.min_static_bytes(start, stop, offload=capabilities.offload)
                    if need > total_mem:
                        counts["infeasible"] += 1
                        island_infeasible += 1
                        if smallest_need is None or need < smallest_need:
                            smallest_need = need
                        continue
                if policy.unbalanced and usable[k]:
                    share = atoms.flops_share(start, stop)
                    if not is_balanced(share, shares[k], policy.balance_tolerance, slack):
                        counts["unbalanced"] += 1
                        continue
                key = (isl.name, stop - start, atoms.kinds[start:stop], start == 0, stop == L)
                kept.append(Pair((start, stop), k, key))
                island_kept += 1
        if problem is not None and policy.infeasible:
            notes[isl.name] = problem
        elif island_kept == 0 and island_infeasible:
            notes[isl.name] = (f"{isl.name}: even the smallest slice's parameters, gradients and optimizer state "
                               f"({(smallest_need or 0) / GIB:.1f} GiB) exceed the island's "
                               f"{total_mem / GIB:.0f} GiB")
    if policy.redundant:
        seen: dict[tuple, Pair] = {}
        for p in kept:
            seen.setdefault(p.key, p)
        queries = tuple(seen.values())
    else:
        queries = tuple(kept)
    counts["redundant"] = len(kept) - len(queries)
    counts["queries"] = len(queries)
    return PairSet(pairs=tuple(kept), queries=queries, counts=counts, island_notes=notes)
