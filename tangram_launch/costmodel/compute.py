"""Compute time of one transformer layer (and of the embedding and head) on one GPU, per micro-batch.

FLOPs come from ``ModelSpec.layer_flops_breakdown`` (matmuls only, 2 FLOPs per multiply-accumulate; attention
causal, GQA-aware; MoE counts top-k experts). Times come from the kernels that execute them, per GPU:

    tokens per GPU   M = mbs * s / cp                        (CP shards the sequence)
    QKV projection   GEMM (M x h) @ (h x (q_dim + 2 kv_dim)/t)  (Megatron column-parallel)
    output proj.     GEMM (M x q_dim/t) @ (q_dim/t x h)          (row-parallel)
    dense FFN        (m-1) up/gate GEMMs (M x h)@(h x f/t) + down GEMM (M x f/t)@(f/t x h); m = 2 (GeLU), 3 (SwiGLU)
    MoE FFN          E/ep local experts, each M_e = (M/t) etp k ep / E routed tokens on average (balanced routing:
                     a rank's SP shard of M/t tokens, k copies, spread over the E experts, gathered from ep
                     sources and, under expert tensor parallelism etp, from the etp ranks sharing the experts),
                     the same GEMMs with the expert width / etp; router GEMM (M/t x h)@(h x E); shared experts
                     like dense. etp = t unless the runtime folds experts on a grid of their own (Megatron-core's
                     expert_tensor_parallel_size, whose default is the TP size). Where the block's input is
                     replicated over TP (DTensor TP, torchtitan; moe_dispatch.MoERuntime.replicated_tp_input) the
                     experts see the same M_e, but the router scores all M tokens and each GPU permutes the copies
                     of M etp / t of them
    attention core   Q K^T and P V: fused (FlashAttention-2) or unfused with the s x s scores through HBM
    element-wise     norms, residual adds, dropout, activation: bytes moved / memory bandwidth (memory-bound);
                     fused kernels by default, eager PyTorch's separate passes with DeviceModel.fused_elementwise off

Backward = 2 x forward (Narayanan et al. 2021, sec. 3.5: each forward GEMM has two backward GEMMs, for the input
and the weight gradient), except fused attention: FlashAttention's backward recomputes the scores and runs five
matmuls against the forward's two, 2.5 x the forward's FLOPs (Dao 2023, sec. 4.1, which counts its fwd+bwd
throughput that way, so FLASH_ATTENTION_EFFICIENCY applies to those 2.5 x). Recompute adds forward work
(Korthikanti et al. 2022, "Reducing activation recomputation in large transformer models", sec. 5): full = one
extra forward of the layer; selective = the attention core only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tangram_launch.costmodel import op_sac
from tangram_launch.costmodel.composed_activation import COMPOSED
from tangram_launch.costmodel.eager_attention import eager_score_bytes, mem_efficient_score_bytes
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.host_floor import layer_host_floor_s
from tangram_launch.costmodel.measured_layers import measured_layer_key  # noqa: F401 (re-exported: the profiler's keys)
from tangram_launch.costmodel.measured_layers import (AnalyticS, Priced, measured_points, parts_correction, price,
                                                       stage_measurement as summarize_stage)
from tangram_launch.costmodel.moe_dispatch import (DEFAULT_MOE_RUNTIME, MoERuntime, expert_gemm_rows,
                                                   permutation_traffic_h, router_traffic_bytes)
from tangram_launch.costmodel.op_sac import routed_gemms
from tangram_launch.specs.constants import RECOMPUTE_MODES  # noqa: F401 (re-exported for the cost model's users)

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.specs.model import ModelSpec

BACKWARD_FACTOR = 2.0  # backward / forward work (Narayanan et al. 2021, sec. 3.5)
FLASH_BACKWARD_FACTOR = 2.5  # fused attention's backward / forward FLOPs (Dao 2023, sec. 4.1: 5 matmuls against 2)
# Bytes moved per attention-score element by unfused attention, in units of the dtype size p, plus a 1-byte
# dropout mask: QK^T writes (p), fused scale-mask-softmax reads and writes (2p), dropout reads and writes (2p) and
# stores the mask (1), P V reads (p): 6p + 1 (Megatron-LM's unfused path; the 5 bytes Korthikanti et al. 2022 store
# per element are a subset).
SCORE_TRAFFIC_P = 6
# Element-wise traffic per token in units of h (dtype elements), besides the FFN activation: two norms (read+write:
# 4h), two bias-dropout-residual adds (read 2h + write h each: 6h), dropout masks (~1h).
ELEMENTWISE_TRAFFIC_H = 11


# Eager PyTorch runs every element-wise op as its own kernel (torchtitan's Llama without torch.compile, bytes per
# element with bf16 activations, counted from its model.py: apply_rotary_emb, repeat_kv, Attention.forward,
# FeedForward; and from the reference Llama RMSNorm, x.float() -> x * rsqrt(x.pow(2).mean(-1)) -> type_as -> * weight):
# RMSNorm makes six passes in fp32 (6 + 8 + 4 + 8 + 6 + 4 = 36 bytes per element against 4 fused); rotary embedding
# goes through complex fp32 (float(), complex multiply, type_as: 6 + 8 + 6 = 20 per q/k element); GQA's repeat_kv
# materialises K and V at the query width (read kv, write q, for each); the attention output is made contiguous
# (read + write); SwiGLU is silu then multiply (4 + 6 = 10 bytes per f element against 6 fused).
EAGER_RMSNORM_BYTES = 36
EAGER_ROTARY_BYTES = 20
EAGER_SWIGLU_BYTES = 10


def elementwise_bytes_per_token(model: "ModelSpec", layer: int, p: int, fused: bool) -> float:
    """Element-wise bytes per token of one layer outside its FFN, before TP sharding (the caller adds the FFN's:
    an MoE layer's depends on the routing). Eager PyTorch runs an MoE block's norms, rotary embedding, repeat_kv
    and residual adds as a dense block's (torchtitan's MoE models share the attention and the block structure)."""
    h = model.hidden_size
    if fused:
        return p * ELEMENTWISE_TRAFFIC_H * h
    norms = 2 * (EAGER_RMSNORM_BYTES if model.norm_type == "rmsnorm" else 2 * p) * h
    rotary = EAGER_ROTARY_BYTES * (model.q_dim + model.kv_dim) if model.position_embedding == "rotary" else 0.0
    gqa = 2 * p * (model.kv_dim + model.q_dim) if model.kv_dim < model.q_dim else 0.0
    residual = 2 * 3 * p * h
    return norms + rotary + gqa + 2 * p * model.q_dim + residual


def ffn_elementwise_bytes_per_token(model: "ModelSpec", width: float, p: int, fused: bool, *,
                                    autocast: bool = True) -> float:
    """The FFN activation's element-wise bytes per token for an FFN of ``width``; a composed activation's ops as the
    model's code runs them, one kernel each (composed_activation.py; ``autocast``: under autocast)."""
    composed = COMPOSED.get(model.activation_impl)
    if composed is not None:
        gate = 3 * p * width if model.ffn_matrices == 3 else 0.0  # a gated FFN's product: reads 2, writes 1
        return composed.traffic.bytes(p, autocast) * width + gate
    if not fused and model.ffn_matrices == 3:
        return EAGER_SWIGLU_BYTES * width
    return p * activation_traffic_f(model.ffn_matrices) * width


