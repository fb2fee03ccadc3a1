"""Megatron-core (0.16.1) adapter: a Plan and a worker's Place become Megatron's parallel state, configs and model.

Two halves, kept apart on purpose:

* **Pure translation** (``plan -> dict``, no Megatron import, no process group): :func:`parallel_state_kwargs`,
  :func:`pipeline_layout`, :func:`transformer_config_kwargs`, :func:`gpt_model_kwargs`, :func:`ddp_config_kwargs`,
  :func:`optimizer_config_kwargs`, :func:`schedule_kwargs` and :func:`megatron_plan_problems`. Their dicts are the
  keyword arguments of Megatron's own constructors, so tests build the real ``TransformerConfig`` from them.
* **Effects** (:class:`MegatronAdapter`): refuse a plan before any process group exists, call
  ``parallel_state.initialize_model_parallel`` and check that the groups Megatron built are the plan's, build the
  ``TransformerConfig`` and the ``GPTModel`` of this worker's stage.

Rank order. The plan numbers ranks stage by stage, and inside a stage tp fastest, then cp, then dp
(``rank = tp + TP*(cp + CP*(dp + DP*pp))``). Megatron's ``RankGenerator`` with ``order="tp-cp-ep-dp-pp"`` numbers
``rank = tp + TP*(cp + CP*(dp + DP*pp))`` too (ep is 1 in the dense generator), so plan rank r *is* Megatron rank r
and each pipeline stage's GPUs are the plan's island. :meth:`MegatronAdapter.initialize` asserts it, group by group.

What Megatron-core cannot run, beyond ``capabilities.MEGATRON`` (one (tp, dp, cp) grid): a different EP size or ZeRO
stage per stage (one expert grid, one optimizer), schedules other than 1F1B, and some model features (see
:func:`megatron_plan_problems`). Recompute *can* differ per stage: each pipeline rank builds its own config.

Megatron's forward/backward needs CUDA as shipped (``torch.cuda.current_device()``, a CUDA RNG tracker): on a CPU
machine everything here runs except the training step itself.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from runtime_adapters.base import RuntimeAdapter
from tangram_launch import worker as W
from tangram_launch.capabilities import MEGATRON
from tangram_launch.errors import InfeasibleError, SpecError, TangramError
from tangram_launch.plan import Place, Plan, Stage, tf32_matmuls_allowed
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

logger = logging.getLogger(__name__)

MEGATRON_VERSION = "0.16.1"  # the version these translations are written and tested against
# Pipeline outermost, tp fastest: the plan's own rank numbering (see the module docstring).
RANK_ORDER = "tp-cp-ep-dp-pp"
# forward_backward_pipelining_without_interleaving / _with_interleaving (virtual_pipeline_model_parallel_size);
# no GPipe in Megatron-core
SCHEDULES = ("1F1B", "INTERLEAVED-1F1B")
VOCAB_MULTIPLE = 128  # Megatron-LM's --make-vocab-size-divisible-by default (padded once more by tp)
DROPOUT_RATE = 0.1  # GPT-2 / GPT-3 / OPT: resid_pdrop, embd_pdrop and attn_pdrop (ModelSpec.dropout)

# Storage dtype per training dtype: tf32 keeps fp32 parameters (TF32 is a matmul mode, switched on in
# tf32_matmuls), fp8 keeps bf16 parameters and runs the GEMMs in FP8 through Transformer Engine (fp8="hybrid").
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32,
           "fp8": torch.bfloat16}
_ACTIVATIONS = {  # ffn_type -> (activation, gated linear unit)
    "gelu": (F.gelu, False),
    "relu": (F.relu, False),
    "swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
}
_NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
_POSITIONS = {"learned": "learned_absolute", "rotary": "rope", "none": "none"}  # no ALiBi in Megatron-core


# ----------------------------------------------------------------------------------------------- pure translation
def _model(plan: Plan) -> ModelSpec:
    return ModelSpec.from_dict(plan.model)


def _training(plan: Plan) -> TrainingSpec:
    return TrainingSpec.from_dict(plan.training)


def _grid(plan: Plan) -> Stage:
    """Stage 0 stands for the one (tp, dp, cp, ep) grid Megatron runs; callers check uniformity first."""
    return plan.stages[0]


def megatron_plan_problems(plan: Plan) -> list[str]:
    """What stops Megatron-core from running this plan beyond the generic capability checks (empty: it can).

    Model-dependent limits live here rather than in ``RuntimeCapabilities`` because capabilities are model-agnostic.
    """
    out: list[str] = []
    stages = plan.stages
    if len({s.micro_batch_size for s in stages}) > 1:
        out.append("megatron's schedule passes one micro-batch shape between stages; plan has micro_batch_size "
                   f"{sorted({s.micro_batch_size for s in stages})}")
    if plan.num_stages > 1 and plan.schedule.upper() not in SCHEDULES:
        out.append(f"megatron runs the {', '.join(SCHEDULES)} pipeline schedule, not '{plan.schedule}'")
    for s in stages:
        want = (s.index == 0, s.index == plan.num_stages - 1)
        if (s.has_embedding, s.has_head) != want:
            out.append(f"stage {s.index}: megatron puts the embedding on the first stage and the loss on the last "
                       f"only (has_embedding={s.has_embedding}, has_head={s.has_head})")

    model, training = _model(plan), _training(plan)
    g = _grid(plan)
    tp, cp, ep = g.tp, g.cp, g.ep
    if model.num_heads % tp:
        out.append(f"tp={tp} must divide num_heads={model.num_heads} (Megatron splits attention by heads)")
    if model.num_kv_heads % tp:
        out.append(f"tp={tp} must divide num_kv_heads={model.num_kv_heads} (Megatron splits query groups by tp)")
    if model.ffn_hidden_size % tp:
        out.append(f"tp={tp} must divide ffn_hidden_size={model.ffn_hidden_size}")
    if tp > 1 and training.seq_len % tp:
        out.append(f"sequence parallelism needs seq_len={training.seq_len} divisible by tp={tp}")
    if cp > 1 and training.seq_len % (2 * cp):
        out.append(f"context parallelism needs seq_len={training.seq_len} divisible by 2*cp={2 * cp} "
                   "(load-balanced causal chunks)")
    if model.position_embedding not in _POSITIONS:
        out.append(f"megatron's GPTModel has no '{model.position_embedding}' position embedding "
                   f"(has: {', '.join(_POSITIONS)})")
    if model.position_embedding == "learned" and training.seq_len > model.num_position_embeddings:
        out.append(f"seq_len={training.seq_len} exceeds the learned position table "
                   f"({model.num_position_embeddings} rows)")
    if model.embedding_dim != model.hidden_size:
        out.append(f"megatron's GPTModel has no projected embedding (embedding_dim={model.embedding_dim} != "
                   f"hidden_size={model.hidden_size})")
    if not model.final_norm:
        out.append("megatron's GPTModel always applies a final norm (model has final_norm=false)")
    if model.is_moe:
        if model.num_experts % ep:
            out.append(f"ep={ep} must divide num_experts={model.num_experts}")
        if model.expert_ffn_hidden_size % tp:
            out.append(f"tp={tp} must divide expert_ffn_hidden_size={model.expert_ffn_hidden_size}")
        if model.linear_bias and tp > 1:
            out.append("megatron-core supports biases in MoE experts only with expert tensor parallel size 1; "
                       f"this plan has tp={tp} and a model with linear biases")
        if model.router_bias:
            out.append("megatron-core's router has no bias (model has router_bias=true)")
        if model.router_type == "gshard_top2":
            out.append("megatron-core's load-balancing loss counts every top-k choice, not GShard's first choices "
                       "(model has router_type=gshard_top2; softmax_topk runs)")
    elif ep > 1:
        out.append(f"ep={ep} needs an MoE model (model '{model.name}' is dense)")
    return out


def parallel_state_kwargs(plan: Plan, *, distributed_timeout_minutes: int = 30,
                          create_gloo_process_groups: bool = True) -> dict[str, Any]:
    """Keyword arguments of ``parallel_state.initialize_model_parallel`` for this plan (data parallel is implied)."""
    g = _grid(plan)
    return {
        "tensor_model_parallel_size": g.tp,
        "pipeline_model_parallel_size": plan.num_stages,
        # interleaved 1F1B only (plain plans keep the call as it was)
        **({"virtual_pipeline_model_parallel_size": plan.virtual_stages} if plan.virtual_stages > 1 else {}),
        "context_parallel_size": g.cp,
        "expert_model_parallel_size": g.ep,
        "expert_tensor_parallel_size": g.tp,
        "order": RANK_ORDER,
        "distributed_timeout_minutes": int(distributed_timeout_minutes),
        "create_gloo_process_groups": create_gloo_process_groups,
    }


def pipeline_layout(plan: Plan) -> str | None:
    """Megatron's ``pipeline_model_parallel_layout``: 'E' embedding, 't' one transformer layer, 'L' loss, '|' stage.

    Any split is expressible (3+1 layers on two stages: ``"Ettt|tL"``); None without pipelining. Interleaved 1F1B:
    one segment per model chunk, chunk-major ((stage 0, chunk 0), (stage 1, chunk 0), ..., (stage 0, chunk 1), ...),
    which is the order Megatron-core reads virtual stages in (it derives v from the segment count).
    """
    if plan.num_stages == 1:
        return None
    v = plan.virtual_stages
    if v > 1:
        return "|".join(("E" if s.has_embedding and j == 0 else "") + "t" * (s.chunks[j][1] - s.chunks[j][0])
                        + ("L" if s.has_head and j == v - 1 else "")
                        for j in range(v) for s in plan.stages)
    parts = []
    for s in plan.stages:
        parts.append(("E" if s.has_embedding else "") + "t" * s.num_layers + ("L" if s.has_head else ""))
    return "|".join(parts)


def recompute_kwargs(mode: str) -> dict[str, Any]:
    """Plan recompute mode -> Megatron fields. 'full' recomputes every layer (uniform chunks of one layer)."""
    if mode == "none":
        return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    if mode == "selective":  # core attention only (Korthikanti et al. 2022, "Reducing activation recomputation")
        return {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise SpecError("unknown recompute mode", field="recompute", value=mode, valid="none, selective, full")


def dropout_kwargs(model: ModelSpec) -> dict[str, float]:
    """The model's dropout as Megatron's two rates: on the hidden states (after the embedding, the attention's
    output projection and the MLP) and on the attention probabilities. GPT-2/3 and OPT train at 0.1 on both
    (ModelSpec.dropout); Megatron-core's TransformerConfig defaults to 0.1 whatever the model."""
    rate = DROPOUT_RATE if model.dropout else 0.0
    return {"hidden_dropout": rate, "attention_dropout": rate}


