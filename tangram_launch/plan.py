"""The Plan: one frozen, versioned artifact that everything after planning reads.

Field names are the JSON contract (``plan.schema.json`` beside this file). Ranks are numbered stage by stage
(pipeline outermost), and inside a stage with TP fastest, then CP, then DP (Megatron's default "tp-cp-ep-dp-pp"
order), so TP groups are consecutive GPUs of one node.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

import yaml

from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import RECOMPUTE_MODES  # noqa: F401 (re-exported: the Plan's recompute modes)
from tangram_launch.specs.constants import DEFAULT_RUNTIME, MATH_MODES, SCHEDULES
from tangram_launch.specs.shape import StageShape, check_shape
from tangram_launch.specs.yamlio import check_keys, dump_text_file, dump_yaml_file, load_yaml_file, to_plain
from tangram_launch.topology import Topology

PLAN_VERSION = 1
# what a Plan may say: the planner's schedules (costed) and GPipe, which the torch runtime also runs for hand-written
# plans (runtime_adapters/torch_native.py)
PLAN_SCHEDULES = SCHEDULES + ("GPipe",)


@dataclass(frozen=True)
class Stage(StageShape):
    """One pipeline stage of the Plan: a stage shape (tp, dp, cp, ep, zero_stage, recompute, offload; keyword-only)
    placed on GPUs, with its layer range and micro-batch size. The JSON keeps the shape's fields flat."""

    index: int
    layers: tuple[int, int]  # [start, stop) over transformer layers
    island: str
    gpus: tuple[tuple[str, int], ...]  # (node, local GPU index), in rank order
    micro_batch_size: int = 1  # sequences per micro-batch per DP replica
    has_embedding: bool = False
    has_head: bool = False
    # interleaved 1F1B only: the layer ranges of this stage's model chunks, one per virtual stage, in schedule
    # order (interleaved_chunks). ``layers`` then gives the stage's share of layers in the plain order (its count
    # and what its time and memory were costed on); the chunks are what the stage holds.
    chunks: tuple[tuple[int, int], ...] = ()
    # tf32 plans only: "tf32" (TF32 tensor-core matmuls) or "fp32" (strict FP32, GPUs without TF32), the mode this
    # stage was priced in and its ranks run (allow_tf32); None elsewhere, so other plans' JSON has no such key
    math_mode: str | None = None

    def __post_init__(self) -> None:
        where = f"stages[{self.index}]"
        start, stop = self.layers
        if not (0 <= start < stop):
            raise SpecError("layer range must be [start, stop) with 0 <= start < stop", field=f"{where}.layers",
                            value=list(self.layers))
        check_shape(tp=self.tp, dp=self.dp, cp=self.cp, ep=self.ep, zero_stage=self.zero_stage,
                    recompute=self.recompute, where=f"{where}.")
        v = self.micro_batch_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError("must be a positive integer", field=f"{where}.micro_batch_size", value=v)
        if self.math_mode is not None and self.math_mode not in MATH_MODES:
            raise SpecError("unknown math mode", field=f"{where}.math_mode", value=self.math_mode,
                            valid=", ".join(MATH_MODES))
        if len(self.gpus) != self.tp * self.dp * self.cp:
            raise SpecError(f"a stage needs tp*dp*cp = {self.tp * self.dp * self.cp} GPUs",
                            field=f"{where}.gpus", value=len(self.gpus))

    @property
    def shape(self) -> StageShape:
        """This stage's parallel configuration alone."""
        return self.as_shape()

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "layers": list(self.layers),
            "island": self.island,
            "num_gpus": self.num_gpus,
            "gpus": [{"node": n, "local_gpu": g} for n, g in self.gpus],
            "tp": self.tp, "dp": self.dp, "cp": self.cp, "ep": self.ep,
            "zero_stage": self.zero_stage,
            "recompute": self.recompute,
            "micro_batch_size": self.micro_batch_size,
            "offload": self.offload,
            "has_embedding": self.has_embedding,
            "has_head": self.has_head,
            **({"chunks": [list(c) for c in self.chunks]} if self.chunks else {}),
            **({"math_mode": self.math_mode} if self.math_mode is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping, *, source: str | None = None) -> "Stage":
        idx = d.get("index", "?")
        where = f"stages[{idx}]"
        check_keys(d, ("index", "layers", "island", "num_gpus", "gpus", "tp", "dp", "cp", "ep", "zero_stage",
                       "recompute", "micro_batch_size", "offload", "has_embedding", "has_head", "chunks", "math_mode"),
                   where=where, source=source)
        from tangram_launch.specs.limits import check_plan_stage

        check_plan_stage(d, where=where, source=source)  # types first: int() would truncate 1.5, accept "3"
        try:
            gpus = tuple((str(g["node"]), int(g["local_gpu"])) for g in d["gpus"])
            layers = tuple(int(x) for x in d["layers"])
            chunks = tuple((int(c[0]), int(c[1])) for c in d.get("chunks") or ())
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise SpecError(f"malformed stage ({exc})", source=source, field=where) from None
        if len(layers) != 2:
            raise SpecError("layers must be [start, stop)", source=source, field=f"{where}.layers", value=d["layers"])
        kw = {k: d[k] for k in ("tp", "dp", "cp", "ep", "zero_stage", "recompute", "micro_batch_size", "offload",
                                "has_embedding", "has_head") if k in d}
        stage = cls(index=int(d["index"]), layers=layers, island=str(d["island"]), gpus=gpus, chunks=chunks,
                    math_mode=d.get("math_mode"), **kw)
        if "num_gpus" in d and int(d["num_gpus"]) != stage.num_gpus:
            raise SpecError("num_gpus differs from the gpus list", source=source, field=f"{where}.num_gpus",
                            value=d["num_gpus"], valid=str(stage.num_gpus))
        return stage


