"""The rank grid of a plan, computed once: global rank -> (stage, dp, cp, tp) coordinates, and every process group.

Ranks are numbered stage by stage; inside a stage tp is fastest, then cp, then dp (the Plan's ``rank_layout`` and
Megatron's ``order="tp-cp-ep-dp-pp"`` agree on this). Each stage has its own grid, which is the point of a
heterogeneous plan; pipeline groups (one rank per stage, same coordinates) exist only when all stages share one
grid. ``Plan.place``, the adapters' process groups (``runtime_adapters/groups.py``) and Megatron's expert groups all
read this object, as nanotron's ParallelContext or torchtitan's ParallelDims do, so the group math lives here once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from tangram_launch.specs.shape import StageShape

Group = tuple[int, ...]


class Coords(NamedTuple):
    """A rank's coordinates: its pipeline stage, then its place in that stage's (dp, cp, tp) grid."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    """The grids of every stage, and the ranks they hold. Build with :meth:`from_shapes` (a Plan's ``topology``)."""

    shapes: tuple[StageShape, ...]
    first_ranks: tuple[int, ...]  # first_ranks[k]: global rank of stage k's (dp, cp, tp) = (0, 0, 0)

    @classmethod
    def from_shapes(cls, shapes: Sequence[StageShape]) -> "Topology":
        firsts, rank = [], 0
        for s in shapes:
            firsts.append(rank)
            rank += s.stage_gpus
        return cls(shapes=tuple(shapes), first_ranks=tuple(firsts))

    # --- ranks and coordinates --------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.shapes)

    @property
    def world_size(self) -> int:
        return self.first_ranks[-1] + self.shapes[-1].stage_gpus if self.shapes else 0

    @property
    def uniform_grid(self) -> bool:
        """Every stage has the same (tp, cp, dp): ranks pass activations one to one between stages."""
        return len({(s.tp, s.cp, s.dp) for s in self.shapes}) == 1

    def stage_of(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the plan's 0..{self.world_size - 1}")
        k = self.num_stages - 1
        while self.first_ranks[k] > rank:
            k -= 1
        return k

    def coords(self, rank: int) -> Coords:
        k = self.stage_of(rank)
        s = self.shapes[k]
        i = rank - self.first_ranks[k]
        return Coords(pp=k, dp=i // (s.tp * s.cp), cp=(i // s.tp) % s.cp, tp=i % s.tp)

    def rank_of(self, stage: int, *, dp: int, cp: int, tp: int) -> int:
        s = self.shapes[stage]
        return self.first_ranks[stage] + tp + s.tp * (cp + s.cp * dp)

    def stage_ranks(self, stage: int) -> Group:
        first = self.first_ranks[stage]
        return tuple(range(first, first + self.shapes[stage].stage_gpus))

    # --- one rank's groups ------------------------------------------------------------------------------------
    def tp_group(self, rank: int) -> Group:
        c = self.coords(rank)
        return tuple(self.rank_of(c.pp, dp=c.dp, cp=c.cp, tp=t) for t in range(self.shapes[c.pp].tp))

    def cp_group(self, rank: int) -> Group:
        c = self.coords(rank)
        return tuple(self.rank_of(c.pp, dp=c.dp, cp=x, tp=c.tp) for x in range(self.shapes[c.pp].cp))

    def dp_group(self, rank: int) -> Group:
        c = self.coords(rank)
        return tuple(self.rank_of(c.pp, dp=d, cp=c.cp, tp=c.tp) for d in range(self.shapes[c.pp].dp))

    def ep_group(self, rank: int) -> Group:
        """Expert-parallel group: ep consecutive positions of the stage's (cp, dp) axis (cp fastest), as Megatron's
        expert generator folds them, at this rank's tp."""
        c = self.coords(rank)
        s = self.shapes[c.pp]
        inner = c.cp + s.cp * c.dp
        base = inner - inner % s.ep
        first = self.first_ranks[c.pp]
        return tuple(first + c.tp + s.tp * (base + k) for k in range(s.ep))

    def pp_group(self, rank: int) -> Group | None:
        """One rank per stage at this rank's coordinates; None when the stages' grids differ."""
        if not self.uniform_grid:
            return None
        c = self.coords(rank)
        return tuple(self.rank_of(k, dp=c.dp, cp=c.cp, tp=c.tp) for k in range(self.num_stages))

    def stage_peers(self, rank: int, stage: int) -> Group:
        """The ranks of ``stage`` that ``rank`` exchanges activations with: its pipeline peer under one grid, the
        whole stage otherwise; () outside the pipeline."""
        if not 0 <= stage < self.num_stages:
            return ()
        if self.uniform_grid:
            c = self.coords(rank)
            return (self.rank_of(stage, dp=c.dp, cp=c.cp, tp=c.tp),)
        return self.stage_ranks(stage)

    # --- every group, in creation order (every rank creates every group in the same order) -----------------------
    def tp_groups(self, stage: int) -> tuple[Group, ...]:
        s = self.shapes[stage]
        return tuple(self.tp_group(self.rank_of(stage, dp=d, cp=c, tp=0)) for d in range(s.dp) for c in range(s.cp))

    def cp_groups(self, stage: int) -> tuple[Group, ...]:
        s = self.shapes[stage]
        return tuple(self.cp_group(self.rank_of(stage, dp=d, cp=0, tp=t)) for d in range(s.dp) for t in range(s.tp))

    def dp_groups(self, stage: int) -> tuple[Group, ...]:
        s = self.shapes[stage]
        return tuple(self.dp_group(self.rank_of(stage, dp=0, cp=c, tp=t)) for c in range(s.cp) for t in range(s.tp))

    def pp_groups(self) -> tuple[Group, ...]:
        """Every pipeline, ordered by (dp, cp, tp) of the first stage; () when the grids differ."""
        if not self.uniform_grid or not self.shapes:
            return ()
        s = self.shapes[0]
        return tuple(self.pp_group(self.rank_of(0, dp=d, cp=c, tp=t))  # type: ignore[misc]
                     for d in range(s.dp) for c in range(s.cp) for t in range(s.tp))
