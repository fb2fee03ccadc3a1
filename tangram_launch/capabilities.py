"""What a runtime can execute, as data the planner reads so it never proposes a plan the runtime cannot run.

Each runtime adapter declares one ``RuntimeCapabilities``; the planner imports only this module, never a runtime.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable

from tangram_launch.specs.constants import DEFAULT_RUNTIME, DTYPES, RECOMPUTE_MODES
from tangram_launch.specs.shape import StageShape

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.plan import Plan


@dataclass(frozen=True)
class RuntimeCapabilities:
    name: str
    uniform_grid: bool = False  # every stage has the same (tp, dp, cp): one process grid for all stages
    uniform_tp: bool = False  # every stage has the same TP size
    uniform_dp: bool = False  # every stage has the same DP x CP size (micro-batches pass whole between stages)
    uniform_ep: bool = False  # one expert-parallel size for all stages
    uniform_zero: bool = False  # one optimizer (ZeRO stage) for the whole job
    max_zero_stage: int = 3
    max_zero_stage_with_pp: int = 3  # DeepSpeed's pipeline engine rejects ZeRO 2/3
    tensor_parallel: bool = True
    context_parallel: bool = True
    expert_parallel: bool = True
    max_zero_stage_with_ep: int = 3  # the torch runtime reduces expert gradients by all-reduce only (ZeRO 0)
    # ZeRO 1 and 2 run as FSDP2 units (each layer, the stage's root module): parameters gathered and gradients
    # reduce-scattered once per step, one collective per unit, each paying its call's fixed cost (off: one bucketed
    # reduce-scatter and all-gather per step, ZeRO-2 reduce-scattering per micro-batch, as DeepSpeed and Megatron's
    # distributed optimizer run them)
    zero_per_unit: bool = False
    offload: bool = True
    recompute_modes: tuple[str, ...] = RECOMPUTE_MODES
    max_stages: int | None = None
    schedules: tuple[str, ...] = ("1F1B",)  # pipeline schedules the runtime runs (interleaved-1F1B: virtual stages)
    interleaved_uniform_grid: bool = False  # interleaved 1F1B only when every stage has the same (tp, dp, cp)
    interleaved_expert_parallel: bool = True  # interleaved 1F1B with ep > 1 stages
    plain_needs_stage_microbatches: bool = False  # one-grid 1F1B needs micro-batches >= stages (torch's Schedule1F1B)
    stage_grids_moe: bool = True  # MoE models too may have stages with their own TP/DP sizes
    dtypes: tuple[str, ...] = DTYPES  # training dtypes the runtime runs
    # a 16-bit plan's ZeRO-0 stages keep fp32 weights and run their GEMMs under autocast: fp32 parameters and
    # gradients, Adam's moments, and per micro-batch in flight the 16-bit copy of every GEMM weight that autocast
    # makes and autograd saves for the backward (off: 16-bit weights beside an fp32 master copy, as DeepSpeed and
    # Megatron keep them)
    autocast_fp32_weights: bool = False
    dtype_notes: tuple[tuple[str, str], ...] = ()  # (dtype, why not) for the ones it refuses
    # the cost model's overlap kinds (costmodel/overlap.py) the runtime runs: how its data-parallel sync and its TP
    # collectives overlap compute ("none": the sync follows the last backward; the collectives wait); the last is
    # how it runs as this project launches it, which the planner prices (launched_overlaps)
    dp_overlaps: tuple[str, ...] = ("none",)
    tp_overlaps: tuple[str, ...] = ("none",)
    # attention runs through torch's scaled_dot_product_attention (runtime_adapters/gpt.py): where the GPU has no
    # FlashAttention kernel (before Ampere) SDPA picks its memory-efficient one, which keeps no s x s scores
    sdpa_attention: bool = False
    # ZeRO 0's gradient all-reduce copies every gradient into flat buckets, divides them there and copies them back
    # (runtime_adapters/torch_native.FlatBuckets): three read-write passes beside the collective, one for
    # experts no other rank holds (divided in place); off: the runtime reduces gradients where they live, as
    # Megatron's DDP does in its contiguous gradient buffer
    dp_flat_buckets: bool = False
    # environment every worker of a plan for this runtime starts with, unless the user set the variable (set by the
    # worker bootstrap before the script runs, so before any CUDA context exists)
    worker_env: tuple[tuple[str, str], ...] = ()

    @property
    def launched_overlaps(self) -> tuple[str, str]:
        """(dp_overlap, tp_overlap) as this project launches the runtime: what the planner prices."""
        return self.dp_overlaps[-1], self.tp_overlaps[-1]

    def for_model(self, num_experts: int) -> "RuntimeCapabilities":
        """What the runtime runs for this model: an MoE model (``num_experts`` > 0) keeps one TP and one DP size
        where the runtime's per-stage grids are dense-only."""
        if num_experts and not self.stage_grids_moe and not (self.uniform_tp and self.uniform_dp):
            return replace(self, uniform_tp=True, uniform_dp=True)
        return self

    def schedule_problems(self, schedule: str, *, virtual_stages: int = 1, num_stages: int = 1,
                          num_microbatches: int = 1, shapes: Iterable[StageShape] = ()) -> list[str]:
        """Why this runtime cannot run the pipeline schedule (empty when it can); ``shapes``: the stages, where
        known."""
        if schedule not in self.schedules:
            return [f"{self.name} has no {schedule} schedule (has: {', '.join(self.schedules)})"]
        shapes = list(shapes)
        grids = sorted({(s.tp, s.dp, s.cp) for s in shapes})
        if schedule == "interleaved-1F1B" and self.interleaved_uniform_grid and len(grids) > 1:
            return [f"{self.name} runs interleaved 1F1B with one (tp, dp, cp) grid for all stages; plan has {grids}"]
        if schedule == "interleaved-1F1B" and not self.interleaved_expert_parallel and any(s.ep > 1 for s in shapes):
            return [f"{self.name} runs interleaved 1F1B without expert parallelism (plan has ep="
                    f"{max(s.ep for s in shapes)})"]
        if (schedule == "1F1B" and self.plain_needs_stage_microbatches and 1 < num_stages
                and num_microbatches < num_stages and len(grids) <= 1):  # a per-stage-grid executor runs any number
            return [f"{self.name}'s 1F1B needs num_microbatches >= stages ({num_microbatches} < {num_stages})"]
        if schedule == "interleaved-1F1B" and num_stages > 1 and num_microbatches % num_stages:
            # Megatron-core groups micro-batches by pipeline size (microbatch_group_size_per_vp_stage = pp) and
            # refuses a remainder smaller than pp
            return [f"interleaved 1F1B needs the micro-batches ({num_microbatches}) to be a multiple of the "
                    f"pipeline stages ({num_stages})"]
        return []

    def overlap_problems(self, *, dp_overlap: str, tp_overlap: str) -> list[str]:
        """Why this runtime does not run the overlap asked for (empty when it does)."""
        out = []
        if dp_overlap not in self.dp_overlaps:
            out.append(f"dp_overlap={dp_overlap}: {self.name} syncs data-parallel gradients as "
                       f"{' or '.join(self.dp_overlaps)}")
        if tp_overlap not in self.tp_overlaps:
            out.append(f"tp_overlap={tp_overlap}: {self.name} overlaps tensor-parallel collectives as "
                       f"{' or '.join(self.tp_overlaps)}")
        return out

    def dtype_problems(self, dtype: str) -> list[str]:
        """Why this runtime cannot train in ``dtype`` (empty when it can)."""
        if dtype in self.dtypes:
            return []
        why = dict(self.dtype_notes).get(dtype, "not among its dtypes")
        return [f"{self.name} cannot train in {dtype}: {why} (it runs {', '.join(self.dtypes)})"]

    def stage_problems(self, shape: StageShape, *, pipelined: bool) -> list[str]:
        """Why this runtime cannot run one stage of this shape (empty when it can)."""
        out = []
        if shape.tp > 1 and not self.tensor_parallel:
            out.append(f"{self.name} has no tensor parallelism (tp={shape.tp})")
        if shape.cp > 1 and not self.context_parallel:
            out.append(f"{self.name} has no context parallelism (cp={shape.cp})")
        if shape.ep > 1 and not self.expert_parallel:
            out.append(f"{self.name} has no expert parallelism (ep={shape.ep})")
        elif shape.ep > 1 and shape.zero_stage > self.max_zero_stage_with_ep:
            out.append(f"{self.name} runs expert parallelism with ZeRO stage <= {self.max_zero_stage_with_ep} "
                       f"(ep={shape.ep}, zero_stage={shape.zero_stage})")
        if shape.offload and not self.offload:
            out.append(f"{self.name} cannot offload optimizer state")
        limit = self.max_zero_stage_with_pp if pipelined else self.max_zero_stage
        if shape.zero_stage > limit:
            what = "with pipeline parallelism" if pipelined else ""
            out.append(f"{self.name} runs ZeRO stage <= {limit} {what}".rstrip() + f" (zero_stage={shape.zero_stage})")
        if shape.recompute not in self.recompute_modes:
            out.append(f"{self.name} has no '{shape.recompute}' recompute (has: {', '.join(self.recompute_modes)})")
        return out

    def allows_stage(self, shape: StageShape, *, pipelined: bool) -> bool:
        return not self.stage_problems(shape, pipelined=pipelined)

    def pipeline_problems(self, shapes: Iterable[StageShape]) -> list[str]:
        """Cross-stage constraints (one grid / one TP size) for a whole pipeline."""
        shapes = list(shapes)
        out = []
        if self.max_stages is not None and len(shapes) > self.max_stages:
            out.append(f"{self.name} runs at most {self.max_stages} pipeline stages (plan has {len(shapes)})")
        if self.uniform_grid and len({(s.tp, s.dp, s.cp) for s in shapes}) > 1:
            grids = sorted({(s.tp, s.dp, s.cp) for s in shapes})
            out.append(f"{self.name} needs one (tp, dp, cp) grid for all stages; plan has {grids}")
        else:
            if self.uniform_tp and len({s.tp for s in shapes}) > 1:
                out.append(f"{self.name} needs one TP size for all stages; plan has {sorted({s.tp for s in shapes})}")
            if self.uniform_dp and len({s.dp * s.cp for s in shapes}) > 1:
                out.append(f"{self.name} needs one DP size for all stages; plan has "
                           f"{sorted({s.dp * s.cp for s in shapes})}")
        if self.uniform_ep and len({s.ep for s in shapes}) > 1:
            out.append(f"{self.name} needs one expert-parallel size for all stages; plan has "
                       f"{sorted({s.ep for s in shapes})}")
        if self.uniform_zero and len({s.zero_stage for s in shapes}) > 1:
            out.append(f"{self.name} builds one optimizer for all stages; plan has ZeRO stages "
                       f"{sorted({s.zero_stage for s in shapes})}")
        return out

    def plan_problems(self, plan: "Plan") -> list[str]:
        """Everything that stops this runtime from executing the plan (checked before any process group exists)."""
        caps = self.for_model(int(plan.model.get("num_experts", 0) or 0))
        shapes = [s.shape for s in plan.stages]
        pipelined = len(shapes) > 1
        out = list(caps.dtype_problems(str(plan.training.get("dtype", "fp32"))))
        if plan.schedule in ("1F1B", "interleaved-1F1B"):  # GPipe is each adapter's own check
            out.extend(caps.schedule_problems(plan.schedule, virtual_stages=plan.virtual_stages,
                                              num_stages=len(shapes), num_microbatches=plan.num_microbatches,
                                              shapes=shapes))
        for i, sh in enumerate(shapes):
            out.extend(f"stage {i}: {p}" for p in caps.stage_problems(sh, pipelined=pipelined))
        out.extend(caps.pipeline_problems(shapes))
        return out