def dtype_kwargs(dtype: str) -> dict[str, Any]:
    """Training dtype -> Megatron's precision flags (parameters, pipeline p2p buffers)."""
    if dtype not in _DTYPES:
        raise SpecError("unknown dtype", field="training.dtype", value=dtype, valid=", ".join(_DTYPES))
    torch_dtype = _DTYPES[dtype]
    out = {"bf16": dtype in ("bf16", "fp8"), "fp16": dtype == "fp16", "params_dtype": torch_dtype,
           "pipeline_dtype": torch_dtype}
    if dtype == "fp8":  # E4M3 forward, E5M2 gradients (Transformer Engine's hybrid format); needs TE layers
        out["fp8"] = "hybrid"
    return out


def tf32_matmuls(plan: Plan, place: Place) -> None:
    """tf32 plans: let this rank's fp32 matmuls and convolutions use TF32 tensor cores unless its stage runs strict
    FP32 (a process-wide torch switch, so per rank; Megatron-core has no config field for it)."""
    allow = tf32_matmuls_allowed(plan, place)
    if allow is not None:
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow


def moe_kwargs(model: ModelSpec, ep: int) -> dict[str, Any]:
    """MoE fields; the layer pattern is explicit because Megatron's integer ``moe_layer_freq=k`` makes layers
    0, k, 2k.. MoE while ours (GShard, HF ``decoder_sparse_step``) makes layers k-1, 2k-1.. MoE. Tokens travel by
    all-to-all across expert-parallel ranks (Megatron-LM's advice for EP), by all-gather without EP."""
    if not model.is_moe:
        return {}
    out: dict[str, Any] = {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.top_k,
        "moe_ffn_hidden_size": model.expert_ffn_hidden_size,
        "moe_layer_freq": [1 if model.is_moe_layer(i) else 0 for i in range(model.num_layers)],
        "moe_token_dispatcher_type": "alltoall" if ep > 1 else "allgather",
        "moe_router_load_balancing_type": "aux_loss",
    }
    if model.top_k == 1 or not model.router_norm_topk:
        # softmax over all experts, then the top k (not renormalised); Megatron's default softmax over the k chosen
        # logits equals renormalised weights, and over one expert has zero gradient (Megatron insists on this for k=1)
        out["moe_router_pre_softmax"] = True
    if model.capacity_factor is not None:  # per expert and routed token group; Megatron drops by probability
        out["moe_expert_capacity_factor"] = model.capacity_factor
    if model.num_shared_experts:
        out["moe_shared_expert_intermediate_size"] = model.num_shared_experts * model.shared_expert_ffn_hidden_size
        out["moe_shared_expert_gate"] = model.shared_expert_gate
    return out