@dataclass(frozen=True)
class RankEntry:
    rank: int
    node: str
    local_gpu: int
    stage: int
    tp: int  # coordinates inside the stage
    cp: int
    dp: int

    def to_dict(self) -> dict:
        return {"rank": self.rank, "node": self.node, "local_gpu": self.local_gpu, "stage": self.stage,
                "coords": {"pp": self.stage, "dp": self.dp, "cp": self.cp, "tp": self.tp}}


def _optional_float(d: Mapping, key: str) -> float | None:
    return None if d.get(key) is None else float(d[key])


@dataclass(frozen=True)
class StagePrediction:
    forward_s: float  # per micro-batch
    backward_s: float  # per micro-batch (incl. recompute)
    peak_memory_gib: float
    capacity_gib: float
    # priced from the profile's measured layer times: {"parts", "how", "distance"[, "analytic_parts"]}
    # (costmodel/measured_layers.py); None: priced by the analytic model alone
    measured: Mapping | None = None
    # per iteration, after the stage's last backward: the gradient synchronisation left exposed and the optimizer
    # step (None: a plan written before these were recorded)
    sync_s: float | None = None
    optimizer_s: float | None = None

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict:
        return {"time_s": self.time_s, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "peak_memory_gib": self.peak_memory_gib, "capacity_gib": self.capacity_gib,
                **({"measured": dict(self.measured)} if self.measured is not None else {}),
                **({"sync_s": self.sync_s} if self.sync_s is not None else {}),
                **({"optimizer_s": self.optimizer_s} if self.optimizer_s is not None else {})}