# The built-in runtimes' capabilities live here as data so the planner can read them without importing a runtime;
# each adapter in runtime_adapters/ re-exports its own entry and is tested against what the runtime really accepts.
TORCH = RuntimeCapabilities(
    name="torch",
    # stages with their own (tp, dp): runtime_adapters/schedule.py re-splits each micro-batch's rows at every
    # stage boundary (runtime_adapters/stage_grid.py); one grid runs on torch.distributed.pipelining. ZeRO maps to
    # FSDP2 per stage: ZeRO 1 and 2 both as fully_shard(reshard_after_forward=False), per layer and the root
    # (runtime_adapters/torch_native.py), under a pipeline schedule that syncs gradients on the last micro-batch.
    zero_per_unit=True,
    uniform_tp=False,
    uniform_dp=False,
    context_parallel=False,
    # MoE layers of runtime_adapters.moe: experts sharded over an EP group carved from the stage's DP ranks, tokens
    # by all_to_all_single; expert gradients reduced over the expert-data-parallel group by all-reduce (no FSDP2).
    expert_parallel=True,
    max_zero_stage_with_ep=0,
    # optimizer state, fp32 copy and the update on the host (runtime_adapters/offload.py), any ZeRO stage
    offload=True,
    max_zero_stage=3,
    max_zero_stage_with_pp=3,
    # GPipe for hand-written plans (the planner costs 1F1B); interleaved 1F1B: ScheduleInterleaved1F1B over one
    # PipelineStage per model chunk (runtime_adapters/interleaved.py), tested exact on 2 CPU ranks
    schedules=("1F1B", "GPipe", "interleaved-1F1B"),
    plain_needs_stage_microbatches=True,
    interleaved_uniform_grid=True,  # the per-stage-grid executor (runtime_adapters/schedule.py) runs 1F1B/GPipe
    interleaved_expert_parallel=False,  # model chunks are built without expert-parallel groups
    # MoE routing groups and auxiliary losses per re-split micro-batch are untested there: one grid for MoE models
    stage_grids_moe=False,
    # tf32: fp32 parameters with torch.backends.cuda.matmul.allow_tf32 set by the adapter
    dtypes=("bf16", "fp16", "fp32", "tf32"),
    # ZeRO 0 runs autocast over fp32 weights; ZeRO 1-3 gather 16-bit parameters (FSDP2's MixedPrecisionPolicy), whose
    # fp32 shards, fp32 gradients and Adam moments take what the cost model's 16-bit storage assumes
    autocast_fp32_weights=True,
    sdpa_attention=True,
    dp_flat_buckets=True,
    dtype_notes=(("fp8", "the torch runtime builds plain nn.Linear layers; it has no FP8 GEMM path "
                         "(Transformer Engine or torchao Float8)"),),
)
DEEPSPEED = RuntimeCapabilities(
    name="deepspeed",
    uniform_grid=True,
    uniform_zero=True,  # one DeepSpeed config per engine
    tensor_parallel=False,  # DeepSpeed's pipeline has no tensor-parallel layers of its own
    max_zero_stage=3,
    max_zero_stage_with_pp=1,  # PipelineEngine asserts zero stage < 2
    context_parallel=False,
    expert_parallel=False,
    offload=False,
    recompute_modes=("none", "full"),
    dtypes=("bf16", "fp16", "fp32"),
    sdpa_attention=True,  # the same GPT layers as the torch runtime (runtime_adapters/gpt.py)
    dtype_notes=(("fp8", "the DeepSpeed adapter has no FP8 GEMM path"),
                 ("tf32", "the DeepSpeed adapter does not switch TF32 matmuls on (train fp32, or use torch/megatron)")),
)
MEGATRON = RuntimeCapabilities(
    name="megatron",
    uniform_grid=True,  # one parallel_state per job: one (tp, dp, cp) for every pipeline rank
    uniform_ep=True,
    uniform_zero=True,  # one (distributed) optimizer for the job
    max_zero_stage=1,  # the distributed optimizer shards optimizer state (ZeRO-1)
    max_zero_stage_with_pp=1,
    offload=False,
    # fp8: TransformerConfig(fp8="hybrid") with Transformer Engine layers (refused at setup where TE is missing)
    dtypes=("bf16", "fp16", "fp32", "tf32", "fp8"),
    # interleaved: virtual_pipeline_model_parallel_size with a pipeline_model_parallel_layout of p x v chunks
    schedules=("1F1B", "interleaved-1F1B"),
    # the adapter sets overlap_grad_reduce off (the sync follows the schedule); Megatron-core's linear layers issue
    # the backward's input-gradient TP collective asynchronously beside the weight-gradient GEMM, which overlaps
    # only where CUDA runs kernels in the order issued: CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron's own launch
    # scripts export (megatron/core/tensor_parallel/layers.py: "Use of this module requires" it)
    tp_overlaps=("none", "backward"),
    worker_env=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),),
)

