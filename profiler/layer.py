"""Time one transformer layer's forward and backward at the planned shapes (``tangram-launch profile --model``).

The layer is a plain torch module built from the ModelSpec's widths (pre-norm attention with grouped-query heads,
then a GELU or SwiGLU FFN). It stands for the compute of a real layer, not its exact kernels, so the timing is
what a cost model can calibrate its efficiency against (as Metis and Sailor plan from measured layer times).
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

from profiler.bench import DTYPES, Measured, calibrate_inner, calibration_clock, device_sync, time_repeated


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


def _ffn(up: nn.Linear, down: nn.Linear, swiglu: bool, x: torch.Tensor) -> torch.Tensor:
    """down(act(up(x))) with SwiGLU's gate/up halves in one GEMM; x (..., H) -> (..., H)."""
    h = up(x)
    if swiglu:
        gate, h = h.chunk(2, dim=-1)
        return down(F.silu(gate) * h)
    return down(F.gelu(h))


class _RoutedFFN(nn.Module):
    """Top-k routed experts (+ shared FFN) on one device; x (B, T, H) -> (B, T, H)."""

    def __init__(self, hidden: int, experts: int, top_k: int, width: int, shared: int, swiglu: bool, bias: bool):
        super().__init__()
        self.top_k, self.swiglu = top_k, swiglu
        self.router = nn.Linear(hidden, experts, bias=False)
        self.up = nn.ModuleList(nn.Linear(hidden, width * (2 if swiglu else 1), bias=bias) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(width, hidden, bias=bias) for _ in range(experts))
        self.shared_up = nn.Linear(hidden, shared * (2 if swiglu else 1), bias=bias) if shared else None
        self.shared_down = nn.Linear(shared, hidden, bias=bias) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)  # (N, H)
        weight, expert = self.router(tokens).float().softmax(dim=-1).topk(self.top_k, dim=-1)  # (N, k) each
        order = expert.reshape(-1).argsort(stable=True)  # (N k,) assignments grouped by expert
        token = torch.arange(b * t, device=x.device).repeat_interleave(self.top_k)[order]
        counts = torch.bincount(expert.reshape(-1), minlength=len(self.up)).tolist()
        rows, outs, offset = tokens[token], [], 0
        for up, down, n in zip(self.up, self.down, counts):
            outs.append(_ffn(up, down, self.swiglu, rows[offset:offset + n]))
            offset += n
        y = torch.cat(outs) * weight.reshape(-1)[order, None].to(x.dtype)  # (N k, H)
        out = torch.zeros_like(tokens).index_add(0, token, y)
        if self.shared_up is not None:
            out = out + _ffn(self.shared_up, self.shared_down, self.swiglu, tokens)
        return out.view(b, t, h)


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, swiglu: bool,
                 rmsnorm: bool, bias: bool, routed: _RoutedFFN | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        norm = (lambda: nn.RMSNorm(hidden)) if rmsnorm else (lambda: nn.LayerNorm(hidden))
        self.norm1, self.norm2 = norm(), norm()
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=bias)
        self.proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.swiglu = swiglu
        self.routed = routed
        if routed is None:
            self.up = nn.Linear(hidden, ffn * (2 if swiglu else 1), bias=bias)
            self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, H)
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        if self.routed is not None:
            return x + self.routed(self.norm2(x))
        return x + _ffn(self.up, self.down, self.swiglu, self.norm2(x))


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
        routed=routed,
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
               min_rep_s: float) -> dict[str, Measured]:
    """Forward and forward+backward seconds of one layer of ``kind`` at ``shape``; value = achieved TFLOP/s."""
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
        inner = calibrate_inner(fn, min_rep_s=min_rep_s, sync=sync, clock=calibration_clock(device))
        timing = time_repeated(fn, warmup=warmup, reps=reps, inner=inner, sync=sync)
        out[name] = Measured(flops / timing.median_s / 1e12, "TFLOP/s", timing,
                             (("micro_batch", shape.micro_batch), ("seq_len", shape.seq_len),
                              ("dtype", shape.dtype), ("layer_kind", kind)))
    return out
