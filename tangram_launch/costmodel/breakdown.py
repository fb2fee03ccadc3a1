"""Cost of a model slice on an island under one parallel configuration: per-stage time and memory, explained.

``SliceCoster`` is built once per ``SliceQuery`` and caches everything that depends only on a layer and a process
grid (per-layer compute, communication and activation terms, the balanced split of the slice's layers into
pipeline stages), so that a parallelizer evaluating thousands of configurations only adds up a few numbers per
stage. ``SliceCoster.plan(config)`` returns a ``SlicePlan`` whose ``StageCost.breakdown`` says where every second
and byte goes; ``format_breakdown`` prints it (``tangram-launch estimate``).

Per stage and micro-batch (forward_s / backward_s include what runs on the critical path of a micro-batch)::

    forward  = compute_fwd + exposed ZeRO-3 all-gathers + TP + exposed CP + EP + p2p send
    backward = compute_bwd + recompute + exposed ZeRO-2/3 reduce-scatters (+ ZeRO-3 all-gathers) + TP + exposed CP + EP
               (+ the forward's TP/CP/EP again under full recompute) + p2p send of the input gradient

ZeRO-2/3 traffic overlaps the computation of the same micro-batch unit by unit (DeepSpeed ``overlap_comm``, FSDP
prefetch): a unit's collective hides only under the compute of the unit before it (``zero_exposed_s``,
costmodel/overlap.py). Under pipelining (a stage that does not hold the whole model) FSDP2 runs as
torch.distributed.pipelining drives it: each micro-batch's backward leaves the parameters gathered and the gradients
unsharded (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``), and one reduce-scatter per
iteration follows the last backward; so the stage holds its whole parameters and gradients (ZeRO-1's memory), ZeRO-3
re-gathers only for each backward (its forward resharded them), and the gradient reduce-scatter and the parameter
gather are per-iteration terms, as ZeRO-1's. TP
communication is on the critical path (Megatron's default); ring attention overlaps K/V exchange with the attention
core (Liu et al. 2023, "Ring attention"). Per iteration: the data-parallel gradient synchronisation (ZeRO 0/1:
all-reduce or reduce-scatter + all-gather, not overlapped) and the optimizer step (memory-bound on the GPU; PCIe
copies + CPU Adam with offload; plus a measured fixed cost per parameter tensor where the profile has one).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from tangram_launch.costmodel import communication as comm
from tangram_launch.costmodel import overlap
from tangram_launch.costmodel.attention_kernels import check_attention_kernel
from tangram_launch.costmodel.compute import (
    edge_param_tensors,
    embedding_compute,
    head_compute,
    layer_compute,
    layer_param_tensors,
)
from tangram_launch.costmodel.efficiency import CPU_ADAM_PARAMS_PER_S_PER_NODE, DeviceModel
from tangram_launch.costmodel.host_memory import fits_host_memory
from tangram_launch.costmodel.memory import (
    CROSS_ENTROPY_KINDS,
    FP32_BYTES,
    FRAGMENTATION_FRACTION,
    MODEL_STATE_KINDS,
    RUNTIME_OVERHEAD_BYTES,
    SELECTIVE_POLICIES,
    ModelStateBytes,
    embedding_activation_bytes,
    head_activation_bytes,
    held_under_pipelining,
    layer_activation_bytes,
    layer_backward_transient_bytes,
    layer_param_split,
    measured_activation_factor,
    model_state_bytes,
    state_bytes_per_param,
)
from tangram_launch.costmodel.moe_dispatch import MOE_DISPATCHERS, MoERuntime, copies_per_token
from tangram_launch.costmodel.op_sac import OP_SAC_POLICIES
from tangram_launch.costmodel.partition import balanced_split, balanced_split_uniform
from tangram_launch.costmodel.slice_plan import ParallelConfig, SlicePlan, SliceQuery, StageCost, capacity_bytes
from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import RECOMPUTE_MODES, ZERO_STAGES

__all__ = ["ZERO_STAGES", "LayerTerms", "ParallelConfig", "RecomputePart", "SliceCoster", "StageNumbers", "StageSums",
           "ZeroPart", "balanced_split"]


class ZeroPart(NamedTuple):
    """What a stage's cost depends on through (ZeRO stage, offload), computed once per stage and pair."""

    state_bytes: float  # model states kept on the GPU
    zero_fwd_s: float  # ZeRO-3 parameter all-gathers per micro-batch, forward, all layers together
    zero_bwd_s: float  # ZeRO-2/3 reduce-scatters (+ ZeRO-3 all-gathers) per micro-batch, backward, all layers
    sync_s: float  # per iteration: gradient synchronisation not overlapped (ZeRO 0/1), tied embeddings
    optimizer_s: float  # per iteration: the optimizer step
    working_bytes: float  # ZeRO-3: the largest gathered unit's parameters and gradients, a prefetched layer
    dense: ModelStateBytes
    expert: ModelStateBytes
    layer_fwd_s: float = 0.0  # one layer's forward all-gather (its own collective: bandwidth + ring latency)
    layer_bwd_s: float = 0.0  # one layer's backward all-gather + reduce-scatter
    num_layers: int = 1  # layers of the stage, each with its own collectives
    offload_pcie_bytes: float = 0.0  # per iteration with offload: gradients down + updated parameters up
    layer_rs_s: float = 0.0  # of layer_bwd_s, the reduce-scatter
    root_gather_s: float = 0.0  # the embedding, gathered first in the forward
    root_rs_s: float = 0.0  # ... and reduce-scattered last in the backward
    head_gather_s: float = 0.0  # the output layer, gathered while the last layer computes
    head_rs_s: float = 0.0  # ... and reduce-scattered while the last layer's backward runs
    # autocast's 16-bit copies of the GEMM weights saved for the backward (ZeRO 0 under
    # RuntimeCapabilities.autocast_fp32_weights), (not full recompute, full recompute): per micro-batch in flight, the
    # output layer's under full recompute (checkpointed layers save their input alone, its casts go with them) ...
    copy_bytes: tuple[float, float] = (0.0, 0.0)
    # ... and once for the step, the layers' and the output layer's where layers are not recomputed whole (the
    # runtime keeps autocast's cast cache across the step's micro-batches: torch_native.casts_once_per_step)
    held_copy_bytes: tuple[float, float] = (0.0, 0.0)
    # with offload: whether the optimizer state it keeps on the host fits the island's node with the least host
    # memory per GPU (host_memory.fits_host_memory; True without offload or where the host memory is unknown)
    fits_host: bool = True
    # FSDP2's host work per micro-batch beyond compute and transfers (SliceCoster._fsdp_host_s), forward and backward
    host_fwd_s: float = 0.0
    host_bwd_s: float = 0.0
    # under a runtime that overlaps its data-parallel sync (SliceCoster dp_overlap): the collective whose buckets
    # hide under the last micro-batch's backward ("ar" ZeRO-0, "rs" ZeRO-1; "" none), and whether the distributed
    # optimizer's all-gather hides under the next step's first forward; sync_s then leaves them out (dp_overlap_s)
    dp_reduce: str = ""
    dp_gather: bool = False


def _sp_pairs(model, kind: str, ep: int, moe_runtime: MoERuntime | None = None) -> int:
    """Sequence-parallel all-gather/reduce-scatter pairs of one layer: the attention's and the MLP's (Korthikanti
    et al. 2022, sec. 4.2.2). An MoE layer with EP > 1 has no MLP pair: Megatron-core's all-to-all dispatcher
    permutes the rank's sequence-parallel shard as it is (its TP all-gather, of the dispatched copies, is the expert
    communication's, SliceCoster._expert_comm_s); shared experts gather their input like a dense MLP
    (SharedExpertMLP under SP). At EP 1 the allgather dispatcher gathers the hidden states over TP as an MLP does,
    and so does a runtime that replicates the block's input over TP (moe_dispatch.MoERuntime.replicated_tp_input:
    torchtitan all-gathers it before the router and reduce-scatters the Partial output after the combine)."""
    replicated = moe_runtime is not None and moe_runtime.replicated_tp_input
    if kind == "moe" and ep > 1 and not model.num_shared_experts and not replicated:
        return 1
    return 2


class EdgeCompute(NamedTuple):
    """A stage's compute outside its layers, where ZeRO-3 collectives can hide too (0.0 where the stage has none)."""

    emb_fwd_s: float = 0.0
    emb_bwd_s: float = 0.0
    head_fwd_s: float = 0.0
    head_bwd_s: float = 0.0


NO_EDGES = EdgeCompute()
# bytes moved per gradient byte where ZeRO 0 reduces through flat buckets (RuntimeCapabilities.dp_flat_buckets): the
# concatenation reads and writes it, the division by the replicas reads and writes it, the copy back reads and writes
FLAT_BUCKET_PASSES = 6
IN_PLACE_PASSES = 2  # ... and where no other rank holds them (expert parallelism over all replicas): divided in place


def zero_exposed_s(zp: ZeroPart, fwd_compute_s: float, bwd_compute_s: float,
                   edges: EdgeCompute = NO_EDGES) -> tuple[float, float]:
    """ZeRO/FSDP communication left on the critical path of one micro-batch, (forward, backward): a unit's gather
    hides only under the previous unit's compute, the first gather and the last reduce-scatter never hide
    (costmodel/overlap.py). ``fwd_compute_s``/``bwd_compute_s``: the stage's compute per pass, ``edges``' part of it
    included."""
    return _exposed_fwd_s(zp, fwd_compute_s, edges), _exposed_bwd_s(zp, bwd_compute_s, edges)


def _exposed_fwd_s(zp: ZeroPart, fwd_compute_s: float, edges: EdgeCompute) -> float:
    """zero_exposed_s' forward: it does not read the backward's compute, so the recompute modes of one (ZeRO stage,
    offload) share it."""
    if zp.layer_fwd_s > 0.0:
        n = max(1, zp.num_layers)
        return overlap.forward_exposed_s(
            root_gather_s=zp.root_gather_s, layer_gather_s=zp.layer_fwd_s, lead_compute_s=edges.emb_fwd_s,
            head_gather_s=zp.head_gather_s,
            layer_compute_s=(fwd_compute_s - edges.emb_fwd_s - edges.head_fwd_s) / n, num_layers=n)
    return 0.0


