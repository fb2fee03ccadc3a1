"""Process groups from a Plan's rank layout, shared by the adapters.

``group_layout`` is pure data (which ranks form which group), testable at any world size without processes.
``build_stage_groups`` creates the torch process groups: every rank creates every group in one deterministic order
(``dist.new_group`` is collective over the world), and keeps the ones it belongs to in a ``StageGroups`` object; there
is no module-level group state, so two plans can be set up one after the other in one process.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tangram_launch.plan import Place, Plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupLayout:
    """Every group of a plan as tuples of global ranks, in creation order.

    tp/cp/dp: per stage, the groups of that stage. pp: one pipeline per (tp, cp, dp) coordinate when all stages
    share one grid (torch.distributed.pipelining and DeepSpeed pass activations rank to rank), else empty.
    """

    tp: tuple[tuple[tuple[int, ...], ...], ...]
    cp: tuple[tuple[tuple[int, ...], ...], ...]
    dp: tuple[tuple[tuple[int, ...], ...], ...]
    pp: tuple[tuple[int, ...], ...]
    stage_mesh: tuple[tuple[tuple[int, ...], ...], ...]  # per stage: [dp][tp] global ranks (cp folded into dp rows)


def group_layout(plan: Plan) -> GroupLayout:
    """Every group of the plan, read off its topology (``tangram_launch.topology``)."""
    topo = plan.topology
    stages = range(topo.num_stages)
    tp = tuple(topo.tp_groups(k) for k in stages)
    return GroupLayout(tp=tp, cp=tuple(topo.cp_groups(k) for k in stages), dp=tuple(topo.dp_groups(k) for k in stages),
                       pp=topo.pp_groups(), stage_mesh=tp)  # [dp x cp][tp] rows: the TP groups


@dataclass(frozen=True)
class StageGroups:
    """The groups one rank belongs to, plus its stage's (dp, tp) DeviceMesh for DTensor/FSDP2."""

    place: Place
    tp: Any  # torch.distributed.ProcessGroup
    dp: Any
    pp: Any  # this rank's pipeline: one rank per stage; None when stages have their own grids (no such pipeline)
    mesh: Any  # DeviceMesh with dims ("dp", "tp")

    @property
    def tp_mesh(self) -> Any:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> Any:
        return self.mesh["dp"]


def build_stage_groups(plan: Plan, rank: int, *, device_type: str = "cpu", timeout_s: float = 600.0) -> StageGroups:
    """Create all of the plan's groups (collective: every rank calls this with the same plan)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if plan.stages and any(s.cp > 1 for s in plan.stages):
        raise ValueError("context parallel groups are not built here (no adapter runs cp > 1)")
    layout = group_layout(plan)
    place = plan.place(rank)
    timeout = timedelta(seconds=timeout_s)
    found: dict[str, Any] = {}
    for kind, per_stage in (("tp", layout.tp), ("dp", layout.dp)):
        for stage_groups in per_stage:
            for ranks in stage_groups:
                group = dist.new_group(list(ranks), timeout=timeout)
                if rank in ranks:
                    found[kind] = group
    pp = None
    for ranks in layout.pp:  # single-stage plans get one-rank pipelines: the schedule runs the same way
        group = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            pp = group
    if pp is None and layout.pp:
        raise ValueError(f"rank {rank} is in none of the plan's pipelines {layout.pp}")
    mesh = DeviceMesh.from_group([found["dp"], found["tp"]], device_type,
                                 mesh=[list(row) for row in _dp_tp_rows(plan, place)], mesh_dim_names=("dp", "tp"))
    logger.debug("rank %d |PP=%d|DP=%d|TP=%d| tp=%s dp=%s", rank, place.coords["pp"], place.coords["dp"],
                 place.coords["tp"], place.tp_group, place.dp_group)
    return StageGroups(place=place, tp=found["tp"], dp=found["dp"], pp=pp, mesh=mesh)


def _dp_tp_rows(plan: Plan, place: Place) -> tuple[tuple[int, ...], ...]:
    return group_layout(plan).stage_mesh[place.stage.index]
