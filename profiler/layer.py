"""Time one transformer layer's forward and backward at the planned shapes (``tangram-launch profile --model``).

The layer is a plain torch module built from the ModelSpec's widths (pre-norm attention with grouped-query heads,
then a GELU or SwiGLU FFN). It stands for the compute of a real layer, so the timing is what a cost model can
calibrate its efficiency against (as Metis and Sailor plan from measured layer times). Its operators are the torch
runtime's (runtime_adapters/gpt.py): separate q/k/v projections (what tensor parallelism splits), rotary position
embedding where the model has it, K/V heads repeated for grouped-query attention, separate gate and up projections.
At small shapes, where a layer's time is mostly per-operator overhead, that matters: with fused q/k/v and gate/up
and no rotary, tiny-moe's dense layer read 1.9x faster on a CPU than the runtime's (0.86 vs 1.61 ms forward+backward,
best of 40).
An MoE layer is timed with its routing on one device: router GEMM, softmax and top-k, tokens sorted by expert, one
FFN per expert on its rows (balanced or not, as the router sends them), the weighted scatter back, plus the shared
experts. The all-to-all of expert parallelism is the cost model's own term. (Timed as one dense FFN of the active
width instead, tiny-moe's MoE FFN read 4.7x faster on a CPU than the torch runtime's routed one.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from typing import Any, Callable

from profiler.bench import (
    DTYPES,
    WAIT_BLOCK,
    Measured,
    calibrate_inner,
    calibration_clock,
    device_sync,
    time_interleaved,
    time_repeated,
)


@dataclass(frozen=True)
class LayerShape:
    micro_batch: int
    seq_len: int
    dtype: str

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.seq_len < 1:
            raise ValueError(f"micro_batch and seq_len must be >= 1, got {self.micro_batch}, {self.seq_len}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


class _FFN(nn.Module):
    """down(act(gate(x)) * up(x)) (gated) or down(act(up(x))); x (..., H) -> (..., H)."""

    def __init__(self, hidden: int, width: int, swiglu: bool, bias: bool):
        super().__init__()
        self.up = nn.Linear(hidden, width, bias=bias)
        self.gate = nn.Linear(hidden, width, bias=bias) if swiglu else None
        self.down = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding on x (B, T, nh, hd), angles built per call as the runtime does."""
    _, t, _, hd = x.shape
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))  # (hd/2,)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)  # (T, hd/2)
    cos = torch.cat((ang.cos(), ang.cos()), dim=-1)[None, :, None, :].to(x.dtype)  # (1, T, 1, hd)
    sin = torch.cat((ang.sin(), ang.sin()), dim=-1)[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _RoutedFFN(nn.Module):
    """Top-k routed experts (+ shared FFN) on one device; x (B, T, H) -> (B, T, H)."""

    def __init__(self, hidden: int, experts: int, top_k: int, width: int, shared: int, swiglu: bool, bias: bool):
        super().__init__()
        self.top_k, self.swiglu = top_k, swiglu
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(_FFN(hidden, width, swiglu, bias) for _ in range(experts))
        self.shared = _FFN(hidden, shared, swiglu, bias) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)  # (N, H)
        weight, expert = self.router(tokens).float().softmax(dim=-1).topk(self.top_k, dim=-1)  # (N, k) each
        order = expert.reshape(-1).argsort(stable=True)  # (N k,) assignments grouped by expert
        token = torch.arange(b * t, device=x.device).repeat_interleave(self.top_k)[order]
        counts = torch.bincount(expert.reshape(-1), minlength=len(self.experts)).tolist()
        rows, outs, offset = tokens[token], [], 0
        for ffn, n in zip(self.experts, counts):
            outs.append(ffn(rows[offset:offset + n]))
            offset += n
        y = torch.cat(outs) * weight.reshape(-1)[order, None].to(x.dtype)  # (N k, H)
        out = torch.zeros_like(tokens).index_add(0, token, y)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(b, t, h)


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, swiglu: bool,
                 rmsnorm: bool, bias: bool, rotary: bool = False, routed: _RoutedFFN | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rotary = heads, kv_heads, head_dim, rotary
        norm = (lambda: nn.RMSNorm(hidden)) if rmsnorm else (lambda: nn.LayerNorm(hidden))
        self.norm1, self.norm2 = norm(), norm()
        self.q = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.routed = routed
        self.ffn = _FFN(hidden, ffn, swiglu, bias) if routed is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, H)
        b, t, _ = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, t, self.heads, self.head_dim)  # (B, T, nh, hd)
        k = self.k(y).view(b, t, self.kv_heads, self.head_dim)  # (B, T, nkv, hd)
        v = self.v(y).view(b, t, self.kv_heads, self.head_dim)
        if self.rotary:
            q, k = _rotary(q), _rotary(k)
        if self.kv_heads != self.heads:  # grouped-query attention: K/V heads repeated for their query groups
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=2)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hd)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        if self.routed is not None:
            return x + self.routed(self.norm2(x))
        return x + self.ffn(self.norm2(x))