def transformer_config_kwargs(plan: Plan, stage_index: int, *, sequence_parallel: bool | None = None) -> dict:
    """``TransformerConfig(**kwargs)`` for the ranks of one stage.

    ``sequence_parallel`` defaults to tp > 1 (Korthikanti et al. 2022); pass False where the norm implementation
    cannot run it (Megatron's torch-norm fallback, used without Transformer Engine or Apex).
    """
    if not 0 <= stage_index < plan.num_stages:
        raise SpecError("stage outside the plan", field="stage_index", value=stage_index,
                        valid=f"0..{plan.num_stages - 1}")
    model, training = _model(plan), _training(plan)
    g, stage = _grid(plan), plan.stages[stage_index]
    activation, gated = _ACTIVATIONS[model.ffn_type]
    kw: dict[str, Any] = {
        # model shape
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_heads,
        "num_query_groups": model.num_kv_heads,
        "kv_channels": model.head_dim,
        "ffn_hidden_size": model.ffn_hidden_size,
        "activation_func": activation,
        "gated_linear_unit": gated,
        "normalization": _NORMS[model.norm_type],
        "qk_layernorm": model.qk_norm,
        "add_bias_linear": model.linear_bias,
        "add_qkv_bias": model.linear_bias or model.qkv_bias,
        # the spec's dropout, not TransformerConfig's default of 0.1 for every model: a Llama-style model trains
        # without it, and the planner priced its masks (or none) from the spec
        **dropout_kwargs(model),
        # parallelism: the plan's grid
        "tensor_model_parallel_size": g.tp,
        "pipeline_model_parallel_size": plan.num_stages,
        "context_parallel_size": g.cp,
        "expert_model_parallel_size": g.ep,
        "expert_tensor_parallel_size": g.tp,
        "sequence_parallel": (g.tp > 1) if sequence_parallel is None else bool(sequence_parallel and g.tp > 1),
        "pipeline_model_parallel_layout": pipeline_layout(plan),
        "virtual_pipeline_model_parallel_size": plan.virtual_stages if plan.virtual_stages > 1 else None,
        "deallocate_pipeline_outputs": plan.num_stages > 1,
        # gradients are accumulated in fp32 main grads by Megatron's DDP; see ddp_config_kwargs
    }
    kw.update(dtype_kwargs(training.dtype))
    kw.update(recompute_kwargs(stage.recompute))
    kw.update(moe_kwargs(model, g.ep))
    if model.is_moe:
        kw.update(moe_aux_loss_coeff=training.moe_aux_loss_coeff, moe_z_loss_coeff=training.moe_z_loss_coeff)
    return kw


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Megatron splits the embedding rows over tp: pad the vocabulary to a multiple of ``multiple * tp``."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def gpt_model_kwargs(plan: Plan, place: Place, vp_stage: int | None = None) -> dict[str, Any]:
    """``GPTModel`` arguments besides ``config`` and ``transformer_layer_spec`` for this worker's stage (interleaved
    1F1B: for its model chunk ``vp_stage``; the embedding is on the first chunk, the loss on the last)."""
    model, training = _model(plan), _training(plan)
    max_len = max(model.max_seq_len, training.seq_len, model.num_position_embeddings or 0)
    v = plan.virtual_stages
    first = vp_stage is None or vp_stage == 0
    last = vp_stage is None or vp_stage == v - 1
    out = {"vp_stage": vp_stage} if vp_stage is not None else {}
    return {
        **out,
        "vocab_size": padded_vocab_size(model.vocab_size, place.stage.tp),
        "max_sequence_length": max_len,
        "pre_process": place.stage.has_embedding and first,
        "post_process": place.stage.has_head and last,
        "share_embeddings_and_output_weights": model.tied_embeddings,
        "position_embedding_type": _POSITIONS.get(model.position_embedding, "none"),
    }