BUILTIN = {c.name: c for c in (TORCH, DEEPSPEED, MEGATRON)}


# --- the runtime registry: each runtime's capabilities with its adapter -----------------------------------------------

# A third-party runtime registers its adapter class (a runtime_adapters.base.RuntimeAdapter with a ``capabilities``
# class attribute) in its packaging metadata:
#     [project.entry-points."tangram_launch.runtime_adapters"]
#     myrt = "my_package.adapter:MyAdapter"
ADAPTER_ENTRY_POINT_GROUP = "tangram_launch.runtime_adapters"
_BUILTIN_ADAPTERS = {
    "torch": "runtime_adapters.torch_native:TorchAdapter",
    "deepspeed": "runtime_adapters.deepspeed_adapter:DeepSpeedAdapter",
    "megatron": "runtime_adapters.megatron_adapter:MegatronAdapter",
}


@dataclass(frozen=True)
class Runtime:
    """One registered runtime: what it runs (read by the planner as data) and its adapter, named as
    ``module:Class`` and imported only when a worker asks for it (the planner never imports a runtime)."""

    capabilities: RuntimeCapabilities
    adapter_target: str

    @property
    def name(self) -> str:
        return self.capabilities.name

    def adapter_class(self) -> type:
        import importlib

        module, _, attr = self.adapter_target.partition(":")
        return getattr(importlib.import_module(module), attr)

    def adapter(self):
        """A new adapter instance (imports the adapter module, and through it the runtime, on first use)."""
        return self.adapter_class()()


