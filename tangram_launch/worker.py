"""A worker's place in the plan it was launched with.

``tangram-launch --plan FILE`` starts every worker through :mod:`tangram_launch.launch.boot`, which checks the plan
and exports where the worker sits.  A training script (or a runtime adapter) asks::

    from tangram_launch.worker import current_plan
    me = current_plan()              # RuntimeError outside a planned tangram-launch
    me.rank, me.stage, me.layers     # this worker's global rank, pipeline stage and [start, stop) layers
    me.plan, me.place                # the full Plan and Plan.place(rank) (tangram_launch.plan)

The rank layout is read from the plan file generically (key ``rank_layout``: a list of
``{"rank", "node", "local_gpu", "stage", ...}``), so boot and launcher need nothing but this module and the
standard library: a worker's start-up does not pay for importing the planner or torch.
"""
from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import DEFAULT_RUNTIME

# Environment a planned worker sees (set by tangram_launch.launch.boot; torchrun's own variables stay as torchrun sets
# them, except RANK and ROLE_RANK, which take the plan's rank).
ENV_PLAN_FILE = "TANGRAM_PLAN_FILE"  # absolute path of the launcher's copy of the plan
ENV_PLAN_HASH = "TANGRAM_PLAN_HASH"  # sha256 of that file's bytes
ENV_NODE = "TANGRAM_NODE"  # plan node name of this worker's agent
ENV_NODE_INDEX = "TANGRAM_NODE_INDEX"  # position of that node in the plan's node order (first appearance)
ENV_LOCAL_GPU = "TANGRAM_LOCAL_GPU"  # local GPU index the plan gives this worker (no CUDA_VISIBLE_DEVICES games)
ENV_STAGE = "TANGRAM_STAGE"  # pipeline stage of this worker, when the layout names one
ENV_TORCHRUN_RANK = "TANGRAM_TORCHRUN_RANK"  # the RANK torchrun's agent assigned before remapping
ENV_TORCHRUN_ROLE_RANK = "TANGRAM_TORCHRUN_ROLE_RANK"
ENV_RESUME_DIR = "TANGRAM_RESUME_DIR"  # --resume DIR, absolute


@dataclass(frozen=True)
class RankSlot:
    """One row of the rank layout: global rank -> (node, local GPU), plus the stage when given."""

    rank: int
    node: str
    local_gpu: int
    stage: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise SpecError("must be an integer >= 0", field="rank_layout[].rank", value=self.rank)
        if not isinstance(self.node, str) or not self.node:
            raise SpecError("must be a non-empty node name", field=f"rank_layout[{self.rank}].node", value=self.node)
        if isinstance(self.local_gpu, bool) or not isinstance(self.local_gpu, int) or self.local_gpu < 0:
            raise SpecError("must be an integer >= 0", field=f"rank_layout[{self.rank}].local_gpu",
                            value=self.local_gpu)