def ddp_config_kwargs(plan: Plan) -> dict[str, Any]:
    """``DistributedDataParallelConfig``: ZeRO-1 is Megatron's distributed optimizer (optimizer state sharded over
    the dp x cp group, gradients reduce-scattered into it)."""
    training = _training(plan)
    return {
        "use_distributed_optimizer": _grid(plan).zero_stage >= 1,
        "grad_reduce_in_fp32": training.grad_dtype == "fp32",
        "overlap_grad_reduce": False,
        "overlap_param_gather": False,
    }


def optimizer_config_kwargs(plan: Plan, *, lr: float, weight_decay: float = 0.01, clip_grad: float = 1.0) -> dict:
    """``OptimizerConfig`` (Megatron's 'adam' is decoupled-weight-decay AdamW)."""
    training = _training(plan)
    precision = dtype_kwargs(training.dtype)
    return {
        "optimizer": "sgd" if training.optimizer == "sgd" else "adam",
        "lr": float(lr),
        "weight_decay": float(weight_decay),
        "clip_grad": float(clip_grad),
        "bf16": precision["bf16"],
        "fp16": precision["fp16"],
        "params_dtype": precision["params_dtype"],
        "use_distributed_optimizer": _grid(plan).zero_stage >= 1,
    }


def schedule_kwargs(plan: Plan) -> dict[str, int]:
    """Arguments of the function ``get_forward_backward_func()`` returns (per iteration)."""
    training = _training(plan)
    g = _grid(plan)
    return {
        "num_microbatches": plan.num_microbatches,
        "micro_batch_size": g.micro_batch_size,
        "seq_length": training.seq_len,
    }


