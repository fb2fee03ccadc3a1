"""Unfused attention as eager PyTorch runs it: one kernel per operator over the s x s scores.

Megatron's unfused path moves each score element through one fused scale-mask-softmax kernel and a dropout
(compute.SCORE_TRAFFIC_P: 6p + 1 bytes, the backward taken as twice the forward). Eager PyTorch attention -- minGPT,
nanoGPT without flash, Hugging Face's ``eager_attention_forward``, a book's from-scratch GPT -- runs the same steps as
separate kernels, each reading and writing the whole score tensor:

    forward   Q K^T (writes p), scale (2p), causal mask: masked_fill or an added mask (2p), softmax, dropout
              (reads, writes and stores a 1-byte mask), P V (reads p)
    backward  dP = dY V^T (writes p) and dV = P^T dY (reads P: p), dropout (reads the gradient and the mask,
              writes), softmax (reads the gradient and its output, writes), mask and scale (2p each), the two
              GEMMs of dQ and dK (read dS twice: 2p)

Under autocast at 16 bits, softmax is on autocast's fp32 list (torch.amp: "CUDA ops that can autocast to float32"):
its input is cast up (reads p, writes 4), it computes and writes fp32 (8), dropout then runs on fp32 (9), and P V's
input is cast back (reads 4, writes p); in the backward the two casts run again (4 + p each) and softmax's and
dropout's gradients are fp32. Without autocast (fp32 training, a model cast to 16 bits) every pass is at the dtype.

Bytes per score element, p = dtype bytes, q = softmax's and dropout's dtype bytes (4 under 16-bit autocast, else
p), c = 2 (p + q) for the two casts under 16-bit autocast (else 0), d = 2q + 1 with dropout (else 0):

    forward   6p + 2q + c + d        16-bit autocast: 41 with dropout, 32 without; fp32: 41; a 16-bit model: 21
    backward  8p + 3q + c + d        16-bit autocast: 49 with dropout, 40 without; fp32: 53; a 16-bit model: 27

against Megatron's fused kernel's 13 and 26 at 16 bits. The s x s matmuls' FLOPs are priced apart (compute.py).

Kept for the backward: softmax's output (q), dropout's mask and P V's input (p: dropout's output, or under 16-bit
autocast the down-cast copy; without dropout and autocast, softmax's output is P V's input). Under 16-bit autocast
that is 4 + p + 1 with dropout, 4 + p without, against Megatron's 2p + 1 and p (Korthikanti et al. 2022).

A model cast to 16 bits runs softmax at its dtype here, as minGPT, nanoGPT and a book's from-scratch GPT do; some
Hugging Face models (Llama, OPT, BLOOM) up-cast it explicitly, as autocast does, which this does not tell apart.
"""
from __future__ import annotations

FP32_BYTES = 4
MASK_BYTES = 1  # dropout's boolean keep-mask, one byte per element (Korthikanti et al. 2022, sec. 4.1)


def eager_score_bytes(dtype_bytes: int, *, autocast: bool, dropout: bool) -> tuple[float, float]:
    """(forward, backward) bytes moved per attention-score element by eager PyTorch's unfused attention (module
    docstring); ``autocast``: a 16-bit plan's layers run under autocast, which keeps softmax in fp32."""
    p = float(dtype_bytes)
    up = autocast and dtype_bytes < FP32_BYTES
    q = float(FP32_BYTES) if up else p
    casts = 2 * (p + q) if up else 0.0  # up to fp32 before softmax, down to p before P V
    drop = 2 * q + MASK_BYTES if dropout else 0.0
    # Q K^T writes p, scale and mask read and write p, softmax reads and writes q, P V reads p
    forward = p + 2 * p + 2 * p + 2 * q + p + casts + drop
    # dP = dY V^T writes p and dV = P^T dY reads P; softmax reads dY and Y and writes; mask, scale; dQ, dK read dS
    backward = 2 * p + 3 * q + 2 * p + 2 * p + 2 * p + casts + drop
    return forward, backward


def eager_score_saved_bytes(dtype_bytes: int, *, autocast: bool, dropout: bool) -> float:
    """Bytes per attention-score element eager PyTorch's unfused attention keeps for the backward (module
    docstring); without 16-bit autocast, Megatron's 2p + 1 (dropout) or p."""
    p = float(dtype_bytes)
    mask = MASK_BYTES if dropout else 0.0
    if autocast and dtype_bytes < FP32_BYTES:
        return FP32_BYTES + p + mask  # softmax's fp32 output, P V's down-cast input
    return 2 * p + mask if dropout else p


def mem_efficient_score_bytes(dtype_bytes: int, *, dropout: bool) -> tuple[float, float]:
    """(forward, backward) bytes per score element that stand for the time of torch SDPA's memory-efficient kernel,
    which SDPA runs where the GPU has no FlashAttention one (before Ampere). On a V100 that kernel (xformers' CUTLASS
    attention) runs about as fast as the unfused PyTorch attention it replaces: forward 5 % (fp16) and 4 % (fp32)
    slower at the median, backward 15 % and 30 % slower (facebookresearch/xformers PR #362, V100 benchmarks), so it
    is priced as that attention at its dtype; it keeps no scores (memory as a fused kernel's)."""
    return eager_score_bytes(dtype_bytes, autocast=False, dropout=dropout)


def attention_pricing(flash: bool, mem_efficient: bool, eager: bool) -> str:
    """One line saying how a device's attention is priced (``estimate`` prints it): which kernel, and whether the
    s x s scores are kept for the backward."""
    if flash:
        return "fused kernel (FlashAttention-style): no s x s scores kept"
    if mem_efficient:
        return ("SDPA's memory-efficient kernel (no FlashAttention on this GPU): no s x s scores kept, "
                "timed as the unfused attention it replaces")
    if eager:
        return "eager, one kernel per operator (softmax in fp32 under autocast): s x s scores kept"
    return "unfused, Megatron's fused scale-mask-softmax: s x s scores kept"