def activation_traffic_f(ffn_type_matrices: int) -> int:
    """Element-wise traffic of the FFN activation per unit of FFN width: GeLU reads f, writes f (2); SwiGLU reads
    gate and up, writes their product (3)."""
    return 2 if ffn_type_matrices == 2 else 3


@dataclass(frozen=True)
class LayerCompute:
    """Forward compute of one layer on one GPU for one micro-batch (no communication)."""

    kind: str
    forward_flops: float  # model FLOPs (causal attention) on this GPU
    compute_forward_s: float  # gemm_s + attention_core_s + elementwise_s (or a measured layer time)
    gemm_s: float
    attention_core_s: float  # what selective recompute repeats
    attention_core_flops: float  # executed (unfused attention computes the full s x s product)
    elementwise_s: float
    measured: bool = False
    measured_backward_s: float | None = None  # profiled forward+backward minus forward, when the profile has it
    priced: Priced | None = None  # how the measured time was found (measured_layers), None: analytic
    op_sac_recompute_s: float = 0.0  # torchtitan's op-level SAC: every second mm + all element-wise work again
    op_sac_recompute_flops: float = 0.0
    # backward beyond BACKWARD_FACTOR x forward_s: fused attention's recomputed scores (FLASH_BACKWARD_FACTOR)
    attention_backward_extra_s: float = 0.0
    # the host's time to dispatch each pass (host_floor.py): neither runs faster
    forward_floor_s: float = 0.0
    backward_floor_s: float = 0.0
    # the GEMM beside each sequence-parallel collective, in forward order, per (all-gather, reduce-scatter) pair: the
    # column-parallel GEMM that reads the gathered input, the row-parallel one whose output is reduce-scattered
    # (attention: QKV, output projection; a dense FFN: up, down; an MoE block's shared experts, else nothing); what
    # an overlapped TP collective hides under (overlap.tp_exposed_s)
    sp_gemms_s: tuple[tuple[float, float], ...] = ()

    @property
    def forward_s(self) -> float:
        return max(self.compute_forward_s, self.forward_floor_s)

    @property
    def backward_s(self) -> float:
        if self.measured_backward_s is not None:
            return max(self.measured_backward_s, self.backward_floor_s)
        return max(BACKWARD_FACTOR * self.compute_forward_s + self.attention_backward_extra_s, self.backward_floor_s)

    @property
    def backward_flops(self) -> float:
        return BACKWARD_FACTOR * self.forward_flops

    def _reruns_forward(self, mode: str, selective_policy: str) -> bool:
        """Full recompute, or op-SAC under torch.compile on an MoE block, which keeps its input only (op_sac.py)."""
        return mode == "full" or (mode == "selective" and selective_policy == "op-sac-compiled" and self.kind == "moe")

    def recompute_s(self, mode: str, selective_policy: str = "megatron") -> float:
        """Extra forward work in the backward pass (Korthikanti et al. 2022, sec. 5; op-level SAC: op_sac.py)."""
        if self._reruns_forward(mode, selective_policy):
            return self.forward_s
        if mode == "selective":
            return self.op_sac_recompute_s if selective_policy in op_sac.OP_SAC_POLICIES else self.attention_core_s
        return 0.0

    def recompute_flops(self, mode: str, selective_policy: str = "megatron") -> float:
        if self._reruns_forward(mode, selective_policy):
            return self.forward_flops
        if mode == "selective":
            return (self.op_sac_recompute_flops if selective_policy in op_sac.OP_SAC_POLICIES
                    else self.attention_core_flops)
        return 0.0


