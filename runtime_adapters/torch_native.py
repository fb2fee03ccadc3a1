"""The ``torch`` runtime: torch.distributed.pipelining + DDP/FSDP2 + DTensor tensor parallel, built from a Plan.

Per rank (order as in torchtitan's parallelize step, and why):

1. ``check_plan`` refuses what this runtime cannot run, before any process group exists.
2. Process groups from the plan's rank layout (``runtime_adapters.groups``): tp/dp per stage, one pipeline per
   (tp, dp) coordinate, and the stage's (dp, tp) DeviceMesh.
3. The stage's module: embedding if first, layers [start, stop), head if last, from the model source
   (``runtime_adapters.model_source``: the built-in GPT by default, a Hugging Face model with
   ``runtime_adapters.hf_model.HFSource``, or a user's ``LayeredSource``), each part seeded by itself so any layout
   starts from the same weights.
4. Tensor parallel (stage.tp > 1): DTensor column/row split of attention and MLP (``tensor_parallel_plan``). First,
   because FSDP2 then shards the DTensor parameters along the other mesh dimension.
5. Activation checkpointing per ``stage.recompute``: full = every layer re-runs in backward, selective = only the
   attention core (softmax(QK^T)V), the part whose activations grow with the sequence (Korthikanti et al. 2022).
   Mixed precision per ``training.dtype``: bf16/fp16 matmuls under autocast, fp32 parameters and gradients; fp16
   adds dynamic loss scaling (``LossScaler``). A ZeRO-0 stage that does not recompute whole layers casts each weight
   once per step (``casts_once``): autocast's cast cache lives until the outermost autocast context exits, so one
   disabled context around the schedule keeps the 16-bit copies for every micro-batch instead of one per micro-batch
   in flight; under full recompute the per-forward casts are freed with the checkpointed layers, which holds less.
6. Data parallel inside the stage per ``zero_stage``: 0 -> one bucketed all-reduce of the gradients on the dp group
   after the schedule (not DDP: under torch.distributed.pipelining in torch 2.13, DDP's reducer asserts at step 2
   when micro-batches == stages, and with static_graph=True it returns wrong gradients; measured); 1/2 -> FSDP2
   ``fully_shard`` keeping parameters gathered between forward and backward (gradients and optimizer state sharded,
   ZeRO-2 memory, one all-gather per step); 3 -> FSDP2 resharding after forward (ZeRO-3; a whole-model stage
   also after each backward, with its gradients reduce-scattered per micro-batch: step 7).
   MoE layers (``runtime_adapters.moe``): with stage.ep > 1 each rank holds E / ep routed experts and tokens travel
   by all_to_all_single inside the stage's expert-parallel group; expert gradients are reduced over the
   expert-data-parallel group only (``runtime_adapters.expert_parallel``). EP runs with zero_stage 0.
7. ``Schedule1F1B`` (or GPipe where the plan asks) over the plan's micro-batches; gradients are averaged over
   micro-batches by the schedule and over replicas by the all-reduce/FSDP2, so one step equals one step of the
   whole model on the global batch. Interleaved 1F1B: one module and ``PipelineStage`` per plan chunk
   (``runtime_adapters.interleaved``). Stages with their own (tp, dp) grids: ``runtime_adapters.schedule`` runs
   1F1B/GPipe itself and re-splits each micro-batch's rows at stage boundaries (``runtime_adapters.stage_grid``);
   a whole-model ZeRO-3 stage runs there too, as plain gradient accumulation under FSDP2's defaults.
8. ``stage.offload``: the optimizer state and update on the host (``runtime_adapters.offload``).

Usage on a worker (``tangram-launch --plan plan.json train.py`` or torchrun)::

    ctx = TorchAdapter().setup(plan, plan.place(rank))
    loss = ctx.train_step(batch)   # batch: (global_batch, seq_len + 1) int64 tokens, the same on every rank
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from runtime_adapters.base import RuntimeAdapter, release_default_group
from runtime_adapters.expert_parallel import (ExpertGroups, bind_expert_parallel, build_expert_groups,
                                              expert_parameters, local_experts)
from runtime_adapters.gpt import StageModule, as_model_spec, lm_loss
from runtime_adapters.groups import StageGroups, build_stage_groups
from runtime_adapters.interleaved import (ChunkedStage, build_interleaved_schedule, chunk_key_map, chunk_problems,
                                         chunk_stages)
from runtime_adapters.model_source import BuiltinGPT, ModelSource
from runtime_adapters.offload import HostOffloadOptimizer
from runtime_adapters.schedule import GridSchedule
from runtime_adapters.stage_timing import StageTimer, timer_from_env
from tangram_launch.capabilities import TORCH, RuntimeCapabilities
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.plan import Place, Plan, Stage, tf32_matmuls_allowed
from tangram_launch.specs.model import ModelSpec

logger = logging.getLogger(__name__)

SCHEDULES = ("1F1B", "GPipe", "interleaved-1F1B")
COMPUTE_DTYPES = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # no fp8 path

# model_factory(spec, stage, seed) -> the stage's nn.Module (input tokens or hidden, output hidden or logits)
ModelFactory = Callable[[ModelSpec, Stage, int], nn.Module]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def default_model_factory(spec: ModelSpec, stage: Stage, seed: int) -> nn.Module:
    return BuiltinGPT().build_stage(spec, stage, seed)


def default_optimizer_factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    # foreach=False: one code path for plain and DTensor parameters, bitwise equal to the reference's.
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)


class TorchAdapter(RuntimeAdapter):
    """torch.distributed.pipelining with per-stage DP (DDP/FSDP2), TP (DTensor) and recompute."""

    name: ClassVar[str] = "torch"
    capabilities: ClassVar[RuntimeCapabilities] = TORCH

    def plan_problems(self, plan: Plan, *, model_source: ModelSource | None = None) -> list[str]:
        """The capability problems plus what this adapter's construction and the model source need (pure; no
        process group). ``model_source``: default the built-in GPT."""
        problems = super().plan_problems(plan)
        if plan.schedule not in SCHEDULES:
            problems.append(f"torch runs schedules {', '.join(SCHEDULES)} (plan has '{plan.schedule}')")
        return (problems + (model_source or BuiltinGPT()).plan_problems(plan) + _expert_parallel_problems(plan)
                + chunk_problems(plan) + _stage_grid_problems(plan))

    def setup(self, plan: Plan, place: Place | None = None, *, model_factory: ModelFactory | None = None,
              optimizer_factory: OptimizerFactory | None = None, seed: int = 0, device: torch.device | None = None,
              timeout_s: float = 600.0, model_source: ModelSource | None = None) -> "TorchTrainingContext":
        """Build this rank's part of the plan. Collective: every rank of the plan calls it with the same plan.

        Initialises the default process group from the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) when none
        exists; ``place`` defaults to ``plan.place(dist.get_rank())``. The stage's module comes from
        ``model_source`` (default: the built-in GPT) or, older form, ``model_factory(spec, stage, seed)``.
        """
        import torch.distributed as dist

        if model_source is not None and model_factory is not None:
            raise SpecError("give model_source or model_factory, not both", field="model_factory",
                            value="both given", valid="one of them")
        problems = self.plan_problems(plan, model_source=model_source)
        if problems:  # before any process group exists
            raise InfeasibleError(f"the {self.name} runtime cannot execute this plan", problems)
        if model_source is not None:
            model_factory = model_source.build_stage
            spec = ModelSpec.from_dict(plan.model, source="plan.model")  # the source judged it (plan_problems)
        else:
            spec = as_model_spec(plan.model, moe=True)
        owns_default_group = False
        if device is None:
            if torch.cuda.is_available():
                device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", place.local_gpu if place else 0)))
            else:
                device = torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
            owns_default_group = True
        if dist.get_world_size() != plan.world_size:
            raise SpecError("the job's world size differs from the plan's", field="world_size",
                            value=dist.get_world_size(), valid=str(plan.world_size))
        rank = dist.get_rank()
        if place is None:
            place = plan.place(rank)
        elif place.rank != rank:
            raise SpecError("place.rank differs from this process's rank", field="place.rank", value=place.rank,
                            valid=str(rank))
        groups = build_stage_groups(plan, rank, device_type=device.type, timeout_s=timeout_s)
        experts = build_expert_groups(plan, rank, timeout_s=timeout_s)  # None unless this stage has ep > 1
        stage = place.stage
        if plan.schedule == "interleaved-1F1B":  # one module per virtual stage, seen as one stage module
            module = ChunkedStage([(model_factory or default_model_factory)(spec, c, seed).to(device)
                                   for c in chunk_stages(plan, stage)])
        elif model_factory is None and experts is not None:
            module = StageModule(spec, stage.layers, has_embedding=stage.has_embedding, has_head=stage.has_head,
                                 seed=seed, experts=local_experts(spec, experts.ep_size, experts.ep_rank))
        else:
            module = (model_factory or default_model_factory)(spec, stage, seed)
        module = module.to(device)
        bind_expert_parallel(module, spec, experts)
        if spec.is_moe and hasattr(module, "set_moe_losses"):
            module.set_moe_losses(aux_loss_coeff=float(plan.training.get("moe_aux_loss_coeff", 0.01)),
                                  z_loss_coeff=float(plan.training.get("moe_z_loss_coeff", 0.001)))
        _apply_tensor_parallel(module, stage, groups)
        _apply_recompute(module, stage)
        dtype = COMPUTE_DTYPES[str(plan.training.get("dtype", "fp32"))]
        allow_tf32 = tf32_matmuls_allowed(plan, place)  # tf32 plans: per rank, from its stage's math mode
        if allow_tf32 is not None:  # a process-wide switch, so it is this rank's alone
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            torch.backends.cudnn.allow_tf32 = allow_tf32
        if dtype is not None:
            if not hasattr(module, "set_compute_dtype"):
                raise SpecError("a bf16/fp16 plan needs a module with set_compute_dtype(dtype)",
                                field="training.dtype", value=plan.training.get("dtype"))
            module.set_compute_dtype(dtype)
        scaler = LossScaler() if dtype == torch.float16 else None
        module, manual_dp = _apply_data_parallel(module, stage, groups, dtype)
        make_optimizer = optimizer_factory or default_optimizer_factory
        optimizer = (HostOffloadOptimizer(module.parameters(), make_optimizer) if stage.offload  # state on the host
                     else make_optimizer(list(module.parameters())))
        timed = list(getattr(module, "chunk_modules", None) or [module])  # an interleaved stage: each chunk
        timer = timer_from_env(timed, rank=rank, coords={"rank": rank, "stage": place.stage.index, **place.coords},
                               microbatches=plan.num_microbatches, device=device)
        schedule = _build_schedule(plan, place, module, groups, device, scaler, timer)
        last_src = min(r.rank for r in plan.rank_layout if r.stage == plan.num_stages - 1)
        logger.info("rank %d |PP=%d|DP=%d|TP=%d| layers %s embedding=%s head=%s zero=%d recompute=%s", rank,
                    place.coords["pp"], place.coords["dp"], place.coords["tp"], list(stage.layers),
                    stage.has_embedding, stage.has_head, stage.zero_stage, stage.recompute)
        return TorchTrainingContext(plan=plan, place=place, groups=groups, module=module, optimizer=optimizer,
                                    schedule=schedule, device=device, manual_dp=manual_dp, last_stage_src=last_src,
                                    owns_default_group=owns_default_group, scaler=scaler, experts=experts,
                                    timer=timer, casts_once=casts_once_per_step(stage, dtype))


def _expert_parallel_problems(plan: Plan) -> list[str]:
    """What expert parallelism needs of the model (pure; the ZeRO limit is a declared capability)."""
    out = []
    experts = int(plan.model.get("num_experts", 0) or 0)
    for s in plan.stages:
        if s.ep == 1:
            continue
        if not experts:
            out.append(f"stage {s.index}: ep={s.ep} needs an MoE model (model '{plan.model.get('name')}' is dense)")
        elif experts % s.ep:
            out.append(f"stage {s.index}: ep={s.ep} does not divide num_experts={experts}")
    return out


def _stage_grid_problems(plan: Plan) -> list[str]:
    """What the per-stage-grid executor (runtime_adapters/schedule.py) does not run (pure)."""
    if plan.topology.uniform_grid:
        return []
    out = []  # interleaved 1F1B: a declared capability (TORCH.interleaved_uniform_grid)
    if plan.model.get("num_experts"):
        out.append("stages with their own (tp, dp) grids run dense models only (MoE auxiliary losses are not "
                   "scaled across re-split micro-batches)")
    return out


def _apply_tensor_parallel(module: nn.Module, stage: Stage, groups: StageGroups) -> None:
    if stage.tp == 1:
        return
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan_fn = getattr(module, "tensor_parallel_plan", None)
    if plan_fn is None:
        raise SpecError("tp > 1 needs a module with tensor_parallel_plan() (submodule path -> colwise|rowwise)",
                        field=f"stages[{stage.index}].tp", value=stage.tp)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(module, groups.tp_mesh, {path: styles[kind]() for path, kind in plan_fn().items()})


def casts_once_per_step(stage: Stage, dtype: torch.dtype | None) -> bool:
    """Whether a stage keeps one 16-bit copy of its weights for the whole step (TorchTrainingContext.train_step).

    Autocast caches the cast of an fp32 leaf weight until the outermost autocast context exits; the stage's forward
    opens its own context per micro-batch, so each micro-batch casts again and autograd keeps that micro-batch's copy
    for its backward: 2 bytes per GEMM weight per micro-batch in flight. Inside one outer context (disabled: the
    backward runs outside autocast, as before) every micro-batch reads the first cast, the same values. Only where
    it holds less: ZeRO-0 stages (ZeRO 1-3 gather 16-bit parameters already, FSDP2's MixedPrecisionPolicy) that do
    not recompute whole layers (a checkpointed layer frees its casts after each forward; the cache would hold them
    all step). A stage without data parallelism is one: nothing wraps it (_apply_data_parallel). The cost model
    prices the same (costmodel/breakdown.py, RuntimeCapabilities.autocast_fp32_weights)."""
    return dtype is not None and (stage.zero_stage == 0 or stage.dp == 1) and stage.recompute != "full"


def _apply_recompute(module: nn.Module, stage: Stage) -> None:
    if stage.recompute == "none":
        return
    setter = getattr(module, "set_recompute", None)
    if setter is None:
        raise SpecError("recompute needs a module with set_recompute(mode)", field=f"stages[{stage.index}].recompute",
                        value=stage.recompute)
    setter(stage.recompute)


def _apply_data_parallel(module: nn.Module, stage: Stage, groups: StageGroups,
                         dtype: torch.dtype | None = None) -> tuple[nn.Module, bool]:
    """Wrap for data parallelism; returns (module, whether gradients need a manual all-reduce).

    A 16-bit plan's FSDP2 units gather their parameters in that dtype (MixedPrecisionPolicy; fp32 shards, gradients
    reduced in fp32), as torchtitan does. Autocast over gathered fp32 parameters would instead save a 16-bit copy of
    every weight for the backward, per micro-batch, which FSDP2's resharding does not free: ZeRO-3 would then hold
    2 bytes per parameter of the whole stage for each micro-batch in flight (tests/test_fsdp_mixed_precision.py)."""
    if isinstance(module, ChunkedStage):  # each chunk runs forward on its own: FSDP2 units per chunk
        manual = False
        for chunk in module.chunk_modules:
            _, manual = _apply_data_parallel(chunk, stage, groups, dtype)
        return module, manual
    if stage.dp == 1:
        if stage.zero_stage:
            logger.info("stage %d: dp=1, nothing to shard for zero_stage=%d", stage.index, stage.zero_stage)
        return module, False
    if stage.zero_stage == 0:
        return module, True
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = stage.zero_stage == 3
    policy = MixedPrecisionPolicy() if dtype is None else MixedPrecisionPolicy(param_dtype=dtype,
                                                                               reduce_dtype=torch.float32)
    blocks = getattr(module, "layers", None)
    if isinstance(blocks, nn.ModuleDict):  # one all-gather/reduce-scatter unit per layer (FSDP2's usual wrapping)
        for layer in blocks.values():
            fully_shard(layer, mesh=groups.dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(module, mesh=groups.dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return module, False


def _build_schedule(plan: Plan, place: Place, module: nn.Module, groups: StageGroups, device: torch.device,
                    scaler: "LossScaler | None", timer: StageTimer | None = None) -> Any:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    loss_fn = lm_loss if scaler is None else (lambda logits, targets: lm_loss(logits, targets) * scaler.scale)
    if timer is not None:  # the run report's last stage includes its loss, as the plan's head does
        loss_fn = timer.timed_loss(loss_fn)
    if groups.pp is None:  # stages with their own grids: rows re-split at every stage boundary
        # as torch.distributed.pipelining runs FSDP2: parameters stay gathered and gradients unsharded until the last
        # micro-batch's backward, then one reduce-scatter per unit (what the cost model prices for ZeRO 1-3 here)
        def sync(last: bool) -> None:
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(last)
                module.set_reshard_after_backward(last)

        return GridSchedule(plan=plan, place=place, module=module, device=device, loss_fn=loss_fn,
                            hidden_size=int(plan.model["hidden_size"]), before_backward=sync)
    if isinstance(module, ChunkedStage):
        return build_interleaved_schedule(plan, place.stage, module.chunk_modules, groups.pp, device, loss_fn)
    if plan.num_stages == 1 and place.stage.zero_stage == 3 and isinstance(module, FSDPModule):
        # a whole-model ZeRO-3 stage is not a pipeline: run its micro-batches under FSDP2's defaults, each backward
        # resharding and reduce-scattering its gradients, so the rank holds a shard between units (ZeRO-3 memory,
        # per micro-batch gathers and reduce-scatters: what the cost model prices); a one-stage PipelineStage
        # would keep every parameter gathered and every gradient unsharded until the last backward
        return GridSchedule(plan=plan, place=place, module=module, device=device, loss_fn=loss_fn,
                            hidden_size=int(plan.model["hidden_size"]))
    pipe_stage = PipelineStage(module, place.stage.index, plan.num_stages, device, group=groups.pp)
    cls = Schedule1F1B if plan.schedule == "1F1B" else ScheduleGPipe
    return cls(pipe_stage, n_microbatches=plan.num_microbatches, loss_fn=loss_fn)


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018): the schedule's loss is multiplied by ``scale``;
    before the step, gradients are unscaled and, if any rank saw inf/nan, every rank skips the step (a world
    all-reduce, since stages must agree) and the scale halves; it doubles after ``growth_interval`` good steps."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale, self.growth_interval, self._good = scale, growth_interval, 0

    def unscale_and_check(self, params: list[nn.Parameter], device: torch.device) -> bool:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        bad = torch.zeros((), device=device)
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                g.mul_(1.0 / self.scale)
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        ok = bool(bad.item() == 0)
        if ok:
            self._good += 1
            if self._good % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale /= 2.0
            self._good = 0
        return ok


@dataclass
class TorchTrainingContext:
    """One rank's running part of a plan: its module, optimizer, groups and the pipeline schedule."""

    plan: Plan
    place: Place
    groups: StageGroups
    module: nn.Module
    optimizer: torch.optim.Optimizer | HostOffloadOptimizer
    schedule: Any
    device: torch.device
    manual_dp: bool
    last_stage_src: int
    owns_default_group: bool = False
    scaler: LossScaler | None = None  # fp16 plans only
    experts: ExpertGroups | None = None  # this rank's expert-parallel groups (stage.ep > 1 only)
    timer: StageTimer | None = None  # per-step stage timings for the run report (launched with a run directory)
    steps_done: int = 0
    casts_once: bool = False  # 16-bit weights cast once per step (casts_once_per_step), not once per micro-batch
    flat_buckets: "FlatBuckets" = field(default_factory=lambda: FlatBuckets())  # ZeRO 0's gradient all-reduce

    @property
    def is_last_stage(self) -> bool:
        return self.place.is_last_stage

    def replica_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a global batch: replica d takes rows [d*n, (d+1)*n), n = micro_batch*microbatches."""
        stage = self.place.stage
        n = stage.micro_batch_size * self.plan.num_microbatches
        if batch.shape[0] != n * stage.dp:
            raise SpecError("a batch has global_batch rows", field="batch.shape[0]", value=batch.shape[0],
                            valid=str(n * stage.dp))
        d = self.place.coords["dp"]
        return batch[d * n:(d + 1) * n]

    def train_step(self, batch: torch.Tensor) -> float:
        """One iteration on a global batch (global_batch, seq_len + 1) of tokens; returns the mean loss on every rank.

        Collective over the world (the loss is broadcast from the last stage).
        """
        import torch.distributed as dist

        if self.timer is not None:
            self.timer.start_step()
        losses: list[torch.Tensor] = []
        first, last = self.place.is_first_stage, self.place.is_last_stage
        # MoE auxiliary losses join backward at the factor the schedule's loss is multiplied by: the fp16 loss scale,
        # and 1 / micro-batches where the schedule divides each loss before its backward (GridSchedule; torch's
        # schedules divide the gradients after the last backward instead, which covers the auxiliary losses too)
        factor = 1.0 if self.scaler is None else self.scaler.scale
        if isinstance(self.schedule, GridSchedule):
            factor /= self.plan.num_microbatches
        for m in getattr(self.module, "moe_layers", list)():
            m.aux_grad_scale = factor
        # casts_once_per_step: the cast cache lives as long as this context (cleared before the optimizer step)
        with torch.autocast(self.device.type, enabled=False) if self.casts_once else contextlib.nullcontext():
            if isinstance(self.schedule, GridSchedule):  # per-stage grids: the executor picks each replica's rows
                losses = self.schedule.step(batch)
            elif first and last:
                rows = self.replica_rows(batch).to(self.device)
                self.schedule.step(rows[:, :-1].contiguous(), target=rows[:, 1:].contiguous(), losses=losses)
            elif first:
                self.schedule.step(self.replica_rows(batch)[:, :-1].contiguous().to(self.device))
            elif last:
                self.schedule.step(target=self.replica_rows(batch)[:, 1:].contiguous().to(self.device),
                                   losses=losses)
            else:
                self.schedule.step()
        if self.manual_dp:
            self._all_reduce_grads()
        loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is None or self.scaler.unscale_and_check(list(self.module.parameters()), self.device):
            if self.timer is not None:
                self.timer.optimizer_begins()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.timer is not None:
            self.timer.optimizer_ends()
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if last:
            loss = torch.stack([x.detach().float() for x in losses]).mean() / loss_scale
            if self.place.stage.dp > 1:
                dist.all_reduce(loss, group=self.groups.dp)
                loss /= self.place.stage.dp
        dist.broadcast(loss, src=self.last_stage_src)
        value = float(loss.item())
        self.steps_done += 1
        if self.timer is not None:
            self.timer.end_step(self.steps_done)
        return value

    def _all_reduce_grads(self) -> None:
        """Average gradients over the stage's replicas (local shards under TP); under expert parallelism the routed
        experts' gradients are summed over the expert-data-parallel group and divided by dp instead."""
        from torch.distributed.tensor import DTensor

        sharded = {id(p) for p in expert_parameters(self.module)} if self.experts is not None else set()
        params = list(self.module.parameters())
        for p in params:  # every replica must send the same buckets, even for a parameter that got no gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if id(p) not in sharded]
        _bucketed_all_reduce(grads, self.groups.dp, self.place.stage.dp, self.flat_buckets)
        if self.experts is not None:
            grads = [p.grad for p in params if id(p) in sharded]
            _bucketed_all_reduce(grads, self.experts.edp if len(self.experts.edp_ranks) > 1 else None,
                                 self.experts.replicas, self.flat_buckets)

    def moe_stats(self, *, reset: bool = True) -> dict[str, float] | None:
        """Routing figures of the whole model since the last reset (collective over the world; None for a dense
        model): share of routed assignments dropped by capacity, and the busiest expert's load over the mean load
        (max over MoE layers; 1.0 = balanced), counted once per token (tensor-parallel peers route alike).

        The first step's figures include the pipeline's shape-inference pass; reset after it for clean ones."""
        import torch.distributed as dist

        spec = as_model_spec(self.plan.model, moe=True)
        if not spec.is_moe:
            return None
        load = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64)  # (L, E) kept assignments
        routed_dropped = torch.zeros(2, dtype=torch.float64)
        layers = getattr(self.module, "moe_layers", list)()
        if self.place.coords["tp"] == 0:
            for key, layer in getattr(self.module, "layers", {}).items():
                m = layer.mlp
                if m in layers and m.stats.expert_load is not None:
                    load[int(key)] += m.stats.expert_load.double()
                    routed_dropped += torch.tensor([m.stats.routed, m.stats.dropped], dtype=torch.float64)
        if reset:
            for m in layers:
                m.stats.reset()
        load, routed_dropped = load.to(self.device), routed_dropped.to(self.device)  # NCCL reduces no CPU tensor
        dist.all_reduce(load)
        dist.all_reduce(routed_dropped)
        load = load.cpu()
        used = load[load.sum(dim=1) > 0]  # (moe layers, E)
        imbalance = float((used.max(dim=1).values / used.mean(dim=1)).max()) if len(used) else 1.0
        routed, dropped = routed_dropped.tolist()
        return {"routed": routed, "dropped": dropped, "dropped_fraction": dropped / routed if routed else 0.0,
                "expert_load_max_over_mean": imbalance}

    def checkpoint_state(self) -> Any:
        """This rank's ``tangram_launch.checkpoint.StageState`` (live tensors and optimizer under global names), for
        ``save_checkpoint``/``load_checkpoint``; the same call under any schedule, grid or chunk layout."""
        from tangram_launch.checkpoint import LayerKeyMap, StageState

        stage = self.place.stage
        key_map = (chunk_key_map(self.plan, stage) if isinstance(self.module, ChunkedStage)
                   else LayerKeyMap.for_stage(stage, local_numbering="global"))
        state = StageState.from_module(self.module, key_map, None)
        if isinstance(self.optimizer, HostOffloadOptimizer):  # the optimizer's parameters are the host copies
            names = {id(p): n for p, n in state.param_names.items()}
            host = {hp: names[id(p)] for hp, p in self.optimizer.host_params.items()}
            return StageState(model=state.model, optimizer=self.optimizer, param_names=host)  # type: ignore[arg-type]
        return StageState(model=state.model, optimizer=self.optimizer, param_names=state.param_names)

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters, unsharded, named by global layer index (collective over the stage's ranks)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, p in self.module.named_parameters():
            name = name.removeprefix("module.")
            value = p.full_tensor() if isinstance(p, DTensor) else p
            out[name] = value.detach().cpu().clone()
        return out

    def close(self) -> None:
        release_default_group(self.owns_default_group)


def _bucketed_all_reduce(grads: list[torch.Tensor], group: Any, divisor: int, buckets: "FlatBuckets") -> None:
    """Sum ``grads`` over ``group`` and divide by ``divisor``, through ``buckets`` (None: this rank alone, each
    gradient divided where it lives)."""
    import torch.distributed as dist

    if group is None:
        for g in grads:
            g.div_(divisor)
        return
    buckets.reduce(grads, lambda flat: dist.all_reduce(flat, group=group), divisor)


class FlatBuckets:
    """Gradients copied into flat buckets of about ``bucket_bytes``, each reduced in place, divided and copied back:
    three read-write passes over every gradient beside the reduction, which the cost model prices
    (RuntimeCapabilities.dp_flat_buckets). On a CPU the buckets go through one buffer per dtype, kept across steps:
    a fresh one each step pays the host allocator's page faults wherever it maps a bucket anew (glibc, buckets of
    MiBs: 2.5x the copies' time). A GPU's caching allocator reuses a freed bucket's block without faults, and a
    buffer kept there would hold that memory through the next step's backward."""

    def __init__(self, bucket_bytes: int = 25 * 2**20) -> None:
        self.bucket_bytes = bucket_bytes
        self.buffers: dict[torch.dtype, torch.Tensor] = {}  # CPU only

    def reduce(self, grads: list[torch.Tensor], reduce: Callable[[torch.Tensor], Any], divisor: int) -> None:
        bucket: list[torch.Tensor] = []
        size = 0
        for i, g in enumerate(grads):
            bucket.append(g)
            size += g.numel() * g.element_size()
            last = i == len(grads) - 1
            if size >= self.bucket_bytes or last or grads[i + 1].dtype != g.dtype:
                flat = self._buffer(bucket)
                torch.cat([x.reshape(-1) for x in bucket], out=flat)
                reduce(flat)
                flat.div_(divisor)
                offset = 0
                for x in bucket:
                    x.copy_(flat[offset:offset + x.numel()].view_as(x))
                    offset += x.numel()
                bucket, size = [], 0

    def _buffer(self, bucket: list[torch.Tensor]) -> torch.Tensor:
        """A flat tensor for the bucket: on a CPU the first elements of its dtype's buffer, grown to the largest
        bucket seen; elsewhere a fresh one."""
        numel = sum(x.numel() for x in bucket)
        dtype, device = bucket[0].dtype, bucket[0].device
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buf[:numel]