def active_ffn_width(model, kind: str) -> int:
    """FFN width a token passes through in a layer of ``kind`` ("dense" | "moe")."""
    if kind == "dense":
        return model.ffn_hidden_size
    expert = model.expert_ffn_hidden_size or model.ffn_hidden_size
    shared = getattr(model, "num_shared_experts", 0) * (getattr(model, "shared_expert_ffn_hidden_size", None) or expert)
    return model.top_k * expert + shared


def build_layer(model, kind: str, device: torch.device, dtype: str) -> nn.Module:
    heads = model.num_heads
    head_dim = model.head_dim or model.hidden_size // heads
    swiglu, bias = model.ffn_type in ("swiglu", "geglu"), bool(getattr(model, "linear_bias", True))
    routed = None
    if kind == "moe":
        expert = model.expert_ffn_hidden_size or model.ffn_hidden_size
        shared = getattr(model, "num_shared_experts", 0) * (getattr(model, "shared_expert_ffn_hidden_size", None)
                                                             or expert)
        routed = _RoutedFFN(model.hidden_size, model.num_experts, model.top_k, expert, shared, swiglu, bias)
    layer = _Layer(
        hidden=model.hidden_size, heads=heads, kv_heads=model.num_kv_heads or heads, head_dim=head_dim,
        ffn=active_ffn_width(model, kind), swiglu=swiglu, rmsnorm=model.norm_type == "rmsnorm", bias=bias,
        rotary=getattr(model, "position_embedding", None) == "rotary", routed=routed,
    )
    return layer.to(device=device, dtype=DTYPES[dtype])


def layer_kinds(model) -> list[str]:
    """The distinct layer kinds in model order (slices with the same kinds are interchangeable)."""
    kinds: list[str] = []
    for i in range(model.num_layers):
        k = model.layer_kind(i)
        if k not in kinds:
            kinds.append(k)
    return kinds


def time_layer(model, kind: str, shape: LayerShape, device: torch.device, *, warmup: int, reps: int,
               min_rep_s: float, between: Callable[[], Any] | None = None) -> dict[str, Measured]:
    """Forward and forward+backward seconds of one layer of ``kind`` at ``shape``; value = achieved TFLOP/s.

    With ``between`` (a collective over the node's processes, CPU devices), each call is followed by it, ``reps``
    blocks of WAIT_BLOCK calls (bench.time_interleaved: a layer computed the way a training step meets it);
    without, calibrated back-to-back repetitions."""
    torch.manual_seed(0)
    layer = build_layer(model, kind, device, shape.dtype)
    x = torch.randn(shape.micro_batch, shape.seq_len, model.hidden_size, device=device,
                    dtype=DTYPES[shape.dtype], requires_grad=True)  # (B, T, H)
    grad = torch.randn_like(x)
    sync = device_sync(device)
    index = next(i for i in range(model.num_layers) if model.layer_kind(i) == kind)
    fwd_flops = model.layer_forward_flops_per_token(index, shape.seq_len) * shape.micro_batch * shape.seq_len

    def forward() -> None:
        with torch.no_grad():
            layer(x)

    def forward_backward() -> None:
        layer(x).backward(grad)

    out = {}
    for name, fn, flops in (("forward", forward, fwd_flops), ("forward_backward", forward_backward, 3 * fwd_flops)):
        if between is not None:
            timing = time_interleaved(fn, between, warmup=max(1, warmup), blocks=reps, calls=WAIT_BLOCK)
        else:
            inner = calibrate_inner(fn, min_rep_s=min_rep_s, sync=sync, clock=calibration_clock(device))
            timing = time_repeated(fn, warmup=warmup, reps=reps, inner=inner, sync=sync)
        out[name] = Measured(flops / timing.median_s / 1e12, "TFLOP/s", timing,
                             (("micro_batch", shape.micro_batch), ("seq_len", shape.seq_len),
                              ("dtype", shape.dtype), ("layer_kind", kind),
                              ("timed", "each call followed by an all-to-all" if between is not None
                               else "back to back")))
    return out