def layer_compute(model: "ModelSpec", layer: int, *, seq_len: int, mbs: int, tp: int, cp: int, ep: int,
                  dev: DeviceModel, use_measured: bool = True,
                  moe_runtime: MoERuntime = DEFAULT_MOE_RUNTIME, host_floor: bool = True,
                  autocast: bool = True) -> LayerCompute:
    """Forward compute of transformer layer ``layer`` per GPU and micro-batch (see the module docstring); where the
    profile measured the layer's kind (``use_measured``), its time comes from those measurements
    (measured_layers.price), the analytic terms only scaling them to shapes not measured. ``moe_runtime``: how the
    runtime runs the routed experts (their TP degree, dispatcher and permutation kernels; moe_dispatch.py).
    ``host_floor``: neither pass runs faster than the host dispatches it (host_floor.py); off for the analytic
    ratios that scale measured points, which the floor then bounds as it bounds the analytic time. ``autocast``:
    the layers run under autocast (a composed activation's traffic, ffn_elementwise_bytes_per_token)."""
    h = model.hidden_size
    t = tp
    p = dev.dtype_bytes
    m_tok = mbs * seq_len / cp  # M: tokens on this GPU
    mats = model.ffn_matrices
    moe = model.is_moe_layer(layer)

    qkv_s = dev.gemm_s(m_tok, (model.q_dim + 2 * model.kv_dim) / t, h)
    out_s = dev.gemm_s(m_tok, h, model.q_dim / t)
    gemm = qkv_s + out_s
    sp_gemms = [(qkv_s, out_s)]
    routed_s = routed_flops = 0.0  # the routed experts' grouped GEMMs (op-SAC recomputes them all)
    if moe:
        e, k, fe = model.num_experts, model.top_k, model.expert_ffn_hidden_size
        local_experts = e / ep
        et = moe_runtime.etp(t)
        m_e = m_tok / t * et * k * ep / e  # tokens per local expert (balanced routing)
        rows_e = expert_gemm_rows(group_tokens=m_tok / t * et * ep, top_k=k, num_experts=e, ep=ep)  # busiest rank
        for i, (n, k_in) in enumerate(routed_gemms(model, layer)):
            n_local, k_local = (n / et, k_in) if i == 0 else (n, k_in / et)  # up: column-sharded, down: row
            gemm_e = dev.gemm_s(rows_e, n_local, k_local, count=local_experts)
            gemm += gemm_e
            routed_s += gemm_e
            routed_flops += 2.0 * m_e * n_local * k_local * local_experts
        # the router on the SP-sharded tokens, or on all M where the block's input is replicated over TP
        router_share = moe_runtime.router_factor(t)
        gemm += dev.gemm_s(m_tok / t * router_share, e, h)
        permute_h = permutation_traffic_h(top_k=k, ep=ep, local_experts=local_experts,
                                          etp=et if moe_runtime.gathers_over_etp(t) else 1,
                                          dispatcher=moe_runtime.dispatcher, fused=moe_runtime.permute_fusion,
                                          combine_ratio=max(moe_runtime.combine_bytes, p) / p,
                                          weighted=moe_runtime.probs_on_output and k > 1)
        # activations + token permutation (dispatch and combine, of the tokens this GPU dispatches) + the router's
        # softmax and top-k (of the tokens it scores), per token of the SP shard
        act_traffic = ffn_elementwise_bytes_per_token(model, k * fe, p, dev.fused_elementwise,
                                                      autocast=autocast) / p  # as a dense FFN's
        ffn_traffic = (act_traffic + permute_h * h * moe_runtime.dispatch_factor(t)
                       + router_traffic_bytes(num_experts=e, top_k=k, dtype_bytes=p) / p * router_share)
        if model.num_shared_experts:
            fs = model.num_shared_experts * model.shared_expert_ffn_hidden_size
            up_s, down_s = dev.gemm_s(m_tok, (mats - 1) * fs / t, h), dev.gemm_s(m_tok, h, fs / t)
            gemm += up_s + down_s
            sp_gemms.append((up_s, down_s))
            ffn_traffic += ffn_elementwise_bytes_per_token(model, fs, p, dev.fused_elementwise,
                                                           autocast=autocast) / p
    else:
        f = model.ffn_hidden_size
        up_s, down_s = dev.gemm_s(m_tok, (mats - 1) * f / t, h), dev.gemm_s(m_tok, h, f / t)
        gemm += up_s + down_s
        sp_gemms.append((up_s, down_s))
        ffn_traffic = ffn_elementwise_bytes_per_token(model, f, p, dev.fused_elementwise,
                                                      autocast=autocast) / p

    # Attention core per GPU: heads are split by TP, queries by CP (each query chunk meets all keys in the ring).
    attn_bwd_extra_s = 0.0
    if dev.flash_attention:
        core_flops = model.layer_flops_breakdown(layer, seq_len, causal=True)["attention"] * m_tok / t
        # the kernel runs on this GPU's query chunk: under CP each ring step is an (s/cp x s/cp) block
        core_s = core_flops / dev.attention_flops_per_s(seq_len / cp, model.head_dim)
        attn_bwd_extra_s = (FLASH_BACKWARD_FACTOR - BACKWARD_FACTOR) * core_s
    else:  # unfused: the full s x s product is computed, then masked
        core_flops = model.layer_flops_breakdown(layer, seq_len, causal=False)["attention"] * m_tok / t
        scores = mbs * (model.num_heads / t) * (seq_len / cp) * seq_len
        # Megatron's fused scale-mask-softmax, its backward BACKWARD_FACTOR x the forward
        score_fwd = SCORE_TRAFFIC_P * p + 1
        score_bwd = BACKWARD_FACTOR * score_fwd
        if dev.eager_attention:  # eager PyTorch: a kernel per op, softmax in fp32 under autocast
            score_fwd, score_bwd = eager_score_bytes(p, autocast=autocast, dropout=bool(model.dropout))
        elif dev.mem_efficient_attention:  # SDPA's memory-efficient kernel: the unfused attention's time
            score_fwd, score_bwd = mem_efficient_score_bytes(p, dropout=bool(model.dropout))
        core_s = core_flops / dev.gemm_flops + dev.memory_s(scores * score_fwd)
        attn_bwd_extra_s = dev.memory_s(scores * (score_bwd - BACKWARD_FACTOR * score_fwd))  # 0 unless eager

    per_token = elementwise_bytes_per_token(model, layer, p, dev.fused_elementwise) + p * ffn_traffic
    elementwise_s = dev.memory_s(per_token * m_tok / t)
    model_flops = model.layer_forward_flops_per_token(layer, seq_len, causal=True) * m_tok / t
    forward_s = gemm + core_s + elementwise_s

    sac_s, sac_flops = _op_sac_recompute(model, layer, m_tok, t, dev)
    sac_s += elementwise_s + routed_s
    sac_flops += routed_flops
    priced = None
    if use_measured and cp == 1:
        priced = measured_layer_price(model, model.layer_kind(layer), seq_len=seq_len, mbs=mbs, tp=tp, dev=dev,
                                      analytic_s=lambda s, b, t: layer_compute(
                                          model, layer, seq_len=s, mbs=b, tp=t, cp=1, ep=ep, dev=dev,
                                          use_measured=False, moe_runtime=moe_runtime, host_floor=False).forward_s)
    if priced is not None and forward_s > 0:  # the measured layer's GEMMs, in the analytic proportions
        sp_gemms = [(a * priced.forward_s / forward_s, b * priced.forward_s / forward_s) for a, b in sp_gemms]
    if priced is not None:
        # The measured backward (priced.backward_s) replaces the 2x rule where the profile has it: on CPUs and small
        # shapes the backward costs 3-3.5x the forward (benchmarks/bench_hetero_cpu.py), not 2x. Without it, the
        # backward keeps the analytic backward/forward ratio.
        attn_bwd_extra_s *= priced.forward_s / forward_s if forward_s > 0 else 0.0
        forward_s = priced.forward_s
    floor_fwd, floor_bwd = layer_host_floor_s(model, layer, dev.host_op_s if host_floor else 0.0, tp=tp, ep=ep)
    return LayerCompute(kind=model.layer_kind(layer), forward_flops=model_flops, compute_forward_s=forward_s,
                        gemm_s=gemm, attention_core_s=core_s, attention_core_flops=core_flops,
                        elementwise_s=elementwise_s,
                        measured=priced is not None, measured_backward_s=priced.backward_s if priced else None,
                        priced=priced, op_sac_recompute_s=sac_s, op_sac_recompute_flops=sac_flops,
                        attention_backward_extra_s=attn_bwd_extra_s, forward_floor_s=floor_fwd,
                        backward_floor_s=floor_bwd, sp_gemms_s=tuple(sp_gemms))


