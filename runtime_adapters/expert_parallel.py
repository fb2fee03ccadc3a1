"""Expert parallelism for the torch runtime: EP groups carved from a stage's data-parallel ranks, as Megatron does.

Inside a stage of ``dp`` replicas (``cp`` folded in, Megatron's order "tp-cp-ep-dp-pp"), data-parallel position
``d = cp + CP * dp`` belongs to expert-parallel group ``d // ep`` at expert rank ``d % ep``; the ``dp / ep`` ranks with
the same expert rank form its expert-data-parallel (EDP) group. So, for one TP coordinate of a stage with dp = 4,
ep = 2::

    dp position   0  1  2  3
    EP group      A  A  B  B        A and B each hold every expert once: rank 0 of a group experts [0, E/2),
    expert rank   0  1  0  1        rank 1 experts [E/2, E)
    EDP group     x  y  x  y        x holds the same experts on both of its ranks, and so does y

Gradients: dense parameters (attention, norms, router, shared experts) are averaged over the stage's DP group as
without MoE. A routed expert's gradient on its rank already sums the contributions of all ``ep`` replicas of its EP
group (their tokens came to it by all-to-all), so it is summed over the EDP group only and divided by ``dp``: the
mean over all replicas, exactly what the whole model computes on the global batch.

``expert_layout`` is pure (testable at any world size); ``build_expert_groups`` creates the groups (collective: every
rank creates every group in one order, like ``runtime_adapters.groups``); ``bind_expert_parallel`` hands a stage
module's MoE layers their group.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch import nn

from runtime_adapters.moe import ExpertDispatch, MoEFFN
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan
from tangram_launch.specs.model import ModelSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertLayout:
    """Per stage, its EP and EDP groups as tuples of global ranks, in creation order (empty for ep = 1 stages)."""

    ep: tuple[tuple[tuple[int, ...], ...], ...]
    edp: tuple[tuple[tuple[int, ...], ...], ...]


def expert_layout(plan: Plan) -> ExpertLayout:
    ep_all, edp_all = [], []
    for stage in plan.stages:
        ep_groups: list[tuple[int, ...]] = []
        edp_groups: list[tuple[int, ...]] = []
        if stage.ep > 1:
            mine = [r for r in plan.rank_layout if r.stage == stage.index]
            for t in range(stage.tp):
                # data-parallel positions of this TP coordinate, cp fastest (Megatron folds cp into dp for experts)
                by_pos = {r.cp + stage.cp * r.dp: r.rank for r in mine if r.tp == t}
                n = stage.dp * stage.cp
                ep_groups += [tuple(by_pos[b + k] for k in range(stage.ep)) for b in range(0, n, stage.ep)]
                edp_groups += [tuple(by_pos[p] for p in range(k, n, stage.ep)) for k in range(stage.ep)]
        ep_all.append(tuple(ep_groups))
        edp_all.append(tuple(edp_groups))
    return ExpertLayout(ep=tuple(ep_all), edp=tuple(edp_all))


def local_experts(spec: ModelSpec, ep_size: int, ep_rank: int) -> range:
    """The global experts expert rank ``ep_rank`` of ``ep_size`` holds: a contiguous block of E / ep."""
    if spec.num_experts % ep_size:
        raise SpecError("the expert-parallel size must divide the number of experts", field="ep", value=ep_size,
                        valid=f"a divisor of num_experts={spec.num_experts}")
    n = spec.num_experts // ep_size
    return range(ep_rank * n, (ep_rank + 1) * n)


@dataclass(frozen=True)
class ExpertGroups:
    """One rank's expert-parallel groups: ``ep`` (dispatch) and ``edp`` (expert gradient reduction)."""

    ep: Any  # torch ProcessGroup
    edp: Any
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]
    ep_rank: int  # this rank's position in ep_ranks
    replicas: int  # the stage's dp * cp: expert gradients are divided by it

    @property
    def ep_size(self) -> int:
        return len(self.ep_ranks)


def build_expert_groups(plan: Plan, rank: int, *, timeout_s: float = 600.0) -> ExpertGroups | None:
    """Create every stage's EP and EDP groups (collective over the world); this rank's, or None when its stage
    has ep = 1 (no group is created at all when no stage has ep > 1)."""
    import torch.distributed as dist

    layout = expert_layout(plan)
    timeout = timedelta(seconds=timeout_s)
    found: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for kind, per_stage in (("ep", layout.ep), ("edp", layout.edp)):
        for groups in per_stage:
            for ranks in groups:
                group = dist.new_group(list(ranks), timeout=timeout)
                if rank in ranks:
                    found[kind] = (group, ranks)
    if "ep" not in found:
        return None
    stage = plan.place(rank).stage
    (ep, ep_ranks), (edp, edp_ranks) = found["ep"], found["edp"]
    logger.debug("rank %d stage %d: ep group %s, edp group %s", rank, stage.index, ep_ranks, edp_ranks)
    return ExpertGroups(ep=ep, edp=edp, ep_ranks=ep_ranks, edp_ranks=edp_ranks, ep_rank=ep_ranks.index(rank),
                        replicas=stage.dp * stage.cp)


def bind_expert_parallel(module: nn.Module, spec: ModelSpec, groups: ExpertGroups | None) -> int:
    """Hand every MoE layer of ``module`` its dispatch group; returns the number of MoE layers bound.

    Refuses a module whose MoE layers hold other experts than this rank's share (a model factory that ignored the
    plan's expert layout)."""
    layers = [m for m in module.modules() if isinstance(m, MoEFFN)]
    if groups is None:
        return len(layers)
    want = local_experts(spec, groups.ep_size, groups.ep_rank)
    for m in layers:
        if m.local_experts != want:
            raise SpecError("an MoE layer holds other experts than this rank's share under expert parallelism",
                            field="experts", value=f"{m.local_experts.start}..{m.local_experts.stop - 1}",
                            valid=f"{want.start}..{want.stop - 1} (ep={groups.ep_size}, expert rank {groups.ep_rank})")
        m.dispatch = ExpertDispatch(group=groups.ep, size=groups.ep_size, rank=groups.ep_rank)
    return len(layers)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters of ``module`` (those sharded by expert parallelism)."""
    return [p for m in module.modules() if isinstance(m, MoEFFN) for p in m.experts.parameters()]