BUILTIN_RUNTIMES = {name: Runtime(BUILTIN[name], target) for name, target in _BUILTIN_ADAPTERS.items()}


def adapter_entry_points() -> dict:
    # read only for a name that is not built in: importlib.metadata costs a planning run 15-20 ms of CPU
    from importlib import metadata

    return {ep.name: ep for ep in metadata.entry_points(group=ADAPTER_ENTRY_POINT_GROUP)}


def runtime_names() -> list[str]:
    """Built-in runtimes first, then the registered third-party ones (sorted)."""
    return list(BUILTIN_RUNTIMES) + sorted(n for n in adapter_entry_points() if n not in BUILTIN_RUNTIMES)


def runtime(name: str) -> Runtime:
    """The registered runtime ``name``; unknown names list the registered ones. A third-party adapter class is
    loaded to read its ``capabilities`` (its runtime itself should be imported lazily, as the built-ins do)."""
    from tangram_launch.errors import SpecError

    if name in BUILTIN_RUNTIMES:
        return BUILTIN_RUNTIMES[name]
    eps = adapter_entry_points() if isinstance(name, str) else {}
    if name not in eps:
        from tangram_launch.specs.yamlio import closest

        names = runtime_names()
        hint = closest(str(name), names)
        raise SpecError("unknown runtime", field="runtime", value=name,
                        valid=(f"did you mean '{hint}'? " if hint else "") + ", ".join(names)
                        + f" (third-party adapters register under the entry point group "
                          f"'{ADAPTER_ENTRY_POINT_GROUP}'; did you forget to install one?)")
    entry = Runtime(RuntimeCapabilities(name), eps[name].value)
    try:
        caps = entry.adapter_class().capabilities
    except Exception as exc:  # a broken plugin is a user-environment problem, reported by name
        raise SpecError(f"cannot load runtime adapter plugin ({type(exc).__name__}: {exc})", field="runtime",
                        value=name, valid=f"entry point {eps[name].value} with a `capabilities` attribute") from exc
    if not isinstance(caps, RuntimeCapabilities) or caps.name != name:
        raise SpecError("the adapter's `capabilities` must be a RuntimeCapabilities named as its entry point",
                        field="runtime", value=name, valid=f"RuntimeCapabilities(name={name!r}, ...)")
    return Runtime(caps, eps[name].value)


def capabilities_for(runtime_name: str) -> RuntimeCapabilities:
    """What the registered runtime ``runtime_name`` runs."""
    return runtime(runtime_name).capabilities