def _op_sac_recompute(model: "ModelSpec", layer: int, m_tok: float, t: int, dev: DeviceModel) -> tuple[float, float]:
    """GEMM time and FLOPs of the aten.mm calls torchtitan's op-level SAC recomputes: the 2nd, 4th, ... of the block
    in forward order (op_sac.block_mms; column-parallel outputs and row-parallel inputs sharded by TP). The routed
    experts' grouped GEMMs, all recomputed, are added by layer_compute."""
    time_s = flops = 0.0
    for mm in op_sac.block_mms(model, layer):
        if not mm.saved:
            n, k = (mm.out_width / t, mm.in_width) if mm.column else (mm.out_width, mm.in_width / t)
            time_s += dev.gemm_s(m_tok, n, k)
            flops += 2.0 * m_tok * n * k
    return time_s, flops


@dataclass(frozen=True)
class EdgeCompute:
    """Embedding (first stage) or head (last stage) forward compute per GPU and micro-batch."""

    forward_flops: float
    forward_s: float
    measured_backward_s: float | None = None  # profiled forward+backward minus forward, when the profile has it
    priced: Priced | None = None  # how the measured time was found (measured_layers), None: analytic

    @property
    def backward_s(self) -> float:
        if self.measured_backward_s is not None:
            return self.measured_backward_s
        return BACKWARD_FACTOR * self.forward_s