@dataclass(frozen=True)
class RankLayout:
    """The plan's rank layout, validated: ranks 0..N-1 once each, no (node, local GPU) twice.

    ``nodes`` is the plan's node order: order of first appearance in the ``rank_layout`` list.
    """

    slots: tuple[RankSlot, ...]  # slots[r].rank == r
    nodes: tuple[str, ...] = field(default=())
    source: str | None = None

    def __post_init__(self) -> None:
        if not self.slots:
            raise SpecError("the rank layout is empty", source=self.source, field="rank_layout")
        for r, slot in enumerate(self.slots):
            if slot.rank != r:
                raise SpecError(f"ranks must be 0..{len(self.slots) - 1}, each exactly once", source=self.source,
                                field="rank_layout", value=sorted(s.rank for s in self.slots))
        seen: dict[tuple[str, int], int] = {}
        for slot in self.slots:
            key = (slot.node, slot.local_gpu)
            if key in seen:
                raise SpecError(f"ranks {seen[key]} and {slot.rank} share GPU {slot.node}:{slot.local_gpu}",
                                source=self.source, field=f"rank_layout[{slot.rank}].local_gpu", value=slot.local_gpu)
            seen[key] = slot.rank
        if not self.nodes:
            object.__setattr__(self, "nodes", tuple(dict.fromkeys(s.node for s in self.slots)))
        elif set(self.nodes) != {s.node for s in self.slots}:
            raise SpecError("node order does not name the layout's nodes", source=self.source, field="nodes",
                            value=list(self.nodes))

    @classmethod
    def from_plan_dict(cls, plan: Mapping, *, source: str | None = None) -> "RankLayout":
        if not isinstance(plan, Mapping):
            raise SpecError("a plan is a mapping", source=source, value=type(plan).__name__)
        rows = plan.get("rank_layout")
        if not isinstance(rows, list) or not rows:
            raise SpecError("missing or empty rank layout", source=source, field="rank_layout",
                            valid='a list of {"rank", "node", "local_gpu", "stage"}')
        slots = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise SpecError("expected a mapping", source=source, field=f"rank_layout[{i}]", value=row)
            for key in ("rank", "node", "local_gpu"):
                if key not in row:
                    raise SpecError("missing required field", source=source, field=f"rank_layout[{i}].{key}")
            stage = row.get("stage")
            slots.append(RankSlot(rank=row["rank"], node=row["node"], local_gpu=row["local_gpu"],
                                  stage=stage if isinstance(stage, int) and not isinstance(stage, bool) else None))
        nodes = tuple(dict.fromkeys(s.node for s in slots))  # first appearance in the list as written
        by_rank = sorted(slots, key=lambda s: s.rank)
        return cls(slots=tuple(by_rank), nodes=nodes, source=source)

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def gpu_count(self, node: str) -> int:
        return sum(1 for s in self.slots if s.node == node)

    def local_slots(self, node: str) -> tuple[RankSlot, ...]:
        """The node's slots ordered by local GPU: local rank i takes the i-th."""
        return tuple(sorted((s for s in self.slots if s.node == node), key=lambda s: s.local_gpu))

    def slot_for(self, node: str, local_rank: int) -> RankSlot:
        mine = self.local_slots(node)
        if not mine:
            raise SpecError("node not in the plan", source=self.source, field="node", value=node,
                            valid=", ".join(self.nodes))
        if not 0 <= local_rank < len(mine):
            raise SpecError(f"plan node {node!r} has {len(mine)} GPU(s)", source=self.source, field="LOCAL_RANK",
                            value=local_rank, valid=f"0..{len(mine) - 1}")
        return mine[local_rank]


def read_plan_dict(path: str | os.PathLike, data: bytes | None = None) -> dict:
    """A plan file as a dict: JSON for ``.json`` (no yaml import on the worker's start-up path), else YAML."""
    path = os.fspath(path)
    if data is None:
        from tangram_launch.specs.limits import read_bytes

        data = read_bytes(path, what="plan file")
    from tangram_launch.specs import limits  # size, UTF-8, depth, aliases, integers: bounded in one place

    text = limits.decode(data, source=path)
    if path.endswith(".json"):
        plan = limits.parse_json(text, source=path)
    else:  # YAML is a superset of JSON; only YAML plans pay for the yaml import
        plan = limits.parse_yaml(text, source=path)
    if not isinstance(plan, dict):
        raise SpecError("expected a mapping at the top level", source=path, value=type(plan).__name__)
    return plan


def plan_runtime(plan: Mapping) -> str:
    """The runtime a plan (as its file's dict) was made for: the one it names, else the default."""
    return str(plan.get("runtime") or DEFAULT_RUNTIME)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stage_info(plan: Mapping, slot: RankSlot) -> dict[str, Any]:
    """Stage, island and layer range of a slot, from its layout row or the plan's ``stages`` list (best effort)."""
    info: dict[str, Any] = {"stage": slot.stage, "island": None, "layers": None}
    rows = plan.get("rank_layout") or ()
    row = next((r for r in rows if isinstance(r, Mapping) and r.get("rank") == slot.rank), {})
    stage_row: Mapping = {}
    stages = plan.get("stages")
    if slot.stage is not None and isinstance(stages, list) and 0 <= slot.stage < len(stages):
        if isinstance(stages[slot.stage], Mapping):
            stage_row = stages[slot.stage]
    for key in ("island", "layers"):
        value = row.get(key, stage_row.get(key))
        if value is not None:
            info[key] = tuple(value) if key == "layers" and isinstance(value, list) else value
    return info


