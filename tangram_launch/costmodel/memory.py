"""Memory per GPU: model states by ZeRO stage, activations by recompute mode and sharding, fixed overheads.

Model states (Rajbhandari et al. 2020, "ZeRO: memory optimizations toward training trillion parameter models",
sec. 3.1 and 5): per parameter 2 bytes (fp16/bf16 weights) + 2 bytes (gradients) + K = 12 bytes (fp32 master
weights, Adam momentum and variance); TrainingSpec carries the three sizes (Megatron's default keeps fp32 main
gradients: 4 bytes). ZeRO stage 1 shards the optimizer state over the data-parallel group, stage 2 also the
gradients, stage 3 also the parameters: (2 + 2 + K) Psi -> 2 Psi + 2 Psi + K Psi / N_d -> 2 Psi + (2 + K) Psi / N_d
-> (2 + 2 + K) Psi / N_d. Offload is optimizer offload (Ren et al. 2021, "ZeRO-Offload"), as the torch runtime runs
it (runtime_adapters/offload.py): the optimizer state and the update on the host; parameters and gradients stay on
the GPU under their ZeRO sharding (ZeRO-Infinity's parameter and gradient offload is not modelled: no runtime here
runs it).

What a runtime stores per parameter differs from the paper's mixed-precision layout (MODEL_STATE_KINDS,
state_bytes_per_param); what it communicates is apart from it (all-gathers in the compute dtype, reductions in the
gradient dtype), so a runtime's storage kind changes memory only.

Activations (Korthikanti et al. 2022, "Reducing activation recomputation in large transformer models", sec. 4,
Table 2), per layer and micro-batch, 16-bit activations and 1-byte dropout masks::

    no recompute, no parallelism       s b h (34 + 5 a s / h)
    tensor + sequence parallel (t)     s b h (34 + 5 a s / h) / t
    selective recompute, TP + SP       34 s b h / t        (the attention core, 5 a s^2 b, is recomputed)
    full recompute                     2 s b h (/ t with SP): only the layer input is kept

The 34 is a sum over tensors, which this module keeps term by term so that it adapts to other layers:
attention 11 (QKV input 2, Q and K 4, V 2, output-projection input 2, dropout mask 1) -> with GQA, Q is q_dim and
K, V are kv_dim wide; MLP 19 (input 2, first GEMM output 8, GeLU output 8, mask 1) -> SwiGLU stores gate, up and
their product (3 x 2 f); MoE stores the router probabilities (fp32) and, for each of the top-k copies of a token,
the permuted input and the expert's intermediates, and the expert's output where the combine weights it by the
routing probability (moe_dispatch.MoERuntime.probs_on_output); norms 4 (two inputs). FlashAttention (Ampere and newer)
never materialises the s x s scores: it keeps only the log-sum-exp (fp32 per head and token), so selective recompute
saves nothing there. Sequence parallelism is assumed whenever t > 1 (Megatron's recommended setting) unless the
caller says the runtime runs TP without it: then the norms' and dropouts' tensors and the inputs of the column-parallel
GEMMs are kept whole on every TP rank (Korthikanti's 10 s b h of the 34, Table 2 row "tensor parallel"). Context
parallelism shards the tokens (s / cp per GPU), while each query chunk still meets all s keys.

DTensor tensor parallelism (torch.distributed.tensor.parallel, torchtitan's plan) runs sequence parallelism for the
norms but hands each column-parallel GEMM the all-gathered input: PrepareModuleInput(Shard(1) -> Replicate()) on the
attention and on the feed-forward module, whose wq/wk/wv and w1/w3 Linears save that whole tensor for their weight
gradient, and the output layer's ColwiseParallel(input_layouts=Shard(1)) likewise. Megatron saves the sharded
tensor and all-gathers it again in the backward. With ``whole_column_inputs`` the attention's and the MLP's inputs
(2 g h per token) and the output layer's input (p h) are kept whole on every TP rank.

FP8 GEMM inputs: Transformer Engine, the FP8 path of Megatron (and of this project's Megatron runtime), keeps the input
of each FP8 GEMM in FP8 for the weight gradient (its Linear saves the FP8 cast of the input, its LayerNormLinear the
FP8 normalised output beside the 16-bit norm input): the inputs of the QKV, output-projection, first FFN and down
GEMMs then take 1 byte an element instead of p, while the norms' inputs, Q, K, V and the up/gate outputs stay 16-bit.
torchao's Float8Linear (torchtitan) saves its 16-bit inputs and casts again in the backward: no saving there.

Selective recompute has two policies (SELECTIVE_POLICIES): Megatron's (Korthikanti sec. 4.3: recompute the attention
core only) and torchtitan's op-level selective activation checkpointing ("op-sac", torchtitan
torchtitan/parallelisms/parallelize_llama.py, Dec. 2024: a torch.utils.checkpoint policy per transformer block that
saves the outputs of aten.mm except every second mm of the block, and of the scaled-dot-product-attention kernels;
everything else -- norms, rotary embedding, activation function, the routed experts' grouped GEMMs -- is recomputed
from the block's input); "op-sac-compiled" is the same under torch.compile, where an MoE block keeps its input only
(op_sac.py).

Backward working set: beside what a layer kept (or rebuilt under recompute), its backward holds the activation
gradients it forms, an op's output gradient beside its inputs' (layer_backward_transient_bytes): at the MLP's
activation m f a token, for a routed MoE layer k copies of h-wide rows and their all-to-all buffer. On the stage that
computes the loss these reuse the blocks the loss freed first, and add only beyond them.

Composed activations (ModelSpec.activation_impl): a GELU written as separate tensor ops keeps each op's operands
for the backward where one kernel keeps its input; the bytes per FFN element beyond the kernel's input are
composed_activation.py's (composed_activation_saved_bytes).

Measured: where the cluster's profile has the bytes autograd saved for a layer kind (``layer_activation_bytes`` in a
GPU's measured figures, written by ``profile --model``: one micro-batch, no recompute, the TP shard on one device with
the whole sequence), the layer's kept bytes without and with selective recompute are the analytic ones times the
measured-over-analytic ratio at that shape (measured_activation_factor); what the analytic model does not see --
eager kernels' extra saved tensors, upcasts, rotary tables -- is kept under selective recompute as well. Full
recompute keeps the layer input only, which needs no measurement.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from tangram_launch.costmodel import op_sac
from tangram_launch.costmodel.composed_activation import COMPOSED
# FP32_BYTES and MASK_BYTES are defined once, in eager_attention (which this module imports)
from tangram_launch.costmodel.eager_attention import FP32_BYTES, MASK_BYTES, eager_score_saved_bytes
from tangram_launch.costmodel.efficiency import GIB
from tangram_launch.costmodel.measured_layers import measured_points, price
from tangram_launch.costmodel.moe_dispatch import DEFAULT_MOE_RUNTIME, MoERuntime
from tangram_launch.costmodel.op_sac import OP_SAC_POLICIES

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.specs.model import ModelSpec

# Fixed per-GPU overhead outside the allocator's view of tensors (so outside torch.cuda.max_memory_reserved, inside
# nvidia-smi's figure): the CUDA context with cuBLAS/cuDNN handles and workspaces (~0.4-0.6 GiB under CUDA 12 with
# lazy module loading) plus NCCL communicator buffers (NCCL_BUFFSIZE 4 MiB x channels x peers). Measured: 544 MB for
# a 2-GPU and 688 MB for a 3-4 GPU communicator on NVLink A100s (NVIDIA/nccl issue 964), "more communicators = more
# memory", linear in the channels (issue 986). Counting 0.6 GiB per communicator a GPU uses was tried (issue 13):
# memory error 23.2 -> 22.7 % on the published runs, while 16 GB V100 pipelines lost their interleaved option;
# one flat figure is kept.
RUNTIME_OVERHEAD_BYTES = 1.0 * GIB
# PyTorch's caching allocator rounds and splits blocks; activations, allocated and freed every micro-batch, fragment
# (ZeRO-R, Rajbhandari et al. 2020 sec. 6.3, reports OOMs with >30 % free in extreme cases; 5-10 % is common).
FRAGMENTATION_FRACTION = 0.05
SELECTIVE_POLICIES = ("megatron",) + OP_SAC_POLICIES  # what selective recompute saves (module docstring)
# The loss's implementation (head_activation_bytes): what one logit costs at the loss's peak, the start of its backward,
# as the caching allocator holds it (cross_entropy_bytes_per_logit = allocated + stranded).
#   fused           Megatron's vocab-parallel loss (megatron/core/tensor_parallel/cross_entropy.py, the same in
#                   Megatron-LM's and Megatron-DeepSpeed's mpu): calculate_logits_max upcasts the 16-bit logits
#                   (`.float()`, 4 bytes) beside them (p); max subtraction, exp and the division by the sum run in
#                   place, so the fp32 softmax saved for the backward is that copy, and the backward forms the
#                   gradient in place of the softmax; the cast back to the logits' dtype (p) reuses the block the
#                   16-bit logits, freed after the forward, left: p + 4 bytes (4 in fp32, where `.float()` is the
#                   logits themselves).
#   eager           eager PyTorch F.cross_entropy over fp32 logits (log_softmax + nll_loss on logits.float();
#                   torchtitan's loss): the saved fp32 log-softmax output, the fp32 gradient nll_loss hands back and
#                   the fp32 gradient log_softmax's backward writes (the logits themselves are freed after the
#                   forward): 12 bytes allocated. The caching allocator reuses a freed block only for a request it
#                   can hold, and never merges blocks of different segments: torchtitan frees the 16-bit logits
#                   (`del pred`) before the backward, whose fp32 gradients (4 bytes per logit each) do not fit in
#                   their block, so it stays cached beside them, p more bytes reserved (none in fp32, where the
#                   upcast is the logits themselves and every block is the same size). A trainer that keeps 16-bit
#                   logits alive through the backward holds the same p bytes as a live tensor: 12 + p either way.
#   eager-16bit     the same F.cross_entropy on the 16-bit logits, not upcast (NeMo AutoModel's MaskedCrossEntropy
#                   with fp32_upcast off): the same three tensors in the logits' dtype, 3 p bytes.
#   flash-xentropy  flash-attn's CUDA cross-entropy (flash_attn.losses.cross_entropy, the default loss of
#                   llm-foundry's MPT): it saves the logits themselves (plus one fp32 log-sum-exp per token) and its
#                   backward writes a gradient of the logits' dtype beside them (inplace_backward off): 2 p bytes.
#   compiled        the eager loss under torch.compile (torchtitan from 2025 compiles its loss function with the
#                   model): AOTAutograd's min-cut partitioner saves the cheapest tensors the backward can recompute
#                   the rest from -- the 16-bit logits (the graph's input) and the per-token max and sum (reductions
#                   are not recomputed) -- instead of the fp32 log-softmax; Inductor fuses the upcast, the softmax and
#                   the one-hot scatter of nll_loss's gradient (a scatter onto zeros becomes a pointwise select) into
#                   kernels that write only the gradient in the logits' dtype: 2 p bytes. Over vocab-parallel
#                   logits (TP > 1: torchtitan's ColwiseParallel output layer with Shard(-1) under DTensor's
#                   loss_parallel) it holds what the eager loss holds (loss_as_run).
CROSS_ENTROPY_KINDS = ("fused", "eager", "eager-16bit", "flash-xentropy", "compiled")
EAGER_CROSS_ENTROPY_BYTES_PER_LOGIT = 12.0


def loss_as_run(cross_entropy: str, tp: int) -> str:
    """The implementation the loss runs as on logits split ``tp`` ways over the vocabulary.

    DTensor's loss parallel (torch.distributed.tensor.parallel.loss_parallel, pytorch/pytorch PR 119877: "run both
    aten.log_softmax and aten.nll_loss_forward with multiple all-reduce collectives in the middle") replaces the
    log-softmax and NLL ops of a vocabulary-sharded DTensor, forward and backward, by handlers that compute each
    op's local result as a tensor of its own: the fp32 log-softmax output saved for the backward and the fp32
    gradients, as the eager loss does, with all-reduces of the per-token max and sum between them. What the
    compiled loss saves, fusing the upcast, the softmax and the gradient into kernels that write only the 16-bit
    gradient, needs the ops in one graph over a plain tensor; across the handlers' collectives the loss holds the
    eager loss's bytes per local logit. The development row ttnotes-h200-qwen3-30b-tp4-ep2-etp4-sac's source
    (torchtitan compiled, TP 4, loss parallel) measured its memory at two local batch sizes: the step per sample
    is of the eager loss's size, not the fused one's (tests/test_costmodel_memory_physics.py)."""
    return "eager" if cross_entropy == "compiled" and tp > 1 else cross_entropy


def cross_entropy_allocated_bytes_per_logit(cross_entropy: str, dtype_bytes: float) -> float:
    """Bytes of live tensors per logit at the loss's peak under implementation ``cross_entropy``
    (CROSS_ENTROPY_KINDS)."""
    if cross_entropy == "fused":
        return dtype_bytes + FP32_BYTES if dtype_bytes < FP32_BYTES else FP32_BYTES
    if cross_entropy == "eager":
        return EAGER_CROSS_ENTROPY_BYTES_PER_LOGIT
    if cross_entropy == "eager-16bit":
        return 3.0 * dtype_bytes
    if cross_entropy in ("flash-xentropy", "compiled"):
        return 2.0 * dtype_bytes
    raise ValueError(f"cross_entropy {cross_entropy!r} (known: {', '.join(CROSS_ENTROPY_KINDS)})")


def cross_entropy_stranded_bytes_per_logit(cross_entropy: str, dtype_bytes: float) -> float:
    """Bytes per logit the caching allocator keeps reserved at the loss's peak beyond the live tensors: the freed
    16-bit logits' block, too small for the eager loss's fp32 gradients (comment above CROSS_ENTROPY_KINDS)."""
    return dtype_bytes if cross_entropy == "eager" and dtype_bytes < FP32_BYTES else 0.0


def cross_entropy_bytes_per_logit(cross_entropy: str, dtype_bytes: float) -> float:
    """Bytes one logit holds at the loss's peak under implementation ``cross_entropy`` (CROSS_ENTROPY_KINDS), as the
    caching allocator reserves them: the live tensors plus the block the allocator cannot reuse."""
    return (cross_entropy_allocated_bytes_per_logit(cross_entropy, dtype_bytes)
            + cross_entropy_stranded_bytes_per_logit(cross_entropy, dtype_bytes))


def korthikanti_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, recompute: str = "none",
                                 sequence_parallel: bool = True) -> float:
    """Korthikanti et al. 2022, Table 2 (GPT layer, 4h GeLU MLP, 16-bit activations): the reference formulas."""
    if recompute == "full":
        return 2.0 * s * b * h / (t if sequence_parallel else 1)
    scores = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sequence_parallel or t == 1:
        return s * b * h * (34.0 + scores) / t
    return s * b * h * (10.0 + 24.0 / t + scores / t)


def composed_activation_saved_bytes(activation_impl: str, dtype_bytes: int, *, autocast: bool = True) -> float:
    """Bytes per FFN element that a composed activation keeps beyond a one-kernel activation (composed_activation.py):
    ``autocast`` says the layers run under autocast (16-bit plans of this project's runtimes and of AMP trainers),
    where ops of autocast's fp32 list (pow) keep fp32 copies."""
    row = COMPOSED.get(activation_impl)
    return 0.0 if row is None else row.saved.bytes(dtype_bytes, autocast)


def _ffn_activation_bytes(model: "ModelSpec", width: int, p: int, g: float | None = None,
                          composed: float = 0.0) -> float:
    """Per token: the outputs of the (m-1) up/gate GEMMs (p bytes) and the activation output, the down GEMM's input
    (g bytes: p, or 1 where the runtime keeps FP8 GEMM inputs in FP8); ``composed``: what a composed activation keeps
    beyond that, per element (composed_activation_saved_bytes)."""
    return p * (model.ffn_matrices - 1) * width + (p if g is None else g) * width + composed * width


def gemm_input_bytes(dtype_bytes: int, fp8_gemm_inputs: bool) -> int:
    """Bytes per element of a GEMM input kept for the weight gradient (module docstring: FP8 GEMM inputs)."""
    return 1 if fp8_gemm_inputs else dtype_bytes


def layer_activation_bytes_per_token(model: "ModelSpec", layer: int, *, seq_len: int, recompute: str, flash: bool,
                                     dtype_bytes: int = 2, fp8_gemm_inputs: bool = False,
                                     probs_on_output: bool = True, autocast: bool = True,
                                     eager_attention: bool = False) -> tuple[float, float]:
    """Bytes per token of layer ``layer`` kept for backward, split as (token-local, score) parts before sharding.

    The score part (unfused attention only) is (2p + 1) bytes per head and key: softmax output, dropout mask and
    dropout output (Korthikanti's 5 a s with p = 2). ``fp8_gemm_inputs``: the inputs of the QKV, output-projection,
    first and down GEMMs are kept in FP8 (module docstring); a flash kernel without recompute still keeps its own
    16-bit output for its backward beside the projection's FP8 copy. ``autocast``: how a composed activation keeps
    its operands (composed_activation_saved_bytes). ``eager_attention``: unfused attention runs as eager PyTorch's
    separate kernels, which under 16-bit autocast keep softmax's output in fp32 (eager_attention.py).
    """
    p = dtype_bytes
    g = gemm_input_bytes(p, fp8_gemm_inputs)
    h = model.hidden_size
    if recompute == "full":
        return p * h, 0.0
    c = composed_activation_saved_bytes(model.activation_impl, p, autocast=autocast)
    mask = MASK_BYTES if model.dropout else 0  # no dropout, no masks (Llama-style models)
    out_proj = g * model.q_dim + (p * model.q_dim if fp8_gemm_inputs and flash and recompute == "none" else 0)
    attn = g * h + p * (model.q_dim + 2 * model.kv_dim) + out_proj + mask * h
    norms = 2 * p * h
    if model.is_moe_layer(layer):
        k = model.top_k
        mlp = p * h + mask * h + 4 * model.num_experts  # input, mask, router probabilities (fp32)
        mlp += k * (g * h + _ffn_activation_bytes(model, model.expert_ffn_hidden_size, p, g, c))
        if probs_on_output and k > 1:  # the weighted combine keeps each copy's expert output (MoERuntime)
            mlp += k * p * h
        if model.num_shared_experts:
            width = model.num_shared_experts * model.shared_expert_ffn_hidden_size
            mlp += _ffn_activation_bytes(model, width, p, g, c)
    else:
        mlp = g * h + _ffn_activation_bytes(model, model.ffn_hidden_size, p, g, c) + mask * h
    if flash:
        attn += 4 * model.num_heads  # log-sum-exp statistics, fp32
        scores = 0.0
    else:
        # softmax output (+ dropout mask and output); eager attention under autocast keeps softmax's fp32 output
        per_score = eager_score_saved_bytes(p, autocast=autocast and eager_attention, dropout=bool(model.dropout))
        scores = 0.0 if recompute == "selective" else per_score * model.num_heads * seq_len
    return attn + mlp + norms, scores


def tp_replicated_bytes_per_token(model: "ModelSpec", layer: int, *, recompute: str, dtype_bytes: int = 2,
                                  fp8_gemm_inputs: bool = False) -> float:
    """Bytes per token of a layer's kept activations that TP without sequence parallelism keeps whole on every TP
    rank: the layer input (full recompute), else the two norms' inputs, the inputs of the QKV and first FFN GEMMs and
    the two dropout masks (Korthikanti et al. 2022, Table 2: the 10 s b h not divided by t)."""
    p, h = dtype_bytes, model.hidden_size
    if recompute == "full":
        return p * h
    mask = MASK_BYTES if model.dropout else 0
    return 2 * p * h + 2 * gemm_input_bytes(p, fp8_gemm_inputs) * h + 2 * mask * h


def op_sac_bytes_per_token(model: "ModelSpec", layer: int, *, dtype_bytes: int = 2,
                           sequence_parallel: bool = True) -> tuple[float, float]:
    """Bytes per token a layer keeps under torchtitan's op-level SAC, split as (divided by TP, not divided by TP).

    The block's aten.mm calls in forward order (op_sac.block_mms: torchtitan's Llama wq, wk, wv, wo, then w1, w3, w2
    -- GeLU: w1, w2; an MoE block's router gate and shared experts after wo): the 1st, 3rd, 5th, ... outputs are
    saved, the 2nd, 4th, ... recomputed. Column-parallel outputs (wq, wk, wv, w1, w3) are sharded by TP; row-parallel
    ones (wo, w2, the replicated router gate) are saved whole on every rank. The routed experts' grouped GEMMs
    (torch._grouped_mm, outside the save list) keep nothing. The attention kernel keeps its output and fp32
    log-sum-exp; the checkpoint keeps the block input (sharded by SP).
    """
    p, h = dtype_bytes, model.hidden_size
    sharded = p * model.q_dim + 4 * model.num_heads  # attention output + log-sum-exp
    whole = 0.0
    for mm in op_sac.block_mms(model, layer):
        if mm.saved:
            if mm.column:
                sharded += p * mm.out_width
            else:
                whole += p * mm.out_width
    if sequence_parallel:
        sharded += p * h
    else:
        whole += p * h
    return sharded, whole


def layer_activation_bytes(model: "ModelSpec", layer: int, *, seq_len: int, mbs: int, tp: int = 1, cp: int = 1,
                           recompute: str = "none", flash: bool = False, dtype_bytes: int = 2,
                           sequence_parallel: bool = True, selective_policy: str = "megatron",
                           fp8_gemm_inputs: bool = False, whole_column_inputs: bool = False,
                           moe_runtime: MoERuntime = DEFAULT_MOE_RUNTIME, autocast: bool = True,
                           eager_attention: bool = False) -> float:
    """Activation bytes of one layer for one in-flight micro-batch on one GPU (CP-sharded tokens; TP with SP unless
    ``sequence_parallel`` is off; selective recompute as ``selective_policy`` says; GEMM inputs in FP8 where
    ``fp8_gemm_inputs``: Megatron's selective recompute only, op-level SAC is torchtitan's, whose FP8 keeps them
    in 16 bit; the column-parallel GEMMs' inputs whole under SP where ``whole_column_inputs``, module docstring:
    DTensor; op-level SAC recomputes them from the block input). ``moe_runtime``: how the routed experts run
    (their TP degree: expert_gathered_input_bytes; whether the combine keeps their weighted outputs). ``autocast``:
    how a composed activation keeps its operands (composed_activation_saved_bytes); ``eager_attention``: unfused
    attention as eager PyTorch keeps it (layer_activation_bytes_per_token)."""
    tokens = mbs * seq_len / cp
    if recompute == "selective" and op_sac.keeps_input_only(model, layer, selective_policy):
        recompute = "full"  # a compiled MoE block under op-SAC keeps its input only (op_sac.py)
    if recompute == "selective" and selective_policy in op_sac.OP_SAC_POLICIES:
        sharded, whole = op_sac_bytes_per_token(model, layer, dtype_bytes=dtype_bytes,
                                                sequence_parallel=sequence_parallel)
        return tokens * (sharded / tp + whole)
    if selective_policy not in SELECTIVE_POLICIES:
        raise ValueError(f"selective_policy {selective_policy!r} (known: {', '.join(SELECTIVE_POLICIES)})")
    local, scores = layer_activation_bytes_per_token(model, layer, seq_len=seq_len, recompute=recompute, flash=flash,
                                                     dtype_bytes=dtype_bytes, fp8_gemm_inputs=fp8_gemm_inputs,
                                                     probs_on_output=moe_runtime.probs_on_output, autocast=autocast,
                                                     eager_attention=eager_attention)
    out = tokens * (local + scores) / tp
    if model.is_moe_layer(layer) and recompute != "full":
        out += expert_gathered_input_bytes(model, tokens=tokens, tp=tp, expert_tp=moe_runtime.etp(tp),
                                           input_bytes=gemm_input_bytes(dtype_bytes, fp8_gemm_inputs))
    if whole_column_inputs and sequence_parallel and tp > 1 and recompute != "full":
        out += tokens * 2 * gemm_input_bytes(dtype_bytes, fp8_gemm_inputs) * model.hidden_size * (1.0 - 1.0 / tp)
        out += tokens * replicated_moe_bytes_per_token(model, layer, tp=tp, dtype_bytes=dtype_bytes,
                                                       moe_runtime=moe_runtime) * (1.0 - 1.0 / tp)
    if not sequence_parallel and tp > 1:
        replicated = tp_replicated_bytes_per_token(model, layer, recompute=recompute, dtype_bytes=dtype_bytes,
                                                   fp8_gemm_inputs=fp8_gemm_inputs)
        out += tokens * replicated * (1.0 - 1.0 / tp)
    return out


def layer_backward_transient_bytes(model: "ModelSpec", layer: int, *, seq_len: int, mbs: int, tp: int = 1,
                                    cp: int = 1, dtype_bytes: int = 2,
                                    moe_runtime: MoERuntime = DEFAULT_MOE_RUNTIME) -> float:
    """Bytes one layer's backward holds beyond the tensors it kept (or rebuilt): the activation gradients it forms.

    Autograd runs a layer's backward op by op; each op reads its output's gradient and writes its inputs' gradients,
    so the two coexist (a gradient is freed once the ops that read it are done), beside the tensors the layer kept.
    The widest step of each part, per token on one GPU:
      attention   the incoming h-wide gradient (whole: under SP the backward all-gathers it for the row-parallel
                  output projection) and the gradients of Q, K, V and the attention output (2 q + 2 kv) / t;
      dense MLP   the incoming gradient and, at the activation's backward, the gradient of its output (the down
                  GEMM's input) and of the m - 1 up/gate outputs: m f / t;
      routed MoE  per routed copy (k of each token; a GPU holds tokens k etp / t copies: Megatron-core all-gathers
                  them over the experts' TP group, DTensor TP replicates them): the combine's backward forms the
                  gradient of the k weighted rows while the all-to-all receives it into a buffer of the same size
                  (2 h), the experts' activation backward the gradients of its output and inputs beside the
                  received rows (h + m f_e / etp); without EP no buffer, the same widest step.
    Shared experts are a dense MLP of their width, run beside the routed ones (torchtitan, Megatron-core): the wider
    of the two counts. Weight gradients are the ZeRO working set's or the model states'."""
    p, h = dtype_bytes, model.hidden_size
    tokens = mbs * seq_len / cp
    m = model.ffn_matrices
    attn = p * (h + (2 * model.q_dim + 2 * model.kv_dim) / tp)
    if not model.is_moe_layer(layer):
        return tokens * max(attn, p * (h + m * model.ffn_hidden_size / tp))
    etp = moe_runtime.etp(tp)
    copies = model.top_k * etp / tp
    routed = p * copies * max(2 * h, h + m * model.expert_ffn_hidden_size / etp)
    shared = 0.0
    if model.num_shared_experts:
        shared = p * (h + m * model.num_shared_experts * model.shared_expert_ffn_hidden_size / tp)
    return tokens * max(attn, routed, shared)


def replicated_moe_bytes_per_token(model: "ModelSpec", layer: int, *, tp: int, dtype_bytes: int = 2,
                                   moe_runtime: MoERuntime = DEFAULT_MOE_RUNTIME) -> float:
    """Bytes per token of an MoE layer's kept tensors that DTensor TP keeps whole on every TP rank, beyond the
    block's input (module docstring: DTensor), where layer_activation_bytes_per_token counts a 1/tp share.

    torchtitan's apply_moe_ep_tp (torchtitan/models/llama4/infra/parallelize.py, used by its Qwen3 and DeepSeek-V3
    models) wraps the MoE block in PrepareModuleInputOutput(input Shard(1) -> Replicate(), output Partial() ->
    Shard(1)) and runs the router's gate as NoParallel: every TP rank scores all M tokens, so the fp32 router
    probabilities are whole (4 E bytes a token). With the experts' TP degree equal to TP (ExpertTensorParallel) each
    TP rank also dispatches the routed copies of all M tokens and its experts' row-parallel down projection returns
    Partial outputs of every copy: where the combine weights those outputs by the routing probabilities
    (MoERuntime.probs_on_output) it keeps k whole h-wide copies (the gathered inputs of the same copies are
    expert_gathered_input_bytes'). With expert TP 1 (ReordererSequenceParallel) a TP rank routes 1/tp of the
    copies, as counted. Megatron-core's dispatcher permutes the rank's sequence-parallel shard: nothing whole."""
    if not model.is_moe_layer(layer) or tp <= 1:
        return 0.0
    out = FP32_BYTES * model.num_experts
    if moe_runtime.etp(tp) == tp and moe_runtime.probs_on_output and model.top_k > 1:
        out += model.top_k * dtype_bytes * model.hidden_size
    return out


def expert_gathered_input_bytes(model: "ModelSpec", *, tokens: float, tp: int, expert_tp: int,
                                input_bytes: float) -> float:
    """The routed experts' inputs a GPU keeps beyond its 1/tp share of the layer's top-k token copies.

    Megatron-core's all-to-all dispatcher (megatron/core/transformer/moe/token_dispatcher.py,
    MoEAlltoAllTokenDispatcher): each rank permutes its sequence-parallel shard (tokens / tp), all-to-alls the
    copies over the EP group, and where the experts' tensor-parallel size is above 1 all-gathers them over that
    group (gather_from_sequence_parallel_region); the experts' first GEMM saves the gathered tokens for its weight
    gradient. A GPU so keeps (tokens / tp) x expert_tp x k copies of h, expert_tp - 1 shares more than the per-token
    count of layer_activation_bytes_per_token divided by tp. Their intermediates are sharded by expert_tp (the
    expert width / expert_tp), so they stay at the 1/tp share."""
    if not model.is_moe or expert_tp <= 1:
        return 0.0
    return tokens / tp * (expert_tp - 1) * model.top_k * input_bytes * model.hidden_size


def measured_activation_factor(measured: Mapping[str, Any] | None, model: "ModelSpec", layer: int, *, seq_len: int,
                               mbs: int, tp: int, flash: bool, dtype_bytes: int = 2) -> float | None:
    """The profile's saved bytes of layer ``layer``'s kind at (seq_len, mbs, tp) over the analytic figure for what the
    profiler ran (no recompute, the TP shard holding the whole sequence: TP without SP), None where the GPU's
    ``measured`` figures have none for this model and kind. Between measured shapes the bytes are interpolated,
    beyond them the nearest measured shape is scaled by the analytic ratio (measured_layers.price: a per-shape
    quantity, here bytes where it usually prices seconds)."""
    table = (measured or {}).get("layer_activation_bytes")
    if not table:
        return None
    points = measured_points(table, {}, model.name, model.layer_kind(layer))
    if not points:
        return None

    def analytic(s: int, b: int, t: int) -> float:
        return layer_activation_bytes(model, layer, seq_len=s, mbs=b, tp=t, flash=flash, dtype_bytes=dtype_bytes,
                                      sequence_parallel=False)

    return price(points, seq_len=seq_len, mbs=mbs, tp=tp, analytic_s=analytic).forward_s / analytic(seq_len, mbs, tp)


def embedding_activation_bytes(model: "ModelSpec", *, seq_len: int, mbs: int, tp: int = 1, cp: int = 1,
                               sequence_parallel: bool = True) -> float:
    """First stage: the embedding-dropout mask, s b h bytes (Korthikanti et al. 2022, sec. 4.3), sharded by SP."""
    if not model.dropout:
        return 0.0
    return MASK_BYTES * model.hidden_size * mbs * seq_len / cp / (tp if sequence_parallel else 1)


def head_activation_bytes(model: "ModelSpec", *, seq_len: int, mbs: int, tp: int = 1, cp: int = 1,
                          dtype_bytes: int = 2, sequence_parallel: bool = True, cross_entropy: str = "fused",
                          whole_column_inputs: bool = False) -> float:
    """Last stage: final norm and output-layer inputs (4 s b h) and the loss's logit tensors, vocab-parallel
    (Korthikanti et al. 2022, sec. 4.3, count the fp32 logits, 4 s b v). At the loss's peak Megatron's loss holds
    per logit the 16-bit logits (p bytes) and their fp32 copy, which becomes the softmax and then, in place, the
    gradient (4): (p + 4) s b v. Large for big vocabularies: Llama 3 (v = 128256) at s = 8192 holds 6.3 GB per
    sequence before TP. Without SP the two h-wide inputs are whole on every TP rank; other implementations of the
    loss hold other amounts per logit (CROSS_ENTROPY_KINDS, as the caching allocator reserves them; a compiled loss
    over vocab-parallel logits as the eager one, loss_as_run).
    ``whole_column_inputs``: the output layer keeps its all-gathered input whole beside the final norm's sharded one
    (module docstring: DTensor)."""
    per_logit = cross_entropy_bytes_per_logit(loss_as_run(cross_entropy, tp), dtype_bytes)
    tokens = mbs * seq_len / cp
    if sequence_parallel and whole_column_inputs:
        return tokens * (dtype_bytes * model.hidden_size * (1 + 1 / tp) + per_logit * model.vocab_size / tp)
    if sequence_parallel:
        return tokens * (2 * dtype_bytes * model.hidden_size + per_logit * model.vocab_size) / tp
    return tokens * (2 * dtype_bytes * model.hidden_size + per_logit * model.vocab_size / tp)


# ---------------------------------------------------------------------------------------------- parameters
def layer_param_split(model: "ModelSpec", layer: int) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters of a layer: experts shard by EP and replicate over dp*cp/ep."""
    total = float(model.layer_params(layer))
    if not model.is_moe_layer(layer):
        return total, 0.0
    e, k = model.num_experts, model.top_k
    if e == k:  # every expert active: active == total, so derive one expert from the FFN shape instead
        per_expert = model.ffn_matrices * model.hidden_size * model.expert_ffn_hidden_size
    else:
        per_expert = (total - model.layer_active_params(layer)) / (e - k)
    experts = per_expert * e
    return total - experts, experts


# What the runtime stores per parameter (state_bytes_per_param), as (parameter, gradient, optimizer state) bytes
# with p the compute dtype's bytes, g the gradient dtype's and K the optimizer's states incl. an fp32 master copy:
#   mixed        p, g, K: 16-bit parameters, fp32 main gradients and the optimizer's fp32 master copy beside its
#                moments (ZeRO's 2 + 2 + 12 with 16-bit gradients; Megatron's distributed optimizer with fp32 main
#                grads: 2 + 4 + 12). The planner's assumption.
#   fp32-params  4, 4, K - 4: FSDP2 under a MixedPrecisionPolicy over a model built in fp32 (torchtitan: its model is
#                created in fp32 and fully_shard'ed with param_dtype bf16, reduce_dtype fp32): the sharded parameters
#                stay fp32 and are the optimizer's own (no separate master copy), the sharded gradients take their
#                dtype; the bf16 copies exist only gathered, for compute.
#   param-dtype  p, p, (K - 4) p / 4: every state in the compute dtype: the model cast to bf16 before the optimizer
#                is built, whose moments torch.optim.Adam creates as zeros_like(param) (NeMo AutoModel's custom
#                models: initialize_weights casts to bf16 by default), and FSDP2 casts its reduced gradients to the
#                sharded parameter's dtype. Adam: 2 + 2 + 4 = 8 bytes.
MODEL_STATE_KINDS = ("mixed", "fp32-params", "param-dtype")


def state_bytes_per_param(model_states: str, *, dtype_bytes: float, grad_bytes: float, optimizer_bytes: float,
                          keeps_param_dtype_grads: bool = False) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer-state) bytes the runtime stores per parameter under ``model_states``
    (MODEL_STATE_KINDS). ``optimizer_bytes`` is TrainingSpec.optimizer_state_bytes: the moments plus an fp32 master
    copy where the compute dtype is 16 bit. ``keeps_param_dtype_grads``: a compute-dtype copy of each gradient is
    held beside the accumulation buffer (SliceCoster's keyword of that name)."""
    moments = optimizer_bytes - FP32_BYTES if dtype_bytes < FP32_BYTES else optimizer_bytes
    if model_states == "mixed":
        out = (dtype_bytes, grad_bytes, optimizer_bytes)
    elif model_states == "fp32-params":
        out = (FP32_BYTES, FP32_BYTES, moments)
    elif model_states == "param-dtype":
        out = (dtype_bytes, dtype_bytes, moments * dtype_bytes / FP32_BYTES)
    else:
        raise ValueError(f"model_states {model_states!r} (known: {', '.join(MODEL_STATE_KINDS)})")
    p, g, o = out
    return p, g + dtype_bytes if keeps_param_dtype_grads else g, o


class ModelStateBytes(NamedTuple):
    """Model-state bytes per GPU (on the GPU) and what offload moved to host memory (a NamedTuple: cheap to build
    in the parallelizers' inner loop)."""

    parameters: float
    gradients: float
    optimizer: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


def held_under_pipelining(zero_stage: int) -> bool:
    """Whether FSDP2 under torch.distributed.pipelining holds a stage's whole parameters and unsharded gradients
    across the micro-batches (each backward runs with ``set_reshard_after_backward(False)`` and
    ``set_requires_gradient_sync(False)``; one reduce-scatter follows the last): ZeRO-2/3 then hold ZeRO-1's model
    states. Offload changes nothing here: it moves only the optimizer's state (runtime_adapters/offload.py)."""
    return zero_stage >= 2


def model_state_bytes(num_params: float, *, shard: int, zero_stage: int, offload: bool = False,
                      param_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 12,
                      host_master_bytes: float = 0.0) -> ModelStateBytes:
    """ZeRO stages 0-3 over a data-parallel shard group of ``shard`` GPUs (Rajbhandari et al. 2020, Fig. 1).

    ``num_params`` is what this GPU holds before ZeRO (already divided by TP/EP). Offload is optimizer offload, as
    the one runtime that offloads runs it (runtime_adapters/offload.py): the optimizer state and the update live on
    the host, beside the host copy of the parameters that the optimizer updates (``host_master_bytes`` each,
    sharded as the optimizer state is) where the optimizer state does not hold one already; parameters and gradients
    stay on the GPU under their ZeRO sharding.
    """
    n = max(1, shard)
    params = num_params * param_bytes / (n if zero_stage >= 3 else 1)
    grads = num_params * grad_bytes / (n if zero_stage >= 2 else 1)
    opt = num_params * optimizer_bytes / (n if zero_stage >= 1 else 1)
    host = 0.0
    if offload:
        host = opt + num_params * host_master_bytes / (n if zero_stage >= 1 else 1)
        opt = 0.0
    return ModelStateBytes(params, grads, opt, host)