def measured_layer_price(model: "ModelSpec", kind: str, *, seq_len: int, mbs: int, tp: int, dev: DeviceModel,
                         analytic_s: AnalyticS) -> Priced | None:
    """A layer kind's (or the embedding's, or the head's: ``profiler.layer.EDGE_KINDS``) time from the profile's
    measurements of it on this GPU (measured_layers.price), None where it has none. At small shapes their cost is
    per-operator overhead that bytes and FLOPs do not see (tiny-moe on a CPU: the embedding and head 0.5 ms
    forward+backward per micro-batch against ~0.15 ms)."""
    if not dev.measured_layer_forward_s:
        return None
    points = measured_points(dev.measured_layer_forward_s, dev.measured_layer_forward_backward_s, model.name, kind)
    priced = price(points, seq_len=seq_len, mbs=mbs, tp=tp, analytic_s=analytic_s) if points else None
    # parts the stage-like sequence ran faster than their sum: corrected by that ratio (measured_layers)
    correction = parts_correction({"layer_forward_s": dev.measured_layer_forward_s, **dev.measured_sequence}, mbs)
    if priced is None or correction == 1.0:
        return priced
    return dataclasses.replace(priced, forward_s=priced.forward_s * correction,
                               backward_s=None if priced.backward_s is None else priced.backward_s * correction)