def read_launch_plan(path: str, expected_sha256: str | None) -> tuple[bytes, str]:
    """The plan file's bytes and their sha256, refused (RuntimeError) when they are not what the launcher checked
    across agents (``expected_sha256``; None only for a plan file given by hand, outside tangram-launch)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise RuntimeError(f"cannot read the launch plan {path}: {exc.strerror}") from None
    digest = sha256_bytes(data)
    if expected_sha256 is not None and digest != expected_sha256:
        raise RuntimeError(f"the launch plan {path} changed since launch (sha256 {digest[:12]}, launched with "
                           f"{(expected_sha256 or '?')[:12]})")
    return data, digest


def in_tangram_launch() -> bool:
    """True in a worker started by ``tangram-launch --plan/--cluster`` (a plain torchrun-style launch is not)."""
    return bool(os.environ.get(ENV_PLAN_FILE))


@dataclass(frozen=True)
class WorkerPlan:
    """This worker's plan and place, read from the environment boot exported."""

    plan_path: str
    plan_hash: str
    plan_dict: Mapping[str, Any]
    rank: int
    local_rank: int
    world_size: int
    node: str
    node_index: int
    local_gpu: int
    stage: int | None
    island: str | None
    layers: tuple[int, int] | None  # [start, stop) transformer layers of this worker's stage
    torchrun_rank: int

    @cached_property
    def plan(self) -> Any:
        """The full ``tangram_launch.plan.Plan`` (built on first use from the bytes ``current_plan`` read and
        verified against the launch's sha256: the file is not read again, so every rank runs the same plan)."""
        from tangram_launch.plan import Plan

        return Plan.from_dict(copy.deepcopy(dict(self.plan_dict)), source=self.plan_path)

    @cached_property
    def place(self) -> Any:
        """``Plan.place(rank)``: stage, coordinates and groups of this worker."""
        return self.plan.place(self.rank)

    def adapter(self) -> Any:
        """A new adapter for the plan's runtime (tangram_launch.capabilities.runtime: a built-in, or one registered
        under the entry point group ``tangram_launch.runtime_adapters``), imported on first use."""
        from tangram_launch.capabilities import runtime

        return runtime(plan_runtime(self.plan_dict)).adapter()


def current_plan() -> WorkerPlan:
    """The plan this worker was launched with, and its place in it.

    Raises RuntimeError when the process was not started by ``tangram-launch --plan/--cluster`` (a plain torchrun
    or torchrun-compatible launch has no plan), or when the plan file changed since launch.
    """
    env = os.environ
    path = env.get(ENV_PLAN_FILE)
    if not path:
        raise RuntimeError(
            "this process was not started by `tangram-launch --plan FILE` or `tangram-launch --cluster FILE ...`, "
            f"so it has no plan ({ENV_PLAN_FILE} is not set); launch it with tangram-launch and a plan, or check "
            "tangram_launch.worker.in_tangram_launch() first")
    data, digest = read_launch_plan(path, env.get(ENV_PLAN_HASH, ""))
    plan = read_plan_dict(path, data)
    layout = RankLayout.from_plan_dict(plan, source=path)
    rank = int(env["RANK"])
    node = env.get(ENV_NODE, "")
    if not 0 <= rank < layout.world_size or layout.slots[rank].node != node:
        raise RuntimeError(f"RANK={rank} on plan node {node!r} does not match the plan's rank layout ({path}); "
                           "was RANK changed after tangram_launch.launch.boot set it?")
    slot = layout.slots[rank]
    info = stage_info(plan, slot)
    layers = info["layers"]
    return WorkerPlan(
        plan_path=path, plan_hash=digest, plan_dict=plan, rank=rank, local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=layout.world_size, node=node, node_index=layout.nodes.index(node), local_gpu=slot.local_gpu,
        stage=slot.stage, island=info["island"],
        layers=(int(layers[0]), int(layers[1])) if layers is not None and len(layers) == 2 else None,
        torchrun_rank=int(env.get(ENV_TORCHRUN_RANK, rank)),
    )


def slowest_rank_s(seconds: float) -> float:
    """A step's time as the run report counts it (``run-report.json``'s ``step_s``): the slowest rank's, which sets
    the job's pace, as Megatron's and DeepSpeed's step times do; ``seconds`` is this rank's.

    Every rank calls it after each step (one scalar all-reduce, max, over the world, after the step's own collectives:
    the time itself is taken before it); outside a process group of more than one rank, ``seconds`` as it is."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seconds
    on_gpu = dist.get_backend() == "nccl"  # NCCL reduces no CPU tensor
    t = torch.tensor([seconds], dtype=torch.float64,
                     device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