def _exposed_bwd_s(zp: ZeroPart, bwd_compute_s: float, edges: EdgeCompute) -> float:
    """zero_exposed_s' backward."""
    if zp.layer_bwd_s > 0.0:
        n = max(1, zp.num_layers)
        return overlap.backward_exposed_s(
            layer_gather_s=zp.layer_bwd_s - zp.layer_rs_s, layer_rs_s=zp.layer_rs_s, root_rs_s=zp.root_rs_s,
            head_rs_s=zp.head_rs_s,
            layer_compute_s=(bwd_compute_s - edges.emb_bwd_s - edges.head_bwd_s) / n,
            head_compute_s=edges.head_bwd_s, tail_compute_s=edges.emb_bwd_s, num_layers=n)
    return 0.0


def dp_overlap_s(zp: ZeroPart, collectives: dict, fwd_compute_s: float, bwd_compute_s: float,
                 edges: EdgeCompute = NO_EDGES) -> float:
    """The ZeRO-0/1 sync a runtime that overlaps it leaves on the step's path (overlap.py): gradient buckets, one
    per layer, beside the last micro-batch's backward (``bwd_compute_s``, recompute included), the distributed
    optimizer's parameter all-gathers beside the next step's first forward; plus the compute they slow where they
    hide (overlap.contention_s). 0.0 where the pair does not overlap (ZeroPart.dp_reduce / dp_gather)."""
    out = 0.0
    n = max(1, zp.num_layers)
    c = collectives
    if zp.dp_reduce:
        p = zp.dp_reduce
        r, root, head = c[p + "_layer"], c[p + "_root"], c[p + "_head"]
        exposed = overlap.backward_exposed_s(
            layer_gather_s=0.0, layer_rs_s=r, root_rs_s=root, head_rs_s=head,
            layer_compute_s=(bwd_compute_s - edges.emb_bwd_s - edges.head_bwd_s) / n,
            head_compute_s=edges.head_bwd_s, tail_compute_s=edges.emb_bwd_s, num_layers=n)
        out += exposed + overlap.contention_s(n * r + root + head, exposed)
    if zp.dp_gather:
        g, root, head = c["ag_layer"], c["ag_root"], c["ag_head"]
        exposed = overlap.forward_exposed_s(
            root_gather_s=root, layer_gather_s=g, lead_compute_s=edges.emb_fwd_s, head_gather_s=head,
            layer_compute_s=(fwd_compute_s - edges.emb_fwd_s - edges.head_fwd_s) / n, num_layers=n)
        out += exposed + overlap.contention_s(n * g + root + head, exposed)
    return out


class RecomputePart(NamedTuple):
    """What a stage's cost depends on through the recompute mode."""

    recompute_s: float  # recomputed forward compute per micro-batch
    comm_s: float  # the forward's TP/CP/EP communication again (full recompute)
    activation_bytes: float  # per in-flight micro-batch, fragmentation included
    working_bytes: float  # full recompute: one layer's activations rebuilt during its backward


class StageNumbers(NamedTuple):
    """One stage of one configuration, per GPU: the numbers a ``StageCost`` holds."""

    forward_s: float
    backward_s: float
    static_bytes: float
    activation_bytes: float
    dp_sync_s: float
    optimizer_s: float


@dataclass(frozen=True)
class LayerTerms:
    """Everything about one layer under one grid (tp, cp, ep, mbs) that does not depend on the memory savers."""

    fwd_s: float
    bwd_s: float
    recompute_s: tuple[float, float, float]  # by RECOMPUTE_MODES
    fwd_flops: float
    recompute_flops: tuple[float, float, float]
    tp_fwd_s: float  # TP all-gather/reduce-scatter exposed in the forward
    tp_bwd_s: float  # ... and in the backward (the same where the runtime overlaps none)
    cp_fwd_s: float  # exposed ring-attention K/V exchange, forward
    cp_bwd_s: float
    ep_fwd_s: float  # MoE all-to-all: token counts, dispatch and combine in the forward
    act_bytes: tuple[float, float, float]  # by RECOMPUTE_MODES, one micro-batch
    dense_params: float  # per GPU (after TP)
    expert_params: float  # per GPU (after TP and EP)
    ep_bwd_s: float = 0.0  # ... the backward's two (gradients of dispatch and combine; no counts exchange)
    param_tensors: float = 0.0  # parameter tensors per GPU (the optimizer's per-tensor cost)
    transient_bytes: float = 0.0  # activation gradients one backward holds (memory.layer_backward_transient_bytes)


@dataclass
class StageSums:
    """A stage's layer terms added up, plus its embedding/head and p2p terms (one grid, one stage)."""

    layers: tuple[int, int]
    has_embedding: bool
    has_head: bool
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_s: tuple = (0.0, 0.0, 0.0)
    fwd_flops: float = 0.0
    recompute_flops: tuple = (0.0, 0.0, 0.0)
    tp_fwd_s: float = 0.0
    tp_bwd_s: float = 0.0
    cp_fwd_s: float = 0.0
    cp_bwd_s: float = 0.0
    ep_fwd_s: float = 0.0
    ep_bwd_s: float = 0.0
    act_bytes: tuple = (0.0, 0.0, 0.0)
    max_layer_act_none: float = 0.0  # one layer's full activations: recomputed during backward under full recompute
    max_layer_act_rebuilt_sel: float = 0.0  # op-level SAC: what one layer's backward rebuilds beyond what it kept
    max_layer_transient: float = 0.0  # the activation gradients one layer's backward holds, in every recompute mode
    dense_params: float = 0.0
    expert_params: float = 0.0
    max_layer_params: float = 0.0  # ZeRO-3 gathers one layer at a time (+ a prefetched one)
    max_edge_params: float = 0.0  # ... and the embedding / output layer whole, each as one unit
    edge_params: float = 0.0  # of dense_params, those outside the layers (the embedding's and output layer's)
    head_params: float = 0.0  # ... of which the output layer's (and a tied copy of its weights)
    edge_compute: EdgeCompute = NO_EDGES  # of fwd_s / bwd_s, the embedding's and the output layer's
    param_tensors: float = 0.0  # parameter tensors per GPU (layers, embedding, head, a tied output copy)
    p2p_fwd_s: float = 0.0  # send activations to the next stage of this slice
    p2p_bwd_s: float = 0.0  # send input gradients to the previous stage of this slice
    p2p_bytes: float = 0.0  # activations handed to the next stage (whole micro-batch, all replicas)
    tied_sync_s: float = 0.0  # tied-embedding gradient all-reduce between first and last stage
    dp_link: comm.GroupLink | None = None
    edp_link: comm.GroupLink | None = None
    shard: int = 1  # data-parallel shard group of dense parameters (dp x cp)
    eshard: int = 1  # ... of expert parameters (dp x cp / ep)
    fixed_fwd_s: float = 0.0  # TP + exposed CP + EP + p2p in the forward (independent of the memory savers)
    fixed_bwd_s: float = 0.0
    collectives: dict = field(default_factory=dict)  # SliceCoster._collectives
    zero_parts: dict = field(default_factory=dict)  # (zero, offload) -> ZeroPart
    rec_parts: list = field(default_factory=lambda: [None, None, None])  # recompute index -> RecomputePart


def _rec_index(mode: str) -> int:
    return RECOMPUTE_MODES.index(mode)


_FULL = RECOMPUTE_MODES.index("full")