def _edge(model: "ModelSpec", kind: str, flops: float, analytic: AnalyticS, *,
          seq_len: int, mbs: int, tp: int, cp: int, dev: DeviceModel, use_measured: bool) -> EdgeCompute:
    """The embedding's or head's EdgeCompute: measured where the profile has the kind and ``cp`` is 1 (the profiler
    times the whole sequence on one device), else analytic."""
    priced = None
    if use_measured and cp == 1:
        priced = measured_layer_price(model, kind, seq_len=seq_len, mbs=mbs, tp=tp, dev=dev, analytic_s=analytic)
    if priced is None:
        return EdgeCompute(flops, analytic(seq_len, mbs, tp))
    return EdgeCompute(flops, priced.forward_s, priced.backward_s, priced)


def embedding_compute(model: "ModelSpec", *, seq_len: int, mbs: int, tp: int, cp: int,
                      dev: DeviceModel, use_measured: bool = True) -> EdgeCompute:
    """Lookup (writes M x h) plus OPT's project_in GEMM; vocab-parallel lookups all-reduce (see communication)."""
    def analytic(s: int, b: int, t: int) -> float:
        m_tok = b * s / cp
        out = dev.memory_s(dev.dtype_bytes * 2 * model.hidden_size * m_tok / t)  # read rows, write output (+ pos.)
        if model.embedding_dim != model.hidden_size:
            out += dev.gemm_s(m_tok, model.hidden_size / t, model.embedding_dim)
        return out

    flops = model.embedding_forward_flops_per_token() * (mbs * seq_len / cp) / tp
    return _edge(model, "embedding", flops, analytic, seq_len=seq_len, mbs=mbs, tp=tp, cp=cp, dev=dev,
                 use_measured=use_measured)