# ------------------------------------------------------------------------------------------------------- effects
@dataclass(frozen=True)
class MegatronGroups:
    """The global ranks of this worker's groups as Megatron built them (compared with the Place)."""

    rank: int
    tp: tuple[int, ...]
    cp: tuple[int, ...]
    dp: tuple[int, ...]
    pp: tuple[int, ...]
    ep: tuple[int, ...]
    coords: Mapping[str, int]  # pp, dp, cp, tp as Megatron reports them

    def mismatches(self, place: Place) -> list[str]:
        """Where Megatron's groups differ from the plan's (empty when they agree)."""
        out = []
        for name, mine, theirs in (("tp", self.tp, place.tp_group), ("cp", self.cp, place.cp_group),
                                   ("dp", self.dp, place.dp_group), ("pp", self.pp, place.pp_group)):
            if tuple(mine) != tuple(theirs or ()):
                out.append(f"{name} group: megatron {list(mine)} != plan {list(theirs or ())}")
        if dict(self.coords) != dict(place.coords):
            out.append(f"coordinates: megatron {dict(self.coords)} != plan {dict(place.coords)}")
        return out


def expert_group(plan: Plan, rank: int) -> tuple[int, ...]:
    """The expert-parallel group of ``rank`` under RANK_ORDER: ep consecutive (cp, dp) positions of one stage."""
    return plan.topology.ep_group(rank)