class SliceCoster:
    """Costs configurations of one slice query; per-layer and per-grid terms are computed once and cached."""

    def __init__(self, q: SliceQuery, *, flash_attention: bool | None = None, fused_elementwise: bool = True,
                 sequence_parallel: bool = True, selective_policy: str = "megatron",
                 keeps_param_dtype_grads: bool = False, cross_entropy: str = "fused", fp8_gemm_inputs: bool = True,
                 model_states: str = "mixed", whole_column_inputs: bool = False,
                 expert_tensor_parallel: int | None = None, moe_dispatcher: str = "alltoall",
                 moe_permute_fusion: bool = False, moe_probs_on_output: bool = True,
                 attention_kernel: str | None = None, dp_overlap: str | None = None,
                 tp_overlap: str | None = None, autocast: bool = True,
                 layer_kinds: Sequence[str] | None = None, device: DeviceModel | None = None) -> None:
        """``sequence_parallel``: TP runs with Megatron-style sequence parallelism (off: the runtime runs TP without
        it, e.g. Megatron-DeepSpeed of 2022; costmodel/memory.py). ``selective_policy``: what selective recompute
        saves, Megatron's or torchtitan's op-level SAC (memory.SELECTIVE_POLICIES). ``keeps_param_dtype_grads``:
        the runtime keeps the parameter-dtype .grad tensors besides the grad_dtype accumulation buffer all
        iteration (DeepSpeed's BF16_Optimizer under pipeline parallelism calls update_hp_grads(clear_lp_grads=False)
        after each micro-batch's backward). ``cross_entropy``: the loss as Megatron's fused vocab-parallel kernel or
        eager PyTorch's F.cross_entropy (torchtitan), which holds more per logit (memory.CROSS_ENTROPY_KINDS).
        ``fp8_gemm_inputs``: under dtype fp8 the runtime keeps its FP8 GEMMs' inputs in FP8 for the backward
        (Transformer Engine, Megatron's FP8; off: torchao's Float8Linear keeps them in 16 bit). ``model_states``: what
        the runtime stores per parameter (memory.MODEL_STATE_KINDS: FSDP2 over fp32 parameters, everything in bf16;
        storage only, its collectives keep their dtypes). ``whole_column_inputs``: under SP the column-parallel
        GEMMs and the output layer save their all-gathered inputs whole (DTensor TP, torchtitan; memory.py).
        ``expert_tensor_parallel``: the routed experts' own tensor-parallel degree (Megatron-core's MoE parallel
        folding, expert_tensor_parallel_size; None: the stage's tp, Megatron's default and this project's Megatron
        adapter): the expert grid is (etp, ep, edp) over the stage's tp x cp x dp ranks, etp fastest.
        ``moe_dispatcher``: how many copies of a token the EP dispatch moves (costmodel/moe_dispatch.py: top-k
        rows with an all-to-all, one per reached rank with DeepEP). ``moe_permute_fusion``: the permutations run as
        Transformer Engine's fused kernels (Megatron's --moe-permute-fusion; moe_dispatch.permutation_traffic_h).
        ``moe_probs_on_output``: the combine weights the experts' outputs by the routing probabilities and so keeps
        them for the backward (off: the experts' activation applies them; moe_dispatch.MoERuntime).
        ``attention_kernel``: the fused-attention kernel family (attention_kernels.py; None: the training spec's,
        whose default auto is what this project's runtimes run on the GPU). ``dp_overlap``: how much of the
        ZeRO-0/1 data-parallel sync the runtime hides under compute (overlap.DP_OVERLAP_KINDS: Megatron-core's
        overlap_grad_reduce / overlap_param_gather, PyTorch DDP's buckets; none: this project's runtimes).
        ``tp_overlap``: which TP collectives the runtime runs beside a GEMM (overlap.TP_OVERLAP_KINDS: backward,
        Megatron's linear layers; pipelined, --tp-comm-overlap and AsyncTP; none: the other runtimes here). None:
        as the query's runtime runs launched by this project (RuntimeCapabilities.launched_overlaps), which the
        planner prices. ``autocast``: a 16-bit plan's layers run under autocast, as the torch runtime (the one that
        runs Hugging Face models) runs them (off: the model itself is 16-bit, DeepSpeed's fp16/bf16 engines); it
        decides what a composed activation keeps and moves (ModelSpec.activation_impl;
        memory.composed_activation_saved_bytes). The other defaults are what the planner assumes. ``layer_kinds``:
        the kinds of the slice's layers where the caller has them already (model.layer_kind of each; a parallelizer
        asks about the same model many times).
        ``device``: the DeviceModel of the island's GPU under these options, where the caller has built it already
        (a parallelizer asks about the same island hundreds of times)."""
        if selective_policy not in SELECTIVE_POLICIES:
            raise SpecError("unknown selective recompute policy", field="selective_policy", value=selective_policy,
                            valid=", ".join(SELECTIVE_POLICIES))
        if cross_entropy not in CROSS_ENTROPY_KINDS:
            raise SpecError("unknown cross-entropy implementation", field="cross_entropy", value=cross_entropy,
                            valid=", ".join(CROSS_ENTROPY_KINDS))
        if model_states not in MODEL_STATE_KINDS:
            raise SpecError("unknown model-state storage", field="model_states", value=model_states,
                            valid=", ".join(MODEL_STATE_KINDS))
        self.cross_entropy = cross_entropy
        self.autocast = bool(autocast)
        self.sequence_parallel = bool(sequence_parallel)
        self.selective_policy = selective_policy
        self.keeps_param_dtype_grads = bool(keeps_param_dtype_grads)
        self.fp8_gemm_inputs = bool(fp8_gemm_inputs) and q.training.dtype == "fp8"
        self.whole_column_inputs = bool(whole_column_inputs)
        if expert_tensor_parallel is not None and (isinstance(expert_tensor_parallel, bool)
                                                   or not isinstance(expert_tensor_parallel, int)
                                                   or expert_tensor_parallel < 1):
            raise SpecError("the experts' tensor-parallel degree must be a positive integer",
                            field="expert_tensor_parallel", value=expert_tensor_parallel,
                            valid="a positive integer (1: whole experts on each GPU), or omitted for the stage's tp")
        launched = q.capabilities.launched_overlaps
        dp_overlap = launched[0] if dp_overlap is None else dp_overlap
        tp_overlap = launched[1] if tp_overlap is None else tp_overlap
        if dp_overlap not in overlap.DP_OVERLAP_KINDS:
            raise SpecError("unknown data-parallel overlap", field="dp_overlap", value=dp_overlap,
                            valid=", ".join(overlap.DP_OVERLAP_KINDS))
        self.dp_overlap = dp_overlap
        if tp_overlap not in overlap.TP_OVERLAP_KINDS:
            raise SpecError("unknown tensor-parallel overlap", field="tp_overlap", value=tp_overlap,
                            valid=", ".join(overlap.TP_OVERLAP_KINDS))
        self.tp_overlap = tp_overlap
        if moe_dispatcher not in MOE_DISPATCHERS:
            raise SpecError("unknown MoE token dispatcher", field="moe_dispatcher", value=moe_dispatcher,
                            valid=", ".join(MOE_DISPATCHERS))
        # DTensor TP replicates the MoE block's input over TP as it does the attention's and the MLP's (torchtitan's
        # apply_moe_ep_tp; moe_dispatch.MoERuntime.replicated_tp_input): the same runtime fact as whole inputs
        self.moe_runtime = MoERuntime(expert_tensor_parallel, moe_dispatcher, bool(moe_permute_fusion),
                                      bool(moe_probs_on_output), replicated_tp_input=self.whole_column_inputs)
        # (parameter, gradient, optimizer-state) bytes stored per parameter (communication keeps the training dtypes)
        self.state_bytes = state_bytes_per_param(model_states, dtype_bytes=q.training.param_bytes,
                                                 grad_bytes=q.training.grad_bytes,
                                                 optimizer_bytes=q.training.optimizer_state_bytes,
                                                 keeps_param_dtype_grads=keeps_param_dtype_grads)
        self.q = q
        # 16-bit plans only: fp32 and tf32 weights are what autocast-free runs keep anyway
        self.autocast_fp32_weights = (q.capabilities.autocast_fp32_weights
                                      and q.training.param_bytes < FP32_BYTES)
        self.model = q.model
        self.training = q.training
        self.island = q.island
        self.seq_len = q.training.seq_len
        self.capacity_bytes = capacity_bytes(q.island, q.training)
        self.num_microbatches = max(1, q.num_microbatches)
        self.device_error: str | None = None
        if device is not None:
            self.dev: DeviceModel | None = device
        else:
            kernel = check_attention_kernel(attention_kernel or q.training.attention_kernel)
            self.dev = self._device(q, flash_attention, fused_elementwise, kernel)
        link = q.island.inter_node_link
        self.inter_gbps = link.bandwidth_GBps if link is not None else None
        self.inter_latency_us = link.latency_us if link is not None else 0.0
        start, stop = q.layers
        # the query's properties, read per grid and stage
        self.has_embedding, self.has_head = q.has_embedding, q.has_head
        self.layer_ids = list(range(start, stop))
        # layers of one kind are interchangeable: compute terms for one representative per kind
        self.kinds = (list(layer_kinds) if layer_kinds is not None
                      else [self.model.layer_kind(i) for i in self.layer_ids])
        if len(self.kinds) != len(self.layer_ids):
            raise SpecError("must give one kind per layer of the slice", field="layer_kinds",
                            value=len(self.kinds), valid=f"{len(self.layer_ids)} kinds")
        self.rep = {k: start + self.kinds.index(k) for k in dict.fromkeys(self.kinds)}  # first layer of each kind
        # prefix[k][i]: layers of kind k among the slice's first i layers
        if len(self.rep) == 1:
            self.prefix = {k: list(range(len(self.kinds) + 1)) for k in self.rep}
        else:
            self.prefix = {k: list(itertools.accumulate((kk == k for kk in self.kinds), initial=0))
                           for k in self.rep}
        self._layer_cache: dict = {}
        self._grid_cache: dict = {}
        self._split_cache: dict = {}
        self._edge_cache: dict = {}
        self.fragmentation = 1.0 + FRAGMENTATION_FRACTION  # allocator fragmentation on activation bytes
        # the runtime's own bytes on each GPU (CUDA context, allocator pools); none on a CPU "device"
        self.overhead_bytes = 0.0 if (self.dev is None or self.dev.is_cpu) else RUNTIME_OVERHEAD_BYTES

    def _device(self, q: SliceQuery, flash_attention: bool | None, fused_elementwise: bool,
                attention_kernel: str) -> DeviceModel | None:
        """The island GPU's DeviceModel; None (and device_error says why) where the GPU cannot run the dtype."""
        try:
            return DeviceModel.from_gpu(q.island.gpu, q.training.dtype, flash_attention=flash_attention,
                                        fused_elementwise=fused_elementwise, attention_kernel=attention_kernel,
                                        sdpa=q.capabilities.sdpa_attention)
        except SpecError as exc:
            self.device_error = f"island {q.island.name}: {exc}"
            return None

    # ------------------------------------------------------------------------------------------ per layer
    def etp(self, tp: int) -> int:
        """The routed experts' tensor-parallel degree in a stage of TP degree ``tp`` (constructor keyword)."""
        return self.moe_runtime.etp(tp)

    def _link(self, stride: int, size: int, stage_gpus: int) -> comm.GroupLink:
        """comm.group_link on this island (kept in the context's edge cache: a GroupLink is frozen)."""
        key = ("link", stride, size, stage_gpus)
        hit = self._edge_cache.get(key)
        if hit is None:
            hit = self._edge_cache[key] = comm.group_link(
                stride, size, stage_gpus=stage_gpus, gpus_per_node=self.island.gpus_per_node, dev=self.dev,
                inter_bandwidth_GBps=self.inter_gbps, inter_latency_us=self.inter_latency_us)
        return hit

    def _egress_link(self, stage_gpus: int) -> comm.GroupLink:
        """A pair of ranks, one of a stage here and one on another island: across nodes over the link out of this
        island, each node's NIC shared by the stage's ranks on it (an island of one node's GPUs alone in the
        cluster keeps its own links)."""
        out = self.island.egress_link or self.island.inter_node_link
        if out is None:
            return self._link(1, 2, stage_gpus)
        key = ("egress", stage_gpus)
        hit = self._edge_cache.get(key)
        if hit is None:
            g = self.island.gpus_per_node
            hit = self._edge_cache[key] = comm.group_link(
                g, 2, stage_gpus=stage_gpus, gpus_per_node=g, dev=self.dev, inter_bandwidth_GBps=out.bandwidth_GBps,
                inter_latency_us=out.latency_us)
        return hit

    def layer_terms(self, kind: str, tp: int, cp: int, ep: int, dp: int, mbs: int) -> LayerTerms:
        key = (kind, tp, cp, ep, dp, mbs)
        hit = self._layer_cache.get(key)
        if hit is not None:
            return hit
        # dp enters only through the stage's TP / CP / EP links: grids alike in those (at other micro-batch sizes,
        # dp x mbs) share the terms
        stage_gpus = tp * cp * dp
        etp = self.etp(tp)
        tp_link = self._link(1, tp, stage_gpus)
        cp_link = self._link(tp, cp, stage_gpus) if cp > 1 else None
        expert_links = self._expert_links(ep, etp, stage_gpus) if kind == "moe" else (None, None)
        by_links = (kind, tp, cp, ep, mbs, tp_link, cp_link, *expert_links)
        hit = self._layer_cache.get(by_links)
        if hit is None:
            hit = self._layer_cache[by_links] = self._layer_terms(kind, tp, cp, ep, mbs, (tp_link, cp_link),
                                                                  stage_gpus)
        self._layer_cache[key] = hit
        return hit

    def _layer_terms(self, kind: str, tp: int, cp: int, ep: int, mbs: int, links: tuple, stage_gpus: int) -> LayerTerms:
        """layer_terms' terms, over the stage's TP and CP (cp > 1) links; ``stage_gpus`` enters only through the
        expert links _expert_comm_s takes (layer_terms keys the terms by those links, not by it)."""
        tp_link, cp_link = links
        dev, model, s = self.dev, self.model, self.seq_len
        i = self.rep[kind]
        p = dev.dtype_bytes
        etp = self.etp(tp)
        lc = layer_compute(model, i, seq_len=s, mbs=mbs, tp=tp, cp=cp, ep=ep, dev=dev, moe_runtime=self.moe_runtime,
                           autocast=self.autocast)
        tokens = mbs * s / cp
        act_full = tokens * model.hidden_size * p  # the M x h activation every TP collective moves
        # Megatron TP + SP (Korthikanti et al. 2022, sec. 4.2.2): per layer forward 2 all-gathers + 2
        # reduce-scatters of the M x h activation (= the volume of 2 all-reduces), the same in the backward; all
        # on the critical path unless the runtime runs some beside a GEMM (tp_overlap)
        pairs = _sp_pairs(model, kind, ep, self.moe_runtime)
        gather = comm.collective_s(comm.ALL_GATHER, act_full, tp, tp_link)
        scatter = comm.collective_s(comm.REDUCE_SCATTER, act_full, tp, tp_link)
        tp_fwd = tp_bwd = pairs * (gather + scatter)
        if self.tp_overlap != "none" and tp > 1:  # beside the GEMMs next to them (overlap.py); a pair without
            beside = lc.sp_gemms_s[:pairs]  # GEMMs (an MoE block's routed input at EP 1) waits
            bare = (pairs - len(beside)) * (gather + scatter)
            if self.tp_overlap == "pipelined":
                tp_fwd = bare + sum(overlap.tp_exposed_s(gather, col, tp) + overlap.tp_exposed_s(scatter, row, tp)
                                    for col, row in beside)
                tp_bwd = bare + sum(overlap.tp_exposed_s(gather, row, tp) + overlap.tp_exposed_s(scatter, col, tp)
                                    for col, row in beside)
            else:
                tp_bwd = bare + sum(gather + overlap.beside_s(scatter, col) for col, row in beside)
        # Ring attention: cp - 1 steps, each passing this GPU's K and V chunk (2 x M x kv_dim/t); the backward
        # passes K, V and their gradients (2x). Overlapped with the attention core; only the excess is exposed.
        cp_fwd = cp_bwd = 0.0
        if cp > 1:
            kv = 2 * tokens * model.kv_dim / tp * p
            step = comm.collective_s(comm.SEND_RECV, kv, 2, cp_link)
            cp_fwd = max(0.0, (cp - 1) * step - lc.attention_core_s)
            cp_bwd = max(0.0, 2 * (cp - 1) * step - 2 * lc.attention_core_s)
        ep_fwd = ep_bwd = 0.0
        if kind == "moe":
            ep_fwd, ep_bwd = self._expert_comm_s(tokens, tp, ep, etp, stage_gpus)
        flash = dev.flash_attention or dev.mem_efficient_attention  # no s x s scores kept
        acts = tuple(layer_activation_bytes(model, i, seq_len=s, mbs=mbs, tp=tp, cp=cp, recompute=m, flash=flash,
                                            dtype_bytes=p, sequence_parallel=self.sequence_parallel,
                                            selective_policy=self.selective_policy,
                                            fp8_gemm_inputs=self.fp8_gemm_inputs,
                                            whole_column_inputs=self.whole_column_inputs,
                                            moe_runtime=self.moe_runtime, autocast=self.autocast,
                                            eager_attention=dev.eager_attention)
                     for m in RECOMPUTE_MODES)
        # the profile's saved bytes of this kind, where it has them, correct the kept tensors (memory.py: Measured)
        measured = measured_activation_factor(self.island.gpu.measured, model, i, seq_len=s, mbs=mbs, tp=tp,
                                              flash=flash, dtype_bytes=p)
        if measured is not None:
            acts = (acts[0] * measured, acts[1] * measured, acts[2])
        dense, experts = layer_param_split(model, i)
        terms = LayerTerms(
            fwd_s=lc.forward_s, bwd_s=lc.backward_s,
            recompute_s=tuple(lc.recompute_s(m, self.selective_policy) for m in RECOMPUTE_MODES),
            fwd_flops=lc.forward_flops,
            recompute_flops=tuple(lc.recompute_flops(m, self.selective_policy) for m in RECOMPUTE_MODES),
            tp_fwd_s=tp_fwd, tp_bwd_s=tp_bwd, cp_fwd_s=cp_fwd, cp_bwd_s=cp_bwd, ep_fwd_s=ep_fwd, ep_bwd_s=ep_bwd,
            act_bytes=acts, dense_params=dense / tp, expert_params=experts / (etp * ep),
            param_tensors=layer_param_tensors(model, i, ep=ep),
            transient_bytes=layer_backward_transient_bytes(model, i, seq_len=s, mbs=mbs, tp=tp, cp=cp, dtype_bytes=p,
                                                           moe_runtime=self.moe_runtime),
        )
        return terms

    def _expert_links(self, ep: int, etp: int, stage_gpus: int) -> tuple:
        """(the EP group's link, etp ranks apart; the experts' TP group's link) of an MoE layer, None where the group
        moves nothing (ep 1; etp 1): what _expert_comm_s prices, and so part of layer_terms' cache key."""
        if ep <= 1:
            return None, None
        return self._link(etp, ep, stage_gpus), (self._link(1, etp, stage_gpus) if etp > 1 else None)

    def _expert_comm_s(self, tokens: float, tp: int, ep: int, etp: int, stage_gpus: int) -> tuple[float, float]:
        """(forward, backward) token dispatch of one MoE layer per micro-batch, as Megatron-core's all-to-all
        dispatcher runs it (megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher), or
        torchtitan's ExpertParallel / ExpertTensorParallel where the block's input is replicated over TP (each TP
        rank sends the copies of the tokens it dispatches, MoERuntime.dispatch_factor, and none are gathered over
        the experts' TP group).

        At EP 1 the runtime's allgather dispatcher gathers the hidden states over TP like a dense MLP (the layer's
        SP pair, _sp_pairs) and moves nothing else. Dispatch: all-to-all over the EP group (etp ranks apart) of the
        rank's copies of its sequence-parallel shard (Lepikhin et al. 2021, GShard; top-k of them, fewer with
        DeepEP: moe_dispatch.copies_per_token), then, with etp > 1, an all-gather of them over the experts' TP
        group (gather_from_sequence_parallel_region); combine: the reduce-scatter and the all-to-all back. The
        backward runs each in reverse. The forward first exchanges the tokens-per-expert counts (E int64s: Megatron's
        dispatcher and the torch runtime both do), whose cost is the collective's fixed latency."""
        model, p, rt = self.model, self.dev.dtype_bytes, self.moe_runtime
        rows = copies_per_token(rt.dispatcher, num_experts=model.num_experts, top_k=model.top_k, ep=ep)
        copies = tokens / tp * rt.dispatch_factor(tp) * rows * model.hidden_size * p  # a rank's dispatched copies
        pass_s = counts_s = 0.0
        ep_link, etp_link = self._expert_links(ep, etp, stage_gpus)
        if not rt.gathers_over_etp(tp):
            etp_link = None
        if ep_link is not None:
            pass_s = 2 * comm.collective_s(comm.ALL_TO_ALL, copies, ep, ep_link)
            counts_s = comm.collective_s(comm.ALL_TO_ALL, model.num_experts * 8, ep, ep_link)
        if etp_link is not None:  # the gathered buffer holds the etp ranks' received copies
            pass_s += (comm.collective_s(comm.ALL_GATHER, copies * etp, etp, etp_link)
                       + comm.collective_s(comm.REDUCE_SCATTER, copies * etp, etp, etp_link))
        return pass_s + counts_s, pass_s

    def edges(self, tp: int, cp: int, dp: int, mbs: int) -> dict:
        key = (tp, cp, dp, mbs)
        hit = self._edge_cache.get(key)
        if hit is not None:
            return hit
        tp_link = self._link(1, tp, tp * cp * dp)  # dp enters only through it (as in layer_terms)
        by_link = ("edges", tp, cp, mbs, tp_link)
        hit = self._edge_cache.get(by_link)
        if hit is None:
            hit = self._edge_cache[by_link] = self._edges(tp, cp, mbs, tp_link)
        self._edge_cache[key] = hit
        return hit

    def _edges(self, tp: int, cp: int, mbs: int, tp_link: comm.GroupLink) -> dict:
        """edges' terms over the stage's TP link."""
        dev, model, s = self.dev, self.model, self.seq_len
        p = dev.dtype_bytes
        act_full = mbs * s / cp * model.hidden_size * p
        emb = embedding_compute(model, seq_len=s, mbs=mbs, tp=tp, cp=cp, dev=dev)
        head = head_compute(model, seq_len=s, mbs=mbs, tp=tp, cp=cp, dev=dev)
        out = {
            "emb_fwd_s": emb.forward_s, "emb_bwd_s": emb.backward_s, "emb_flops": emb.forward_flops,
            # vocab-parallel embedding: reduce-scatter of the looked-up rows (forward only)
            "emb_tp_s": comm.collective_s(comm.REDUCE_SCATTER, act_full, tp, tp_link),
            "emb_act": embedding_activation_bytes(model, seq_len=s, mbs=mbs, tp=tp, cp=cp,
                                                  sequence_parallel=self.sequence_parallel),
            "head_fwd_s": head.forward_s, "head_bwd_s": head.backward_s, "head_flops": head.forward_flops,
            # SP all-gather of the head input (forward), reduce-scatter of its gradient (backward)
            "head_tp_s": comm.collective_s(comm.ALL_GATHER, act_full, tp, tp_link),
            "head_act": head_activation_bytes(model, seq_len=s, mbs=mbs, tp=tp, cp=cp, dtype_bytes=p,
                                              sequence_parallel=self.sequence_parallel,
                                              cross_entropy=self.cross_entropy,
                                              whole_column_inputs=self.whole_column_inputs),
        }
        return out

    def clear_grid_cache(self) -> None:
        """Drop the per-grid stage sums (a caller that keeps this coster, e.g. in lazy plans, and has the sums
        elsewhere frees them)."""
        self._grid_cache = {}

    def layer_counts(self) -> list[tuple[str, int]]:
        """(kind, layers of that kind) over the slice."""
        return [(k, pre[-1]) for k, pre in self.prefix.items() if pre[-1]]





    # ------------------------------------------------------------------------------------------ per grid
    def split(self, pp: int, tp: int, cp: int, ep: int, dp: int, mbs: int) -> tuple[tuple[int, int], ...]:
        """Absolute layer ranges of the ``pp`` stages, balanced by time (no recompute) with embedding/head."""
        return self.stage_ranges(self.split_sizes(pp, tp, cp, ep, dp, mbs))

    def stage_ranges(self, sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Absolute layer ranges of stages of these sizes, front to back over the slice."""
        start = self.layer_ids[0]
        ends = tuple(itertools.accumulate(sizes, initial=start))
        assert ends[-1] == self.layer_ids[-1] + 1
        return tuple(zip(ends, ends[1:]))

    def split_sizes(self, pp: int, tp: int, cp: int, ep: int, dp: int, mbs: int) -> tuple[int, ...]:
        """split's layers per stage, front to back (the same tuple for the same split: callers key caches by it)."""
        n = len(self.layer_ids)
        if pp == 1:
            return (n,)
        if len(self.rep) == 1:  # one layer kind: its weight and the edge extras are the context's, per grid
            # (not remembered per grid and slice length as well: a planning run asks each of those once)
            return self.one_kind_split(self.one_kind_weights(tp, cp, ep, dp, mbs), pp)
        rounded, fe, le = self._split_weights(tp, cp, ep, dp, mbs)
        weights = tuple(map(dict(zip(self.rep, rounded)).__getitem__, self.kinds))
        key = (pp, weights, fe, le)
        sizes = self._split_cache.get(key)
        if sizes is None:
            sizes = self._split_cache[key] = balanced_split(weights, pp, first_extra=fe, last_extra=le)
        assert len(sizes) == pp and n >= pp
        return sizes

    def one_kind_weights(self, tp: int, cp: int, ep: int, dp: int, mbs: int) -> tuple:
        """A one-kind slice's _split_weights for a grid (the context's, kept in the split cache): what
        one_kind_split takes, for a caller that keeps them per grid."""
        (kind,) = self.rep
        wkey = ("one kind", kind, tp, cp, ep, dp, mbs, self.has_embedding, self.has_head)
        wfl = self._split_cache.get(wkey)
        if wfl is None:
            wfl = self._split_cache[wkey] = self._split_weights(tp, cp, ep, dp, mbs)
        return wfl

    def one_kind_split(self, weights: tuple, pp: int) -> tuple[int, ...]:
        """split_sizes of a one-kind slice into pp > 1 stages under its grid's one_kind_weights."""
        (w,), fe, le = weights
        n = len(self.layer_ids)
        key = (pp, (w, n), fe, le)
        sizes = self._split_cache.get(key)
        if sizes is None:
            sizes = self._split_cache[key] = balanced_split_uniform(w, n, pp, first_extra=fe, last_extra=le)
        assert len(sizes) == pp and n >= pp
        return sizes

    def _split_weights(self, tp: int, cp: int, ep: int, dp: int, mbs: int) -> tuple[tuple[float, ...], float,
                                                                                      float]:
        """split()'s weights: each layer kind's time (no recompute) over the heaviest kind's, rounded (in the
        order of self.rep), and the embedding's and head's extras on that scale."""
        per_kind = {}
        for k in self.rep:
            t = self.layer_terms(k, tp, cp, ep, dp, mbs)
            per_kind[k] = (t.fwd_s + t.bwd_s + t.tp_fwd_s + t.tp_bwd_s + t.cp_fwd_s + t.cp_bwd_s + t.ep_fwd_s
                           + t.ep_bwd_s)
        e = self.edges(tp, cp, dp, mbs)
        unit = max(per_kind.values()) or 1.0
        first = (e["emb_fwd_s"] + e["emb_bwd_s"] + e["emb_tp_s"]) if self.has_embedding else 0.0
        last = (e["head_fwd_s"] + e["head_bwd_s"] + 2 * e["head_tp_s"]) if self.has_head else 0.0
        return tuple(round(t / unit, 4) for t in per_kind.values()), round(first / unit, 3), round(last / unit, 3)

    def stage_sums(self, tp: int, pp: int, dp: int, cp: int, ep: int, stages: Sequence[int] | None = None,
                   sizes: Sequence[int] | None = None) -> list[StageSums]:
        """Per-stage sums for one grid (cached): layer terms, embedding/head, p2p and group links. ``stages``:
        only these stages, by index, in that order (not cached): the stage table costs only stages it has not met,
        mostly one or two of a long pipeline's. ``sizes``: the grid's split_sizes, where the caller has them."""
        key = (tp, pp, dp, cp, ep)
        hit = self._grid_cache.get(key)
        if hit is not None:
            return hit if stages is None else [hit[j] for j in stages]
        b = self.q.microbatch_sequences
        mbs = b // dp
        dev, model = self.dev, self.model
        p = dev.dtype_bytes
        g = self.island.gpus_per_node
        stage_gpus = tp * cp * dp
        if stages is None:
            ranges = self.split(pp, tp, cp, ep, dp, mbs) if sizes is None else self.stage_ranges(sizes)
        else:  # only the stages asked for: their ranges from the split's sizes
            if sizes is None:
                sizes = self.split_sizes(pp, tp, cp, ep, dp, mbs)
            start = self.layer_ids[0]
            ranges = {}
            for j in stages:
                a = start + sum(sizes[:j])
                ranges[j] = (a, a + sizes[j])
        edges = self.edges(tp, cp, dp, mbs)
        dp_link = self._link(tp, dp * cp, stage_gpus)
        etp = self.etp(tp)
        edp = stage_gpus // (etp * ep)
        edp_link = self._link(etp * ep, edp, stage_gpus)
        first_layer, last_layer = self.q.layers
        act_bytes_mb = b * self.seq_len * model.hidden_size * p  # a whole micro-batch's hidden states
        sums = []
        p2p_by_link: dict[bool, float] = {}  # a boundary's p2p time depends only on whether it stays in a node

        def p2p_fwd_s(j: int) -> float:  # activations to stage j + 1 over the link at their boundary
            boundary = (j + 1) * stage_gpus
            same = (boundary - 1) // g == boundary // g
            hit = p2p_by_link.get(same)
            if hit is None:
                hit = p2p_by_link[same] = comm.p2p_stage_s(
                    act_bytes_mb, stage_gpus=stage_gpus, gpus_per_node=g, same_node=same, dev=dev,
                    inter_bandwidth_GBps=self.inter_gbps, inter_latency_us=self.inter_latency_us)
            return hit

        for j in range(pp) if stages is None else stages:
            a, z = ranges[j]
            has_emb = self.has_embedding and a == first_layer
            has_head = self.has_head and z == last_layer
            st = StageSums(layers=(a, z), has_embedding=has_emb, has_head=has_head, dp_link=dp_link,
                           edp_link=edp_link)
            counts = tuple((k, pre[z - first_layer] - pre[a - first_layer]) for k, pre in self.prefix.items())
            (st.fwd_s, st.bwd_s, st.fwd_flops, st.tp_fwd_s, st.tp_bwd_s, st.cp_fwd_s, st.cp_bwd_s, st.ep_fwd_s,
             st.ep_bwd_s, rec, rec_f, acts, st.max_layer_act_none, st.max_layer_act_rebuilt_sel, st.dense_params,
             st.expert_params, st.param_tensors, st.max_layer_params,
             st.max_layer_transient) = self._layers_part(counts, tp, cp, ep, dp, mbs)
            emb_act = head_act = 0.0
            if has_emb:
                st.fwd_s += edges["emb_fwd_s"]
                st.bwd_s += edges["emb_bwd_s"]
                st.fwd_flops += edges["emb_flops"]
                st.tp_fwd_s += edges["emb_tp_s"]
                emb_act = edges["emb_act"]
                st.dense_params += model.embedding_params() / tp
                st.edge_params += model.embedding_params() / tp
                # ZeRO-3 / FSDP gather the embedding's weight whole, like a layer's (with a 128k vocabulary and a
                # 4k hidden size it is 2.4 layers of Llama 3 8B)
                st.max_edge_params = max(st.max_edge_params, model.embedding_params() / tp)
            if has_head:
                st.fwd_s += edges["head_fwd_s"]
                st.bwd_s += edges["head_bwd_s"]
                st.fwd_flops += edges["head_flops"]
                st.tp_fwd_s += edges["head_tp_s"]
                st.tp_bwd_s += edges["head_tp_s"]
                head_act = edges["head_act"]
                st.dense_params += model.head_params() / tp
                st.edge_params += model.head_params() / tp
                st.head_params += model.head_params() / tp
                st.max_edge_params = max(st.max_edge_params, model.head_params() / tp)
                if model.tied_embeddings and not has_emb:
                    # the last stage keeps its own copy of the tied output weights (Megatron's embedding group);
                    # their gradients are all-reduced with the first stage's every iteration, over the link
                    # between stage 0 and this one inside the slice, else (first stage on another island) the
                    # network out of this island (Island.egress_link), through the NIC its node's ranks share
                    out_w = model.output_embedding_params() / tp
                    st.dense_params += out_w
                    st.edge_params += out_w
                    st.head_params += out_w
                    st.max_edge_params = max(st.max_edge_params, out_w)
                    if self.has_embedding:  # stage 0 of this slice, j * stage_gpus ranks away
                        link = self._link(j * stage_gpus, 2, stage_gpus)
                    else:
                        link = self._egress_link(stage_gpus)
                    st.tied_sync_s = comm.collective_s(comm.ALL_REDUCE, out_w * self.training.grad_bytes, 2, link)
            st.param_tensors += edge_param_tensors(model, has_embedding=has_emb, has_head=has_head)
            if has_emb or has_head:
                st.edge_compute = EdgeCompute(edges["emb_fwd_s"] if has_emb else 0.0,
                                              edges["emb_bwd_s"] if has_emb else 0.0,
                                              edges["head_fwd_s"] if has_head else 0.0,
                                              edges["head_bwd_s"] if has_head else 0.0)
            st.recompute_s = tuple(rec)
            st.recompute_flops = tuple(rec_f)
            st.act_bytes = tuple(x + emb_act + head_act for x in acts)
            # the loss frees its tensors before any layer's backward: the gradients reuse those blocks first
            st.max_layer_transient = max(0.0, st.max_layer_transient - head_act)
            st.p2p_bytes = 0.0 if has_head else act_bytes_mb
            if j < pp - 1:
                st.p2p_fwd_s = p2p_fwd_s(j)
            sums.append(st)
        if stages is None:
            for j in range(1, pp):
                sums[j].p2p_bwd_s = sums[j - 1].p2p_fwd_s  # the input gradient goes back over the same link
        else:
            for j, st in zip(stages, sums):
                if j > 0:
                    st.p2p_bwd_s = p2p_fwd_s(j - 1)
        for st in sums:
            st.shard, st.eshard = dp * cp, edp
            st.fixed_fwd_s = st.tp_fwd_s + st.cp_fwd_s + st.ep_fwd_s + st.p2p_fwd_s
            st.fixed_bwd_s = st.tp_bwd_s + st.cp_bwd_s + st.ep_bwd_s + st.p2p_bwd_s
        if stages is None:
            self._grid_cache[key] = sums
        return sums

    def _layers_part(self, counts: tuple[tuple[str, int], ...], tp: int, cp: int, ep: int, dp: int,
                     mbs: int) -> tuple:
        """A stage's layers added up (stage_sums' fields before the embedding, head and links), from 0.0, kind by
        kind in the slice's order (``counts``: (kind, layers) in that order): kept in the context's edge cache,
        since stages alike in their layers but not in embedding, head or links share it."""
        key = ("layers", counts, tp, cp, ep, dp, mbs)
        hit = self._edge_cache.get(key)
        if hit is not None:
            return hit
        fwd_s = bwd_s = fwd_flops = tp_fwd_s = tp_bwd_s = cp_fwd_s = cp_bwd_s = ep_fwd_s = ep_bwd_s = 0.0
        act_none = rebuilt_sel = dense = expert = tensors = max_params = transient = 0.0
        rec = [0.0, 0.0, 0.0]
        rec_f = [0.0, 0.0, 0.0]
        acts = [0.0, 0.0, 0.0]
        for k, c in counts:
            if not c:
                continue
            t = self.layer_terms(k, tp, cp, ep, dp, mbs)
            fwd_s += c * t.fwd_s
            bwd_s += c * t.bwd_s
            fwd_flops += c * t.fwd_flops
            tp_fwd_s += c * t.tp_fwd_s
            tp_bwd_s += c * t.tp_bwd_s
            cp_fwd_s += c * t.cp_fwd_s
            cp_bwd_s += c * t.cp_bwd_s
            ep_fwd_s += c * t.ep_fwd_s
            ep_bwd_s += c * t.ep_bwd_s
            for m in range(3):
                rec[m] += c * t.recompute_s[m]
                rec_f[m] += c * t.recompute_flops[m]
                acts[m] += c * t.act_bytes[m]
            act_none = max(act_none, t.act_bytes[0])
            rebuilt_sel = max(rebuilt_sel, t.act_bytes[0] - t.act_bytes[1])
            dense += c * t.dense_params
            expert += c * t.expert_params
            tensors += c * t.param_tensors
            max_params = max(max_params, t.dense_params + t.expert_params)
            transient = max(transient, t.transient_bytes)
        hit = self._edge_cache[key] = (fwd_s, bwd_s, fwd_flops, tp_fwd_s, tp_bwd_s, cp_fwd_s, cp_bwd_s, ep_fwd_s,
                                       ep_bwd_s, tuple(rec), tuple(rec_f), tuple(acts), act_none, rebuilt_sel, dense,
                                       expert, tensors, max_params, transient)
        return hit

    def kept_state_bytes(self, zero: int, offload: bool = False, *, held: bool = True) -> tuple[float, float, float]:
        """(parameter, gradient, optimizer-state) bytes a GPU stores per parameter under ZeRO stage ``zero``: the
        runtime's storage (state_bytes), or fp32 weights, gradients and Adam's moments where the module keeps fp32
        weights (RuntimeCapabilities.autocast_fp32_weights) and the storage's 16-bit weights would under-count them:
        a ZeRO-0 stage, which runs autocast over them (its 16-bit copies are priced apart, ZeroPart), a stage
        that offloads, whose fp32 parameter shards and gradients stay on the GPU while the moments go to the host
        (runtime_adapters/offload.py; for ZeRO 1-2 the whole fp32 parameters bound FSDP2's shards and its gathered
        16-bit parameters together), and a ZeRO-3 stage that does not hold its parameters gathered (``held``
        False: FSDP2 keeps fp32 shards of parameters and gradients, which are the optimizer's master copy; the unit
        gathered in 16 bits is working memory). The memory floors read the same (slice_floors): the copies only
        add."""
        if self.autocast_fp32_weights and (zero == 0 or offload or (zero >= 3 and not held)):
            return FP32_BYTES, FP32_BYTES, self.training.optimizer_state_bytes - FP32_BYTES
        return self.state_bytes

    # ------------------------------------------------------------------------------------------ per config
    # A configuration's stage cost is assembled from two cached parts: what depends on (ZeRO stage, offload) and
    # what depends on the recompute mode. The parallelizers' inner loop and the explained path share them.
    def _zero_part(self, st: StageSums, zero: int, off: bool) -> ZeroPart:
        """The stage's terms under (ZeRO stage, offload), cached on the stage."""
        key = (zero, off)
        hit = st.zero_parts.get(key)
        if hit is not None:
            return hit
        tr, dev = self.training, self.dev
        pb, gb, ob = tr.param_bytes, tr.grad_bytes, tr.optimizer_state_bytes  # bytes communicated and updated (time)
        shard, eshard = st.shard, st.eshard
        if zero and shard == 1 and self.autocast_fp32_weights:  # no group to shard over: the runtime wraps nothing,
            zero = 0  # a ZeRO-0 stage (runtime_adapters/torch_native.py, _apply_data_parallel, casts_once_per_step)
        # under pipelining FSDP2 holds the whole parameters and unsharded gradients across the micro-batches
        # (module docstring): ZeRO-1's memory and per-iteration collectives, ZeRO-3 re-gathering for each backward.
        # A runtime whose FSDP2 units sync once per step (the torch runtime) runs a whole-model ZeRO-2 stage as a
        # one-stage pipeline (runtime_adapters/groups.py): it holds them too, whatever the micro-batches; a
        # whole-model ZeRO-3 stage over a DP group it runs as plain gradient accumulation, resharding and
        # reduce-scattering after each backward (torch_native._build_schedule): ZeRO-3 as priced without pipelining
        per_unit = self.q.capabilities.zero_per_unit  # FSDP2 units, gathered and synced once per step
        whole = st.has_embedding and st.has_head
        held = held_under_pipelining(zero) and (not whole or (per_unit and not (zero >= 3 and shard > 1)))
        # what the GPU stores per parameter (memory)
        kept_pb, kept_gb, kept_ob = self.kept_state_bytes(zero, off, held=held)
        # the fp32 host copy an offloaded optimizer updates: beside the state where the GPU keeps fp32 parameters (the
        # state then holds no master copy; runtime_adapters/offload.py)
        master = FP32_BYTES if off and kept_pb >= FP32_BYTES else 0.0
        copies = held_copies = (0.0, 0.0)
        if zero == 0 and self.autocast_fp32_weights:  # autocast's 16-bit copies (ZeroPart)
            gemm_weights = st.dense_params - (st.edge_params - st.head_params) + st.expert_params
            copies, held_copies = (0.0, st.head_params * pb), (gemm_weights * pb, 0.0)
        mem_zero = 1 if held else zero
        dense = model_state_bytes(st.dense_params, shard=shard, zero_stage=mem_zero, offload=off,
                                  param_bytes=kept_pb, grad_bytes=kept_gb, optimizer_bytes=kept_ob,
                                  host_master_bytes=master)
        expert = model_state_bytes(st.expert_params, shard=eshard, zero_stage=mem_zero, offload=off,
                                   param_bytes=kept_pb, grad_bytes=kept_gb, optimizer_bytes=kept_ob,
                                   host_master_bytes=master)
        c = st.collectives or self._collectives(st)
        # per micro-batch ZeRO-2/3 traffic, unit by unit, overlapped with the same pass's compute (zero_exposed_s)
        z_fwd = z_bwd = 0.0
        n_layers = max(1, st.layers[1] - st.layers[0])
        l_fwd = l_rs = l_gather = root_ag = root_rs = head_ag = head_rs = 0.0
        if zero == 2 and not held and not per_unit:
            z_bwd += c["rs_grads"]
            l_rs, root_rs, head_rs = c["rs_layer"], c["rs_root"], c["rs_head"]
        if zero >= 3 and not held:
            l_rs, root_rs, head_rs = c["rs_layer"], c["rs_root"], c["rs_head"]
            z_bwd += c["rs_grads"]
        if zero >= 3:
            gather, l_gather, root_ag, head_ag = c["ag_params"], c["ag_layer"], c["ag_root"], c["ag_head"]
            z_bwd += gather - root_ag - head_ag  # the backward finds the edges gathered (kept from the forward)
            if held:  # the forward finds the parameters the previous backward left gathered
                root_ag = head_ag = 0.0
            else:
                z_fwd += gather
                l_fwd = l_gather
        # per iteration: gradient synchronisation (ZeRO 0/1, pipelined FSDP2; ZeRO-2 re-gathers parameters) and
        # optimizer step
        sync = st.tied_sync_s
        # the runtime's per-step loss report (runtime_adapters/torch_native.py): an all-reduce over the last stage's
        # replicas and a broadcast to every rank, each right after the optimizer step: a measured wait per call
        # charges them (GroupLink.wait_s; 0 unless profiled); a lone whole-model rank sends nothing
        if st.has_head and st.dp_link is not None:
            sync += ((shard > 1) + (shard > 1 or not st.has_embedding)) * st.dp_link.wait_s
        # a runtime that overlaps its ZeRO-0/1 sync hides it bucket by bucket (dp_overlap_s adds what stays exposed)
        overlaps = self.dp_overlap != "none" and zero <= 1 and not (per_unit and zero >= 1)
        dp_reduce = ("ar" if zero == 0 else "rs") if overlaps else ""
        dp_gather = overlaps and zero == 1 and self.dp_overlap == "grads-params"
        if zero == 0:
            sync += 0.0 if dp_reduce else c["ar_grads"]
            if shard > 1 and self.q.capabilities.dp_flat_buckets:  # bucketed; experts alone on their rank: divided
                expert_passes = FLAT_BUCKET_PASSES if eshard > 1 else IN_PLACE_PASSES
                sync += kept_gb * (FLAT_BUCKET_PASSES * st.dense_params + expert_passes * st.expert_params) \
                    / self.dev.memory_bandwidth
        elif per_unit and (zero <= 2 or held):  # each unit's reduce-scatter and all-gather, once per step
            sync += n_layers * (c["rs_layer"] + c["ag_layer"]) + c["rs_edges"] + c["ag_edges"]
        elif zero == 1 or held:
            sync += (0.0 if dp_reduce else c["rs_grads"]) + (0.0 if dp_gather else c["ag_params"])
        elif zero == 2:
            sync += c["ag_params"]
        local = (st.dense_params / (shard if zero >= 1 else 1)
                 + st.expert_params / (eshard if zero >= 1 else 1))  # parameters this GPU updates
        pcie = local * (kept_gb + kept_pb) if off else 0.0
        if off:  # copy the gradients down and the parameters up over PCIe as stored, update on the host (CPU Adam)
            per_gpu_rate = CPU_ADAM_PARAMS_PER_S_PER_NODE / self.island.gpus_per_node
            opt_s = pcie / dev.host_link_bandwidth + local / per_gpu_rate
        else:  # fused Adam is memory-bound: read + write the states, read the gradient, write the parameter
            opt_s = local * (2 * ob + gb + pb) / dev.memory_bandwidth
            opt_s = max(opt_s, local * dev.optimizer_param_s)  # or the runtime's measured cost per parameter
        # FSDP2 units (the torch runtime's ZeRO 1-3 over a DP group): host work per unit beyond compute and transfers
        fsdp = per_unit and zero >= 1 and shard > 1
        host_fwd = host_bwd = 0.0
        if fsdp:
            host_fwd, host_bwd = self._fsdp_host_s(st, n_layers + 1)
            if held or zero <= 2:  # gathered and reduce-scattered once per step
                sync += host_fwd + host_bwd
                host_fwd = host_bwd = 0.0
        # plus a measured fixed cost per tensor where the device has one (torch AdamW without foreach, per tensor;
        # DTensor parameters under FSDP2 pay their own, larger one)
        opt_s += st.param_tensors * (dev.optimizer_sharded_tensor_s if fsdp and dev.optimizer_sharded_tensor_s
                                     else dev.optimizer_tensor_s)
        working = 0.0
        if zero >= 3 and not held:
            working = st.max_layer_params * (2 * pb + gb)  # gathered + prefetched layer, grads
            if st.max_edge_params > st.max_layer_params:  # the embedding or output layer is the largest
                working = st.max_edge_params * (pb + gb) + st.max_layer_params * pb  # ... with a layer prefetched
        fits_host = not off or fits_host_memory(dense.host + expert.host, self.island.host_memory)
        out = ZeroPart(dense.total + expert.total, z_fwd, z_bwd, sync, opt_s, working, dense, expert, l_fwd,
                       l_gather + l_rs, n_layers, pcie, l_rs, root_ag, root_rs, head_ag, head_rs, copies,
                       held_copies, fits_host, host_fwd, host_bwd, dp_reduce, dp_gather)
        st.zero_parts[key] = out
        return out

    def _fsdp_host_s(self, st: StageSums, units: int) -> tuple[float, float]:
        """(forward, backward) host time of a stage's ``units`` FSDP2 units per pass, from the device's measured
        overhead per unit (profiler/fsdp_unit.py) less the fixed cost of the unit's collectives, which their own
        terms charge (an all-gather in the forward; an all-gather and a reduce-scatter in the backward). A CPU
        device runs that host work itself, in series with its compute; a GPU runs ahead of it, so a unit pays only
        what exceeds its compute."""
        dev, link = self.dev, st.dp_link
        if not (dev.fsdp_unit_forward_s or dev.fsdp_unit_backward_s):
            return 0.0, 0.0
        ag0, rs0 = link.call_s(comm.ALL_GATHER, st.shard), link.call_s(comm.REDUCE_SCATTER, st.shard)
        fwd = max(0.0, dev.fsdp_unit_forward_s - ag0)
        bwd = max(0.0, dev.fsdp_unit_backward_s - ag0 - rs0)
        if not dev.is_cpu:
            fwd, bwd = max(0.0, fwd - st.fwd_s / units), max(0.0, bwd - st.bwd_s / units)
        return units * fwd, units * bwd

    def _collectives(self, st: StageSums) -> dict:
        """The stage's data-parallel collectives (dense over dp x cp, experts over dp x cp / ep), computed once."""
        gb, pb = self.training.grad_bytes, self.training.param_bytes
        out = {}
        n = max(1, st.layers[1] - st.layers[0])
        for name, op, nbytes in (("ar_grads", comm.ALL_REDUCE, gb), ("rs_grads", comm.REDUCE_SCATTER, gb),
                                 ("ag_params", comm.ALL_GATHER, pb)):
            out[name] = (comm.collective_s(op, st.dense_params * nbytes, st.shard, st.dp_link)
                         + comm.collective_s(op, st.expert_params * nbytes, st.eshard, st.edp_link))
        # ZeRO-3/FSDP: one collective per layer (its share of the layers' parameters, its own ring latency) and one
        # each for the embedding ("root") and the output layer ("head")
        layer_dense = st.dense_params - st.edge_params
        per_layer = [("rs", comm.REDUCE_SCATTER, gb), ("ag", comm.ALL_GATHER, pb)]
        if self.dp_overlap != "none":  # ZeRO-0 gradient buckets, one per layer (dp_overlap_s)
            per_layer.append(("ar", comm.ALL_REDUCE, gb))
        for name, op, nbytes in per_layer:
            out[name + "_layer"] = (comm.collective_s(op, layer_dense * nbytes / n, st.shard, st.dp_link)
                                    + comm.collective_s(op, st.expert_params * nbytes / n, st.eshard, st.edp_link))
            out[name + "_root"] = comm.collective_s(op, (st.edge_params - st.head_params) * nbytes, st.shard,
                                                    st.dp_link)
            out[name + "_head"] = comm.collective_s(op, st.head_params * nbytes, st.shard, st.dp_link)
            # FSDP2 as the torch runtime wraps a stage: the embedding and the output layer in its root unit, one call
            out[name + "_edges"] = comm.collective_s(op, st.edge_params * nbytes, st.shard, st.dp_link)
        st.collectives = out
        return out

    def _rec_part(self, st: StageSums, r: int) -> RecomputePart:
        """The stage's terms under recompute mode ``RECOMPUTE_MODES[r]``, cached on the stage."""
        hit = st.rec_parts[r]
        if hit is not None:
            return hit
        full = RECOMPUTE_MODES[r] == "full"
        rec_comm = (st.tp_fwd_s + st.cp_fwd_s + st.ep_fwd_s) if full else 0.0
        if RECOMPUTE_MODES[r] == "selective" and self.selective_policy == "op-sac-compiled":
            rec_comm = st.ep_fwd_s  # compiled MoE blocks re-run their forward, EP all-to-alls included (op_sac.py)
        working = st.max_layer_act_none if full else 0.0  # one layer's activations, rebuilt during its backward
        if RECOMPUTE_MODES[r] == "selective" and self.selective_policy in OP_SAC_POLICIES:
            working = st.max_layer_act_rebuilt_sel  # the tensors op-level SAC rebuilds for one layer's backward
        working += st.max_layer_transient  # ... and the activation gradients that backward forms
        out = RecomputePart(st.recompute_s[r], rec_comm, st.act_bytes[r] * self.fragmentation, working)
        st.rec_parts[r] = out
        return out

    def fast_stage(self, st: StageSums, zero: int, r: int, off: bool) -> StageNumbers:
        """One stage under (ZeRO stage, recompute index, offload): the parallelizers' inner loop. An offload whose
        host-side state does not fit its node's host memory gets infinite static bytes: it fits at no depth, so the
        search drops it as it drops what does not fit the GPU (ZeroPart.fits_host; the floors stay floors)."""
        return StageNumbers(*self._stage_terms(st, ((zero, r, off),), rows=False)[0])

    def fast_rows(self, st: StageSums, savers: Sequence[tuple[int, int, bool]],
                  halves: list | None = None) -> list[tuple]:
        """fast_stage under each (ZeRO stage, recompute index, offload) of ``savers``, as the rows the grid's stage
        table keeps: (forward_s + backward_s, static_bytes, activation_bytes, dp_sync_s + optimizer_s). ``halves``:
        a list that gets each combination's (forward_s, backward_s) appended, fast_stage's bit for bit (what the
        exact front reads of a stage, at no extra cost)."""
        return self._stage_terms(st, savers, rows=True, halves=halves)

    def _stage_terms(self, st: StageSums, savers: Sequence[tuple[int, int, bool]], *, rows: bool,
                     halves: list | None = None, host_limit: bool = True) -> list[tuple]:
        """fast_stage's six numbers per saver combination (``rows``: fast_rows' four), in one loop (a grid costs ~20
        combinations per stage). What one (ZeRO stage, offload) gives every recompute mode (its exposed forward,
        its per-iteration time) and what one recompute mode gives every pair (its backward without ZeRO
        collectives) are worked out once: the same float operations, in the same order. ``host_limit=False``: the
        GPU's bytes even where the offload misses the host memory (stage_numbers, which reports that apart)."""
        out = []
        fwd_s, bwd_s, fixed_fwd, fixed_bwd = st.fwd_s, st.bwd_s, st.fixed_fwd_s, st.fixed_bwd_s
        frag, overhead = self.fragmentation, self.overhead_bytes
        zero_parts, rec_parts, edges = st.zero_parts, st.rec_parts, st.edge_compute
        per_pair: dict = {}
        per_rec: dict = {}
        for zero, r, off in savers:
            pair = per_pair.get((zero, off))
            if pair is None:
                zp = zero_parts.get((zero, off)) or self._zero_part(st, zero, off)
                exposed = zp.layer_bwd_s > 0.0
                if exposed:
                    z_fwd = _exposed_fwd_s(zp, fwd_s, edges)
                    # the compute that hides the rest runs slower beside it (overlap.contention_s)
                    fwd = fwd_s + (z_fwd + overlap.contention_s(zp.zero_fwd_s, z_fwd)) + fixed_fwd
                else:
                    fwd = fwd_s + fixed_fwd
                fwd += zp.host_fwd_s
                pair = per_pair[zero, off] = (zp, exposed, fwd, zp.sync_s + zp.optimizer_s,
                                              host_limit and not zp.fits_host)
            zp, exposed, fwd, tail, over_host = pair
            rec = per_rec.get(r)
            if rec is None:
                rp = rec_parts[r] or self._rec_part(st, r)
                b = bwd_s + rp.recompute_s
                rec = per_rec[r] = (rp, b, b + fixed_bwd + rp.comm_s)
            rp, b, bwd = rec
            if exposed:
                z_bwd = _exposed_bwd_s(zp, b, edges)
                bwd = b + (z_bwd + overlap.contention_s(zp.zero_bwd_s, z_bwd)) + fixed_bwd + rp.comm_s
            bwd += zp.host_bwd_s
            sync = zp.sync_s
            if zp.dp_reduce or zp.dp_gather:  # the overlapped sync depends on the passes' compute
                sync += dp_overlap_s(zp, st.collectives, fwd_s, b, edges)
                tail = sync + zp.optimizer_s
            full = r == _FULL
            static = zp.state_bytes + zp.held_copy_bytes[full] + (zp.working_bytes + rp.working_bytes) * frag + overhead
            if over_host:
                static = math.inf
            act = rp.activation_bytes + zp.copy_bytes[full] * frag
            if rows:
                out.append((fwd + bwd, static, act, tail))
                if halves is not None:
                    halves.append((fwd, bwd))
            else:
                out.append((fwd, bwd, static, act, sync, zp.optimizer_s))
        return out

    def stage_numbers(self, st: StageSums, cfg: ParallelConfig) -> tuple[StageNumbers, dict]:
        """One stage of ``cfg`` and where its time and memory go (the breakdown ``tangram-launch estimate`` prints).
        Its static bytes are the GPU's even where an offload misses the host memory: the callers that cost a given
        configuration judge ``host_offload_bytes`` apart (host_memory.stage_host_problems), to say so."""
        r = _rec_index(cfg.recompute)
        numbers = StageNumbers(*self._stage_terms(st, ((cfg.zero_stage, r, cfg.offload),), rows=False,
                                                  host_limit=False)[0])
        zp = self._zero_part(st, cfg.zero_stage, cfg.offload)
        sync, opt_s, zworking, dense, expert = (numbers.dp_sync_s, zp.optimizer_s, zp.working_bytes, zp.dense,
                                                zp.expert)
        rp = self._rec_part(st, r)
        full = cfg.recompute == "full"
        rec_s, rworking = rp.recompute_s, rp.working_bytes
        copies = zp.copy_bytes[full] * self.fragmentation
        act = rp.activation_bytes + copies
        exposed = zero_exposed_s(zp, st.fwd_s, st.bwd_s + rec_s, st.edge_compute)
        exposed_s = sum(exposed)
        bd = {
            "compute_forward_s": st.fwd_s,
            "compute_backward_s": st.bwd_s,
            "recompute_s": rec_s,
            "tp_comm_s": st.tp_fwd_s + st.tp_bwd_s + (st.tp_fwd_s if full else 0.0),
            "cp_comm_s": st.cp_fwd_s + st.cp_bwd_s + (st.cp_fwd_s if full else 0.0),
            "ep_comm_s": st.ep_fwd_s + st.ep_bwd_s + (st.ep_fwd_s if full else 0.0),
            "zero_comm_exposed_s": exposed_s,
            "zero_contention_s": (overlap.contention_s(zp.zero_fwd_s, exposed[0])
                                  + overlap.contention_s(zp.zero_bwd_s, exposed[1])) if zp.layer_bwd_s > 0 else 0.0,
            "zero_comm_s": zp.zero_fwd_s + zp.zero_bwd_s,  # the transfers of one micro-batch, hidden or not
            "fsdp_host_s": zp.host_fwd_s + zp.host_bwd_s,  # FSDP2's host work per micro-batch (_fsdp_host_s)
            "p2p_s": st.p2p_fwd_s + st.p2p_bwd_s,
            "dp_sync_s": sync,
            "optimizer_s": opt_s,
            "parameters_bytes": dense.parameters + expert.parameters,
            "gradients_bytes": dense.gradients + expert.gradients,
            "optimizer_bytes": dense.optimizer + expert.optimizer,
            "working_bytes": (zworking + rworking) * self.fragmentation,
            "overhead_bytes": self.overhead_bytes,
            "activations_bytes": act,
            "autocast_copies_bytes": copies,  # per micro-batch, included in activations_bytes
            "autocast_held_copies_bytes": zp.held_copy_bytes[full],  # once per stage, in the static bytes
            "host_offload_bytes": dense.host + expert.host,
            "offload_pcie_bytes": zp.offload_pcie_bytes,  # per iteration (runtime_adapters/offload.py moves these)
            "forward_flops": st.fwd_flops,
            "backward_flops": 2.0 * st.fwd_flops,
            "recompute_flops": st.recompute_flops[r],
            "params_per_gpu": st.dense_params + st.expert_params,
            "dp_link": st.dp_link.describe() if st.dp_link else "",
        }
        return numbers, bd

    def check(self, cfg: ParallelConfig, *, slice_layers: bool = True, search_space: bool = True) -> list[str]:
        """Why ``cfg`` cannot run this slice on this island (shape problems; memory is judged separately).
        ``slice_layers=False`` leaves out the one check that depends on the slice (pp within its layers);
        ``search_space=False`` the one rule that narrows the planner's search rather than saying what a runtime runs
        (a stage's GPUs divide a node or are whole nodes), for a hand-written stage that may take any GPUs."""
        out = []
        if self.device_error:
            return [self.device_error]
        isl, model = self.island, self.model
        g = isl.gpus_per_node
        b = self.q.microbatch_sequences
        if cfg.num_gpus > isl.num_gpus:
            out.append(f"tp*cp*dp*pp = {cfg.num_gpus} GPUs > {isl.num_gpus} on island {isl.name}")
        if g % cfg.tp:
            out.append(f"tp={cfg.tp} must divide the {g} GPUs per node (TP stays inside a node)")
        sg = cfg.stage_gpus
        if search_space and sg % g and g % sg:
            out.append(f"a stage of {sg} GPUs must divide or be a multiple of the {g} GPUs per node")
        if b % cfg.dp:
            out.append(f"dp={cfg.dp} must divide the {b} sequences of a micro-batch")
        if model.num_heads % cfg.tp or model.num_kv_heads % cfg.tp and cfg.tp % model.num_kv_heads:
            out.append(f"tp={cfg.tp} must divide the {model.num_heads} attention heads "
                       f"({model.num_kv_heads} KV heads)")
        if cfg.cp > 1 and self.seq_len % (2 * cfg.cp):
            out.append(f"cp={cfg.cp}: seq_len {self.seq_len} must be divisible by 2*cp (load-balanced causal CP)")
        if cfg.ep > 1 and (not model.is_moe or model.num_experts % cfg.ep):
            out.append(f"ep={cfg.ep} needs an MoE model whose experts it divides")
        if model.is_moe and sg % (self.etp(cfg.tp) * cfg.ep):
            out.append(f"the expert grid etp x ep = {self.etp(cfg.tp)} x {cfg.ep} must divide the stage's {sg} GPUs")
        if slice_layers and cfg.pp > self.q.num_layers:
            out.append(f"pp={cfg.pp} exceeds the slice's {self.q.num_layers} layers")
        if self.training.global_batch % b:
            out.append(f"global batch {self.training.global_batch} is not a multiple of the micro-batch {b}")
        return out

    def plan(self, cfg: ParallelConfig, *, parallelizer: str = "") -> SlicePlan:
        """The full, explained slice plan of one configuration (SpecError if the shape is impossible)."""
        problems = self.check(cfg)
        if problems:
            raise SpecError("; ".join(problems), field="configuration", value=cfg.describe())
        sums = self.stage_sums(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep)
        return self.materialize(cfg, sums, parallelizer=parallelizer)

    def materialize(self, cfg: ParallelConfig, sums: list[StageSums], *, parallelizer: str = "") -> SlicePlan:
        mbs = self.q.microbatch_sequences // cfg.dp
        stages = []
        for st in sums:
            n, bd = self.stage_numbers(st, cfg)
            bd["has_embedding"] = st.has_embedding
            bd["has_head"] = st.has_head
            stages.append(StageCost(layers=st.layers, shape=cfg.shape(), micro_batch_size=mbs, forward_s=n.forward_s,
                                    backward_s=n.backward_s, static_bytes=n.static_bytes,
                                    activation_bytes=n.activation_bytes, dp_sync_s=n.dp_sync_s,
                                    optimizer_s=n.optimizer_s, p2p_bytes=st.p2p_bytes, breakdown=bd))
        return SlicePlan(island=self.island.name, layers=tuple(self.q.layers), stages=tuple(stages),
                         parallelizer=parallelizer)