def head_compute(model: "ModelSpec", *, seq_len: int, mbs: int, tp: int, cp: int, dev: DeviceModel,
                 use_measured: bool = True) -> EdgeCompute:
    """Final norm, logits GEMM (vocab-parallel: (M x e) @ (e x V/t)) and fp32 cross-entropy (memory-bound: read the
    logits, write fp32 softmax, read it back: ~3 x 4 bytes per logit)."""
    e = model.embedding_dim

    def analytic(s: int, b: int, t: int) -> float:
        m_tok = b * s / cp
        out = dev.gemm_s(m_tok, model.vocab_size / t, e)
        out += dev.memory_s(12.0 * model.vocab_size / t * m_tok)
        out += dev.memory_s(dev.dtype_bytes * 2 * model.hidden_size * m_tok / t)  # final norm
        if e != model.hidden_size:
            out += dev.gemm_s(m_tok, e / t, model.hidden_size)
        return out

    flops = model.head_forward_flops_per_token() * (mbs * seq_len / cp) / tp
    return _edge(model, "head", flops, analytic, seq_len=seq_len, mbs=mbs, tp=tp, cp=cp, dev=dev,
                 use_measured=use_measured)


def stage_measurement(model: "ModelSpec", layers: tuple[int, int], *, has_embedding: bool, has_head: bool,
                      seq_len: int, mbs: int, tp: int, cp: int, ep: int, dev: DeviceModel) -> dict | None:
    """What a plan records about a stage priced from measured layer times (measured_layers.stage_measurement):
    which of its layer kinds, embedding and head were, how, and how far from a measured shape; None where the
    GPU has no measured layer times (plans without a profile stay as they were)."""
    if not dev.measured_layer_forward_s:
        return None
    kw = dict(seq_len=seq_len, mbs=mbs, tp=tp, cp=cp, dev=dev)
    first = {model.layer_kind(i): i for i in reversed(range(*layers))}
    parts = {kind: layer_compute(model, i, ep=ep, **kw).priced for kind, i in first.items()}
    if has_embedding:
        parts["embedding"] = embedding_compute(model, **kw).priced
    if has_head:
        parts["head"] = head_compute(model, **kw).priced
    return summarize_stage(parts)


def layer_param_tensors(model: "ModelSpec", layer: int, *, ep: int = 1) -> float:
    """Parameter tensors of one transformer layer on one GPU (routed experts: E / ep of them), laid out as the torch
    runtime's GPT holds them (runtime_adapters/gpt.py: separate q/k/v, gate/up/down, a weight and a bias each).
    Why count them: an optimizer without foreach pays a fixed cost per tensor (``DeviceModel.optimizer_tensor_s``).
    TP shards tensors without changing their number."""
    lin = 2 if model.linear_bias else 1  # a Linear's weight (+ bias)
    norm = 2 if model.norm_type != "rmsnorm" and model.norm_bias else 1
    qkv = 2 if (model.linear_bias or model.qkv_bias) else 1
    n = 2 * norm + 3 * qkv + lin + (2 * norm if model.qk_norm else 0)  # norms, q/k/v, output projection, qk-norms
    ffn = model.ffn_matrices * lin
    if model.is_moe_layer(layer):
        n += (2 if model.router_bias else 1) + model.num_experts / ep * ffn + model.num_shared_experts * ffn
        n += 1 if model.shared_expert_gate else 0
    else:
        n += ffn
    return float(n)


def edge_param_tensors(model: "ModelSpec", *, has_embedding: bool, has_head: bool) -> float:
    """Parameter tensors of the embedding and head a stage holds (a tied output weight in the embedding's stage is
    the embedding's tensor, not another one)."""
    n = 0
    if has_embedding:
        n += 1 + (model.position_embedding == "learned") + (model.embedding_dim != model.hidden_size)
    if has_head:
        norm = 2 if model.norm_type != "rmsnorm" and model.norm_bias else 1
        n += (norm if model.final_norm else 0) + (model.embedding_dim != model.hidden_size)
        n += 0 if (model.tied_embeddings and has_embedding) else 1
    return float(n)