@dataclass
class MegatronTrainingContext:
    """One rank's Megatron parallel state for a plan (what ``MegatronAdapter.setup`` returns)."""

    plan: Plan
    place: Place
    groups: MegatronGroups
    owns_default_group: bool = False

    def close(self) -> None:
        """Tear down Megatron's parallel state (and the default group when setup created it)."""
        import torch.distributed as dist

        MegatronAdapter.destroy()
        if self.owns_default_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


class MegatronAdapter(RuntimeAdapter):
    """Run a Plan on Megatron-core: one process grid, any layer layout, ZeRO <= 1 (distributed optimizer)."""

    name = "megatron"
    capabilities = MEGATRON

    # --- checks (no process group) ---------------------------------------------------------------------------
    def plan_problems(self, plan: Plan) -> list[str]:
        problems = super().plan_problems(plan)
        problems.extend(megatron_plan_problems(plan))
        return problems

    # --- parallel state ------------------------------------------------------------------------------------
    def setup(self, plan: Plan, place: Place | None = None, *, timeout_s: float = 1800.0,
              create_gloo_process_groups: bool = True) -> "MegatronTrainingContext":
        """The adapters' one protocol: check the plan, start the default process group when none exists (nccl on a
        GPU, gloo otherwise; rank and world size from the plan), build Megatron's parallel state for the plan.

        The model and optimizer are Megatron's own objects (``transformer_config``, ``build_gpt_model``,
        ``ddp_config_kwargs``, ``optimizer_config_kwargs``): the context carries the groups they are built on.
        """
        self.check_plan(plan)
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        owns_default_group = False
        if not dist.is_initialized():
            rank = place.rank if place is not None else int(os.environ.get("RANK", "0"))
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank,
                                    world_size=plan.world_size, timeout=timeout)
            owns_default_group = True
        place = place or plan.place(dist.get_rank())
        groups = self.initialize(plan, place, timeout=timeout, create_gloo_process_groups=create_gloo_process_groups)
        return MegatronTrainingContext(plan=plan, place=place, groups=groups, owns_default_group=owns_default_group)

    def initialize(self, plan: Plan, place: Place, *, timeout: timedelta = timedelta(minutes=30),
                   create_gloo_process_groups: bool = True) -> MegatronGroups:
        """Check the plan, then build Megatron's model-parallel state for it; returns the groups as built.

        Needs ``torch.distributed`` initialised with the plan's world size and this worker's plan rank (the
        launcher remaps RANK to the plan's layout). Raises TangramError if Megatron's groups are not the plan's.
        """
        self.check_plan(plan)
        import torch.distributed as dist

        if not dist.is_initialized():
            raise TangramError("torch.distributed must be initialised before the megatron adapter "
                               "(init_process_group with the plan's world size)")
        if dist.get_world_size() != plan.world_size or dist.get_rank() != place.rank:
            raise TangramError(f"this process is rank {dist.get_rank()} of {dist.get_world_size()}, but the plan "
                               f"places rank {place.rank} of {plan.world_size}: start workers with tangram-launch "
                               "--plan so RANK follows the plan's rank layout")
        from megatron.core import parallel_state

        minutes = max(1, int(-(-timeout.total_seconds() // 60)))  # Megatron takes whole minutes
        kwargs = parallel_state_kwargs(plan, distributed_timeout_minutes=minutes,
                                       create_gloo_process_groups=create_gloo_process_groups)
        parallel_state.initialize_model_parallel(**kwargs)
        groups = self.current_groups()
        bad = groups.mismatches(place)
        if place.stage.ep > 1 and groups.ep != expert_group(plan, place.rank):
            bad.append(f"ep group: megatron {list(groups.ep)} != plan {list(expert_group(plan, place.rank))}")
        if bad:
            parallel_state.destroy_model_parallel()
            raise TangramError(f"megatron-core {MEGATRON_VERSION} built groups that differ from the plan's on rank "
                               f"{place.rank}: " + "; ".join(bad))
        logger.info("|PP=%d|DP=%d|CP=%d|TP=%d| megatron parallel state ready (layout %s)", place.coords["pp"],
                    place.coords["dp"], place.coords["cp"], place.coords["tp"], pipeline_layout(plan))
        return groups

    @staticmethod
    def current_groups() -> MegatronGroups:
        """Read back the groups from Megatron's parallel_state (after initialize_model_parallel)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        def ranks(group) -> tuple[int, ...]:
            return tuple(dist.get_process_group_ranks(group))

        return MegatronGroups(
            rank=dist.get_rank(),
            tp=ranks(ps.get_tensor_model_parallel_group()),
            cp=ranks(ps.get_context_parallel_group()),
            dp=ranks(ps.get_data_parallel_group(with_context_parallel=False)),
            pp=ranks(ps.get_pipeline_model_parallel_group()),
            ep=ranks(ps.get_expert_model_parallel_group()),
            coords={"pp": ps.get_pipeline_model_parallel_rank(),
                    "dp": ps.get_data_parallel_rank(with_context_parallel=False),
                    "cp": ps.get_context_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank()},
        )

    @staticmethod
    def destroy() -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()

    # --- model ---------------------------------------------------------------------------------------------
    @staticmethod
    def transformer_engine_available() -> bool:
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            return False
        return True

    def environment_problems(self, plan: Plan) -> list[str]:
        """What the installed Megatron-core cannot *train* for this plan (depends on the machine, unlike
        check_plan): checked by a training script after check_plan and before any process group."""
        if self.transformer_engine_available():
            return []
        out = []
        if _grid(plan).cp > 1:
            out.append(f"cp={_grid(plan).cp}: Megatron-core's context parallelism runs only in Transformer Engine's "
                       "attention (TEDotProductAttention), which is not installed")
        if _model(plan).is_moe:
            # moe_utils.RouterGatingLinearFunction reads te_general_gemm, which is only defined when TE imports:
            # every MoE forward raises NameError without TE (measured on an H200, megatron-core 0.16.1)
            out.append(f"MoE layers in megatron-core {MEGATRON_VERSION} need Transformer Engine (the router's "
                       "gating GEMM refers to TE's general_gemm), which is not installed")
        if _training(plan).dtype == "fp8":
            out.append("fp8: Megatron-core runs FP8 GEMMs only in Transformer Engine's layers, which is not installed")
        return out

    def check_environment(self, plan: Plan) -> None:
        problems = self.environment_problems(plan)
        if problems:
            raise InfeasibleError(f"the {self.name} runtime cannot train this plan on this machine", problems)

    def transformer_config(self, plan: Plan, place: Place, **overrides: Any):
        """The real ``TransformerConfig`` of this worker's stage (``overrides``: e.g. use_cpu_initialization).

        Without Transformer Engine or Apex, Megatron's norm fallback cannot run sequence parallelism: it is turned
        off with a warning; context parallelism there has no attention kernel, so it is refused. (An MoE model
        builds without TE but cannot run forward in 0.16.1: see environment_problems.)
        """
        from megatron.core.transformer.transformer_config import TransformerConfig

        te = self.transformer_engine_available()
        sequence_parallel = None
        if place.stage.tp > 1 and not (te or _apex_available()):
            logger.warning("sequence parallelism needs Transformer Engine or Apex norms; running tp=%d without it",
                           place.stage.tp)
            sequence_parallel = False
        if place.stage.cp > 1 and not te:  # the local attention asserts cp == 1 when built: say why instead
            raise InfeasibleError(f"the {self.name} runtime cannot execute this plan",
                                  [p for p in self.environment_problems(plan) if p.startswith("cp=")])
        if _training(plan).dtype == "fp8" and not te:
            raise InfeasibleError(f"the {self.name} runtime cannot execute this plan",
                                  [p for p in self.environment_problems(plan) if p.startswith("fp8")])
        tf32_matmuls(plan, place)
        kwargs = transformer_config_kwargs(plan, place.stage.index, sequence_parallel=sequence_parallel)
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def build_gpt_model(self, plan: Plan, place: Place, config=None, **config_overrides: Any):
        """This stage's ``GPTModel`` (interleaved 1F1B: a list, one per model chunk): Transformer Engine layer spec
        when installed, else Megatron's local spec."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs as specs

        config = config if config is not None else self.transformer_config(plan, place, **config_overrides)
        model = _model(plan)
        te = self.transformer_engine_available()
        if model.is_moe:
            # the block spec reads config.moe_layer_freq, our explicit per-layer dense/MoE pattern
            spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                                    normalization=_NORMS[model.norm_type])
        elif te:
            spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_norm)
        else:
            spec = specs.get_gpt_layer_local_spec(qk_layernorm=model.qk_norm, normalization=_NORMS[model.norm_type])
        if plan.virtual_stages > 1:  # one GPTModel per model chunk, as Megatron's interleaved schedule wants a list
            return [GPTModel(config=config, transformer_layer_spec=spec, **gpt_model_kwargs(plan, place, j))
                    for j in range(plan.virtual_stages)]
        return GPTModel(config=config, transformer_layer_spec=spec, **gpt_model_kwargs(plan, place))


def _apex_available() -> bool:
    try:
        import apex  # noqa: F401
    except ImportError:
        return False
    return True


def held_layers(gpt_model) -> list[int]:
    """Global 0-based indices of the transformer layers a built GPTModel holds (Megatron numbers them from 1)."""
    return [layer.layer_number - 1 for layer in gpt_model.decoder.layers]


def plan_and_place_from_env(env: Mapping[str, str] | None = None) -> tuple[Plan, Place]:
    """The plan and this worker's place (RANK) from the environment: the launcher's plan copy, checked against the
    sha256 the agents agreed on (as ``tangram_launch.worker.current_plan`` checks it), or a plan file given by hand
    (``TANGRAM_PLAN_FILE`` without ``TANGRAM_PLAN_HASH``)."""
    env = os.environ if env is None else env
    path = env.get(W.ENV_PLAN_FILE)
    if not path:
        raise SpecError(f"no plan: start the worker with tangram-launch --plan FILE (or set {W.ENV_PLAN_FILE})",
                        field=W.ENV_PLAN_FILE)
    data, _ = W.read_launch_plan(path, env.get(W.ENV_PLAN_HASH))
    plan = Plan.from_dict(W.read_plan_dict(path, data), source=path)
    try:
        rank = int(env.get("RANK", "0"))
    except ValueError:
        raise SpecError("RANK must be an integer", field="RANK", value=env.get("RANK")) from None
    return plan, plan.place(rank)