@dataclass(frozen=True)
class Prediction:
    iteration_time_s: float
    tokens_per_s: float
    mfu: float  # model FLOPs (causal attention, no recompute) / peak of the GPUs used
    stages: tuple[StagePrediction, ...]
    breakdown: Mapping[str, float] = field(default_factory=dict)  # e.g. pipeline, p2p, dp_sync, optimizer

    def to_dict(self) -> dict:
        return {"iteration_time_s": self.iteration_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "stages": [s.to_dict() for s in self.stages], "breakdown": dict(self.breakdown)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Prediction":
        return cls(
            iteration_time_s=float(d["iteration_time_s"]), tokens_per_s=float(d["tokens_per_s"]),
            mfu=float(d["mfu"]),
            stages=tuple(StagePrediction(float(s["forward_s"]), float(s["backward_s"]), float(s["peak_memory_gib"]),
                                         float(s["capacity_gib"]), s.get("measured"), _optional_float(s, "sync_s"),
                                         _optional_float(s, "optimizer_s")) for s in d["stages"]),
            breakdown={k: float(v) for k, v in (d.get("breakdown") or {}).items()},
        )


@dataclass(frozen=True)
class Place:
    """A worker's place in the plan: everything an adapter needs to build its groups and its model part."""

    rank: int
    world_size: int
    stage: Stage
    num_stages: int
    node: str
    local_gpu: int
    coords: Mapping[str, int]  # pp, dp, cp, tp
    tp_group: tuple[int, ...]
    cp_group: tuple[int, ...]
    dp_group: tuple[int, ...]
    pp_group: tuple[int, ...] | None  # same coordinates in every stage; None when stages have different grids
    prev_stage_ranks: tuple[int, ...]
    next_stage_ranks: tuple[int, ...]

    @property
    def layers(self) -> tuple[int, int]:
        return self.stage.layers

    @property
    def is_first_stage(self) -> bool:
        return self.stage.index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage.index == self.num_stages - 1


@dataclass(frozen=True)
class Plan:
    model: Mapping[str, Any]  # ModelSpec.to_dict()
    training: Mapping[str, Any]  # TrainingSpec.to_dict()
    stages: tuple[Stage, ...]
    num_microbatches: int
    predicted: Prediction
    runtime: str = DEFAULT_RUNTIME
    schedule: str = "1F1B"  # or "interleaved-1F1B" (costmodel.pipeline.SCHEDULES)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B; 1 for plain 1F1B)
    islands_used: tuple[str, ...] = ()
    islands_dropped: tuple[Mapping[str, str], ...] = ()  # {"island": name, "reason": text}
    cluster: Mapping[str, Any] = field(default_factory=dict)  # {"name", "hash", "nodes": [{"name", "num_gpus"}]}
    planner: Mapping[str, Any] = field(default_factory=dict)  # parallelizer, planning_time_s, pruning stats, ...
    version: int = PLAN_VERSION
    rank_layout: tuple[RankEntry, ...] = ()

    def __post_init__(self) -> None:
        if not self.rank_layout:
            object.__setattr__(self, "rank_layout", _derive_rank_layout(self.stages))
        self.validate()

    # --- invariants ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Contiguous layer cover, no GPU twice, batch arithmetic, rank layout consistent with stages."""
        if not self.stages:
            raise SpecError("a plan needs at least one stage", field="stages")
        if self.version != PLAN_VERSION:
            raise SpecError("unsupported plan version", field="version", value=self.version,
                            valid=str(PLAN_VERSION))
        expect = 0
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise SpecError("stage indices must be 0..S-1 in order", field=f"stages[{i}].index", value=s.index)
            if s.layers[0] != expect:
                raise SpecError(f"layers must be covered contiguously; stage {i} should start at {expect}",
                                field=f"stages[{i}].layers", value=list(s.layers))
            expect = s.layers[1]
        num_layers = int(self.model.get("num_layers", expect))
        if expect != num_layers:
            raise SpecError(f"stages cover layers [0, {expect}) but the model has {num_layers}",
                            field="stages", value=expect, valid=str(num_layers))
        seen: dict[tuple[str, int], int] = {}
        for s in self.stages:
            for g in s.gpus:
                if g in seen:
                    raise SpecError(f"GPU {g[0]}:{g[1]} is used by stages {seen[g]} and {s.index}",
                                    field=f"stages[{s.index}].gpus", value=f"{g[0]}:{g[1]}")
                seen[g] = s.index
        if self.training.get("dtype") != "tf32":
            for s in self.stages:
                if s.math_mode is not None:
                    raise SpecError("math_mode is for tf32 plans only (it says whether a stage's matmuls run TF32)",
                                    field=f"stages[{s.index}].math_mode", value=s.math_mode,
                                    valid=f"no math_mode, or training.dtype tf32 (this plan trains in "
                                          f"{self.training.get('dtype')})")
        gb = int(self.training.get("global_batch", 0))
        if self.num_microbatches < 1:
            raise SpecError("must be >= 1", field="num_microbatches", value=self.num_microbatches)
        for s in self.stages:
            if gb and s.micro_batch_size * s.dp * self.num_microbatches != gb:
                raise SpecError(
                    f"micro_batch_size*dp*num_microbatches = {s.micro_batch_size}*{s.dp}*{self.num_microbatches}"
                    f" must equal the global batch {gb}", field=f"stages[{s.index}].micro_batch_size",
                    value=s.micro_batch_size)
        last = len(self.stages) - 1
        # exactly the first stage holds the embedding and exactly the last the head (a later stage's embedding
        # would take hidden states as token ids)
        for s in self.stages:
            for key, holds, where in (("has_embedding", s.has_embedding, 0), ("has_head", s.has_head, last)):
                if holds == (s.index == where):
                    continue
                if not holds:
                    raise SpecError("the first stage holds the embedding and the last the head",
                                    field="stages.has_embedding/has_head")
                raise SpecError(f"only stage {where} holds the {key[4:]}", field=f"stages[{s.index}].{key}",
                                value=holds, valid="false")
        derived = _derive_rank_layout(self.stages)
        if tuple(self.rank_layout) != derived:
            raise SpecError("rank_layout is not consistent with the stages (ranks are numbered stage by stage, "
                            "tp fastest, then cp, then dp)", field="rank_layout")
        self._validate_schedule()
        if len(self.predicted.stages) != len(self.stages):
            raise SpecError("one prediction per stage", field="predicted.stages", value=len(self.predicted.stages),
                            valid=str(len(self.stages)))

    def _validate_schedule(self) -> None:
        # a schedule name is each runtime's to accept or refuse (adapters name what they run, PLAN_SCHEDULES lists
        # the known ones); here only the virtual stages must agree with the schedule
        v = self.virtual_stages
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SpecError("must be a positive integer", field="virtual_stages", value=v)
        if self.schedule != "interleaved-1F1B":
            if v != 1 or any(s.chunks for s in self.stages):
                raise SpecError(f"{self.schedule} has one model chunk per stage", field="virtual_stages", value=v,
                                valid="1 (or schedule: interleaved-1F1B)")
            return
        if v < 2:
            raise SpecError("interleaved 1F1B needs at least 2 virtual stages", field="virtual_stages", value=v)
        expect = interleaved_chunks([s.num_layers for s in self.stages], v)
        got = tuple(s.chunks for s in self.stages)
        if got != expect:
            raise SpecError("stage chunks must be interleaved_chunks(layer counts, virtual_stages)",
                            field="stages.chunks", value=[list(map(list, c)) for c in got][:2])

    # --- derived views ------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.rank_layout)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def node_gpu_counts(self) -> dict[str, int]:
        """GPUs the plan uses per node, in order of first use."""
        counts: dict[str, int] = {}
        for r in self.rank_layout:
            counts[r.node] = counts.get(r.node, 0) + 1
        return counts

    def place(self, rank: int) -> Place:
        if not 0 <= rank < self.world_size:
            raise SpecError("rank outside the plan", field="rank", value=rank, valid=f"0..{self.world_size - 1}")
        me = self.rank_layout[rank]
        topo = self.topology
        c = topo.coords(rank)
        return Place(rank=rank, world_size=self.world_size, stage=self.stages[c.pp], num_stages=self.num_stages,
                     node=me.node, local_gpu=me.local_gpu, coords=c._asdict(),
                     tp_group=topo.tp_group(rank), cp_group=topo.cp_group(rank), dp_group=topo.dp_group(rank),
                     pp_group=topo.pp_group(rank), prev_stage_ranks=topo.stage_peers(rank, c.pp - 1),
                     next_stage_ranks=topo.stage_peers(rank, c.pp + 1))

    @cached_property
    def topology(self) -> Topology:
        """The rank grid of every stage and every process group (computed once per Plan)."""
        return Topology.from_shapes([s.shape for s in self.stages])

    # --- serialisation ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "runtime": self.runtime,
            "schedule": self.schedule,
            **({"virtual_stages": self.virtual_stages} if self.schedule == "interleaved-1F1B" else {}),
            "model": dict(self.model),
            "training": dict(self.training),
            "cluster": to_plain(self.cluster),
            "num_microbatches": self.num_microbatches,
            "stages": [s.to_dict() for s in self.stages],
            "rank_layout": [r.to_dict() for r in self.rank_layout],
            "islands_used": list(self.islands_used),
            "islands_dropped": [dict(d) for d in self.islands_dropped],
            "predicted": self.predicted.to_dict(),
            "planner": to_plain(self.planner),
        }

    @classmethod
    def from_dict(cls, d: Mapping, *, source: str | None = None) -> "Plan":
        if not isinstance(d, Mapping):
            raise SpecError("a plan is a mapping", source=source, value=type(d).__name__)
        check_keys(d, ("version", "runtime", "schedule", "virtual_stages", "model", "training", "cluster",
                       "num_microbatches", "stages", "rank_layout", "islands_used", "islands_dropped", "predicted",
                       "planner"),
                   where="", source=source)
        for key in ("model", "training", "stages", "num_microbatches", "predicted"):
            if key not in d:
                raise SpecError("missing required field", source=source, field=key)
        from tangram_launch.specs.limits import check_plan_shape

        check_plan_shape(d, source=source)  # the type of every top-level field, before anything converts it
        try:
            layout = tuple(
                RankEntry(rank=int(r["rank"]), node=str(r["node"]), local_gpu=int(r["local_gpu"]),
                          stage=int(r["stage"]), tp=int(r["coords"]["tp"]), cp=int(r["coords"]["cp"]),
                          dp=int(r["coords"]["dp"]))
                for r in d.get("rank_layout") or ()
            )
            predicted = Prediction.from_dict(d["predicted"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SpecError(f"malformed plan ({exc!r})", source=source) from None
        try:
            return cls(
                version=int(d.get("version", PLAN_VERSION)),
                runtime=str(d.get("runtime", DEFAULT_RUNTIME)),
                schedule=str(d.get("schedule", "1F1B")),
                virtual_stages=int(d.get("virtual_stages", 1)),
                model=dict(d["model"]),
                training=dict(d["training"]),
                cluster=dict(d.get("cluster") or {}),
                num_microbatches=int(d["num_microbatches"]),
                stages=tuple(Stage.from_dict(s, source=source) for s in d["stages"]),
                rank_layout=layout,
                islands_used=tuple(d.get("islands_used") or ()),
                islands_dropped=tuple(dict(x) for x in d.get("islands_dropped") or ()),
                predicted=predicted,
                planner=dict(d.get("planner") or {}),
            )
        except SpecError as exc:
            if source and not exc.source:
                raise SpecError(str(exc), source=source) from None
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field of the wrong shape
            raise SpecError(f"malformed plan ({exc!r})", source=source) from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def dump(self, path: str | os.PathLike) -> None:
        """JSON for .json, YAML otherwise; written atomically."""
        path = os.fspath(path)
        if path.endswith(".json"):
            dump_text_file(self.to_json(), path)
        else:
            dump_yaml_file(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = os.fspath(path)
        return cls.from_dict(load_yaml_file(path), source=path)  # YAML is a superset of JSON

    def content_hash(self) -> str:
        """sha256 of the canonical JSON: agents compare it to agree on one plan."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


def tf32_matmuls_allowed(plan: Plan, place: Place) -> bool | None:
    """What a rank sets ``torch.backends.cuda.matmul.allow_tf32`` to: on a tf32 plan, True unless its stage runs
    strict FP32 (``math_mode: fp32``, priced at the FP32 peak); None (leave torch's default, strict FP32) on
    every other plan. A tf32 plan written by hand without math modes runs TF32 wherever the GPU has it."""
    if plan.training.get("dtype") != "tf32":
        return None
    return place.stage.math_mode != "fp32"


def interleaved_chunks(layer_counts: list[int] | tuple[int, ...], virtual_stages: int
                       ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Layer ranges of every stage's model chunks under interleaved 1F1B: stage k's n_k layers split into v chunks
    (the first n_k mod v one layer longer), laid along the model chunk-major, as Megatron-core orders virtual stages:
    (stage 0, chunk 0), (stage 1, chunk 0), ..., (stage S-1, chunk 0), (stage 0, chunk 1), ...
    The embedding stays on stage 0's first chunk, the head on the last stage's last chunk."""
    v = virtual_stages
    sizes = [[n // v + (1 if j < n % v else 0) for j in range(v)] for n in layer_counts]
    out: list[list[tuple[int, int]]] = [[] for _ in layer_counts]
    start = 0
    for j in range(v):
        for k, per in enumerate(sizes):
            out[k].append((start, start + per[j]))
            start += per[j]
    return tuple(tuple(c) for c in out)


def _derive_rank_layout(stages: tuple[Stage, ...]) -> tuple[RankEntry, ...]:
    out = []
    rank = 0
    for s in stages:
        for i, (node, gpu) in enumerate(s.gpus):
            tp = i % s.tp
            cp = (i // s.tp) % s.cp
            dp = i // (s.tp * s.cp)
            out.append(RankEntry(rank, node, gpu, s.index, tp=tp, cp=cp, dp=dp))
            rank += 1
    return tuple(out)
