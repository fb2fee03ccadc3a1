"""Time one transformer layer's forward and backward at the planned shapes (``tangram-launch profile --model``).

The layer is a plain torch module built from the ModelSpec's widths (pre-norm attention with grouped-query heads,
then a GELU or SwiGLU FFN). It stands for the compute of a real layer, so the timing is what a cost model can
calibrate its efficiency against (as Metis and Sailor plan from measured layer times). Its operators are the torch
runtime's (runtime_adapters/gpt.py): separate q/k/v projections (what tensor parallelism splits), rotary position
embedding where the model has it, K/V heads repeated for grouped-query attention, separate gate and up projections.
At small shapes, where a layer's time is mostly per-operator overhead, that matters: with fused q/k/v and gate/up
and no rotary, tiny-moe's dense layer read 1.9x faster on a CPU than the runtime's (0.86 vs 1.61 ms forward+backward,
best of 40).
An MoE layer is timed with its routing on one device, as the runtime routes (``_RoutedFFN``: auxiliary losses,
capacity, sort, one FFN per expert on its rows, the weighted scatter back, plus the shared experts). The all-to-all
of expert parallelism is the cost model's own term. (Timed as one dense FFN of the active width instead, tiny-moe's
MoE FFN read 4.7x faster on a CPU than the torch runtime's routed one.) The embedding and the head with the loss
are timed the same way (``EDGE_KINDS``), as kinds of their own.
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
    time_budgeted,
    time_blocks,
    time_blocks_split,
    time_interleaved,
    time_repeated,
    warm_once_s,
)


@dataclass(frozen=True)
class LayerShape:
    """One shape a layer is timed at; ``tp``: the layer's share under that TP degree (heads and FFN width split),
    on one device, without the TP collectives (the cost model's own term)."""

    micro_batch: int
    seq_len: int
    dtype: str
    tp: int = 1

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.seq_len < 1 or self.tp < 1:
            raise ValueError(f"micro_batch, seq_len and tp must be >= 1, got {self.micro_batch}, {self.seq_len}, "
                             f"{self.tp}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def label(self) -> str:
        return f"b={self.micro_batch} s={self.seq_len} tp={self.tp} {self.dtype}"


def tp_shards(model, gpus_per_node: int) -> list[int]:
    """The TP degrees the planner considers for ``model`` on a node of ``gpus_per_node`` devices: powers of two that
    divide the node and the attention heads (and the KV heads, or are divided by them)."""
    heads, kv = model.num_heads, model.num_kv_heads or model.num_heads
    out, t = [], 1
    while t <= gpus_per_node:
        if gpus_per_node % t == 0 and heads % t == 0 and (kv % t == 0 or t % kv == 0):
            out.append(t)
        t *= 2
    return out


def planned_shapes(model, *, micro_batches: list[int], seq_lens: list[int], tps: list[int],
                   dtype: str) -> list[LayerShape]:
    """Every shape to time, the most useful first (a budget that runs out drops the last): tp 1 before the
    shards, then each sequence length by micro-batch size ascending."""
    return [LayerShape(b, s, dtype, t) for t in sorted(set(tps)) for s in seq_lens for b in sorted(set(micro_batches))]


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


class _AttachAux(torch.autograd.Function):
    """Identity on ``x`` whose backward also seeds the scalar ``aux`` with 1 (the runtime's way of adding the
    auxiliary losses to the loss without plumbing them through a pipeline schedule)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class _RoutedFFN(nn.Module):
    """Top-k routed experts (+ shared FFN) on one device, routed as the torch runtime routes
    (runtime_adapters/moe.py): fp32 router, softmax, top-k (renormalised where the model says), the load-balancing
    and z-losses attached to the output, choice-major assignments (capacity where the model has one), a stable
    sort by expert, one FFN per expert, the weighted scatter back, the per-call routing counters read on the host.
    x (B, T, H) -> (B, T, H).

    Those operators are what a small MoE layer's time is made of on a CPU: without the auxiliary losses and the
    runtime's sort, tiny-moe's MoE layer read 2.74 ms forward+backward against 3.31 ms for the runtime's (process
    CPU time, one process; the dense layers read alike, 1.67 vs 1.65 ms)."""

    def __init__(self, model, hidden: int, width: int, shared: int, swiglu: bool, bias: bool,
                 aux_loss_coeff: float = 0.01, z_loss_coeff: float = 0.001):
        super().__init__()
        self.model, self.top_k, self.swiglu = model, model.top_k, swiglu
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff  # the runtime's defaults
        self.router = nn.Linear(hidden, model.num_experts, bias=bool(getattr(model, "router_bias", False)))
        self.experts = nn.ModuleList(_FFN(hidden, width, swiglu, bias) for _ in range(model.num_experts))
        self.shared = _FFN(hidden, shared, swiglu, bias) if shared else None
        self.shared_gate = (nn.Linear(hidden, 1, bias=False) if shared and getattr(model, "shared_expert_gate", False)
                            else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        n, e, k = b * t, len(self.experts), self.top_k
        tokens = x.reshape(n, h)  # (N, H)
        bias = None if self.router.bias is None else self.router.bias.float()
        logits = F.linear(tokens.float(), self.router.weight.float(), bias)  # (N, E) fp32
        probs = logits.softmax(dim=-1)
        top_p, top_e = probs.topk(k, dim=-1)  # (N, k) each
        gshard = getattr(self.model, "router_type", None) == "gshard_top2"
        if k > 1 and (gshard or getattr(self.model, "router_norm_topk", False)):
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        counted = top_e[:, :1] if gshard else top_e
        f = torch.bincount(counted.reshape(-1), minlength=e).to(probs.dtype) / counted.numel()  # (E,)
        lb = e * torch.sum(f * probs.mean(dim=0))
        z = torch.logsumexp(logits, dim=-1).square().mean()
        aux = self.aux_loss_coeff * lb + self.z_loss_coeff * z
        expert, token, weight = top_e.t().reshape(-1), torch.arange(n, device=x.device).repeat(k), top_p.t().reshape(-1)
        capacity = self.model.expert_capacity(n) if hasattr(self.model, "expert_capacity") else None
        if capacity is not None:
            onehot = F.one_hot(expert, e)  # (kN, E)
            keep = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1 < capacity
            int((~keep).sum())  # the dropped count, read on the host
            expert, token, weight = expert[keep], token[keep], weight[keep]
        order = torch.sort(expert, stable=True).indices
        expert, token, weight = expert[order], token[order], weight[order]
        counts = torch.bincount(expert, minlength=e)
        rows, outs, offset = tokens[token], [], 0  # (M, H)
        for ffn, c in zip(self.experts, counts.tolist()):
            outs.append(ffn(rows[offset:offset + c]))
            offset += c
        y = torch.cat(outs)  # (M, H)
        out = torch.zeros_like(tokens, dtype=torch.promote_types(y.dtype, weight.dtype))
        out = out.index_add(0, token, y * weight[:, None])
        if self.shared is not None:
            s = self.shared(tokens)
            out = out + (torch.sigmoid(self.shared_gate(tokens)) * s if self.shared_gate is not None else s)
        out = out.to(x.dtype).view(b, t, h)
        int(counts.sum()), float(lb.detach()), float(z.detach()), counts.detach().cpu()  # the routing counters
        if torch.is_grad_enabled() and aux.requires_grad:
            out = _AttachAux.apply(out, aux)
        return out


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


def build_layer(model, kind: str, device: torch.device, dtype: str, tp: int = 1) -> nn.Module:
    """One layer of ``kind``, or its share on one of ``tp`` devices (Megatron's split: heads and FFN widths / tp,
    K/V heads / tp or one where tp exceeds them; the hidden size whole)."""
    heads = model.num_heads
    head_dim = model.head_dim or model.hidden_size // heads
    kv_heads = model.num_kv_heads or heads
    swiglu, bias = model.ffn_type in ("swiglu", "geglu"), bool(getattr(model, "linear_bias", True))
    routed = None
    if kind == "moe":
        expert = model.expert_ffn_hidden_size or model.ffn_hidden_size
        shared = getattr(model, "num_shared_experts", 0) * (getattr(model, "shared_expert_ffn_hidden_size", None)
                                                             or expert)
        routed = _RoutedFFN(model, model.hidden_size, max(1, expert // tp), shared // tp, swiglu, bias)
    layer = _Layer(
        hidden=model.hidden_size, heads=max(1, heads // tp), kv_heads=max(1, kv_heads // tp), head_dim=head_dim,
        ffn=max(1, active_ffn_width(model, kind) // tp), swiglu=swiglu, rmsnorm=model.norm_type == "rmsnorm",
        bias=bias, rotary=getattr(model, "position_embedding", None) == "rotary", routed=routed,
    )
    return layer.to(device=device, dtype=DTYPES[dtype])


def saved_activation_bytes(forward: Callable[[], Any], module: nn.Module | None = None) -> int:
    """Bytes of the distinct tensors autograd saves for the backward during ``forward()`` (a forward with grad
    enabled), ``module``'s parameters left out: the activation memory one micro-batch holds until its backward,
    counted the same on any device."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()} if module is not None else set()
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[(t.device.type, storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return int(sum(seen.values()))


def layer_kinds(model) -> list[str]:
    """The distinct layer kinds in model order (slices with the same kinds are interchangeable)."""
    kinds: list[str] = []
    for i in range(model.num_layers):
        k = model.layer_kind(i)
        if k not in kinds:
            kinds.append(k)
    return kinds


EDGE_KINDS = ("embedding", "head")  # the model's parts outside its layers, timed like a layer kind


class _Embedding(nn.Module):
    """The runtime's embedding: token lookup (+ project_in, + learned positions); tokens (B, T) -> (B, T, H)."""

    def __init__(self, model):
        super().__init__()
        e, h = model.embedding_dim or model.hidden_size, model.hidden_size
        self.tok = nn.Embedding(model.vocab_size, e)
        self.project_in = nn.Linear(e, h, bias=False) if e != h else None
        learned = getattr(model, "position_embedding", None) == "learned"
        self.pos = nn.Embedding(model.num_position_embeddings or model.max_seq_len, h) if learned else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))[None]
        return x


class _HeadLoss(nn.Module):
    """The runtime's head and loss: final norm, (project_out,) logits, fp32 next-token cross-entropy;
    hidden (B, T, H) and targets (B, T) -> the mean loss."""

    def __init__(self, model):
        super().__init__()
        e, h = model.embedding_dim or model.hidden_size, model.hidden_size
        self.norm = ((nn.RMSNorm(h) if model.norm_type == "rmsnorm" else nn.LayerNorm(h))
                     if getattr(model, "final_norm", True) else None)
        self.project_out = nn.Linear(h, e, bias=False) if e != h else None
        self.proj = nn.Linear(e, model.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        logits = self.proj(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _edge_calls(model, kind: str, shape: LayerShape, device: torch.device):
    """(forward, backward, forward FLOPs, the module) of the embedding or the head + loss at ``shape``: ``forward()``
    returns what ``backward(it)`` back-propagates from.

    Why time them: at small shapes their cost is per-operator overhead (tiny-moe on a CPU: 0.5 ms forward+backward
    per micro-batch against ~0.15 ms from bytes and FLOPs), paid once per micro-batch like a layer's."""
    b, t = shape.micro_batch, shape.seq_len
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (b, t), device=device, generator=gen)  # (B, T)
    if kind == "embedding":
        module = _Embedding(model).to(device=device, dtype=DTYPES[shape.dtype])
        grad = torch.randn(b, t, model.hidden_size, device=device, dtype=DTYPES[shape.dtype], generator=gen)
        flops = model.embedding_forward_flops_per_token() * b * t

        def forward() -> torch.Tensor:
            return module(tokens)

        def backward(y: torch.Tensor) -> None:
            y.backward(grad)
    elif kind == "head":
        module = _HeadLoss(model).to(device=device, dtype=DTYPES[shape.dtype])
        x = torch.randn(b, t, model.hidden_size, device=device, dtype=DTYPES[shape.dtype], generator=gen,
                        requires_grad=True)  # (B, T, H)
        flops = model.head_forward_flops_per_token() * b * t

        def forward() -> torch.Tensor:
            return module(x, tokens)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()
    else:
        raise ValueError(f"edge kind must be one of {', '.join(EDGE_KINDS)}, got {kind!r}")
    return forward, backward, flops, module


def time_layer(model, kind: str, shape: LayerShape, device: torch.device, *, warmup: int, reps: int,
               min_rep_s: float, between: Callable[[], Any] | None = None, budget_s: float | None = None,
               agree: Callable[[int], int] = lambda n: n, block_cpu_s: float | None = None) -> dict[str, Measured]:
    """Forward and forward+backward seconds of one layer of ``kind`` at ``shape`` (or of the embedding, or of the
    head with the loss: ``EDGE_KINDS``); value = achieved TFLOP/s. The forward builds autograd's graph, as a
    training step's does (no_grad's forward reads faster, and the backward taken as the difference slower); the
    detail also has the activation bytes autograd saves (``saved_activation_bytes``).

    With ``between`` (a collective over the node's processes, CPU devices), each call is followed by it, ``reps``
    blocks of WAIT_BLOCK calls (bench.time_interleaved: a layer computed the way a training step meets it);
    without, calibrated back-to-back repetitions. With ``budget_s``, each pass (forward, forward+backward) takes
    about half of it: as many repetitions as fit, at most ``reps``; with ``between`` the block count is the
    smallest any member can afford (``agree``: the minimum over the node's processes, so every member issues the
    same collectives). With ``between`` and ``block_cpu_s``, blocks of back-to-back calls of at least that much
    process time each, a collective after each block (bench.time_blocks: a CPU device's speed while it computes
    without pause)."""
    torch.manual_seed(0)
    sync = device_sync(device)
    if kind in EDGE_KINDS:
        if shape.tp != 1:
            raise ValueError(f"the {kind} is timed whole (tp 1), got tp {shape.tp}")
        forward_out, backward_of, fwd_flops, module = _edge_calls(model, kind, shape, device)
    else:
        layer = module = build_layer(model, kind, device, shape.dtype, shape.tp)
        x = torch.randn(shape.micro_batch, shape.seq_len, model.hidden_size, device=device,
                        dtype=DTYPES[shape.dtype], requires_grad=True)  # (B, T, H)
        grad = torch.randn_like(x)
        index = next(i for i in range(model.num_layers) if model.layer_kind(i) == kind)
        fwd_flops = (model.layer_forward_flops_per_token(index, shape.seq_len) * shape.micro_batch * shape.seq_len
                     / shape.tp)

        def forward_out() -> torch.Tensor:
            return layer(x)

        def backward_of(y: torch.Tensor) -> None:
            y.backward(grad)

    def forward() -> None:  # with autograd's graph, as training runs it (the graph is dropped)
        forward_out()

    def forward_backward() -> None:
        backward_of(forward_out())

    activation = saved_activation_bytes(forward, module)
    split = None  # back to back in blocks: (forward+backward, the forward timed inside it)
    if block_cpu_s is not None and between is not None:
        calls = calibrate_inner(forward_backward, min_rep_s=block_cpu_s, sync=sync, clock=calibration_clock(device))
        block_s = time_blocks(forward_backward, between, blocks=1, calls=calls, sync=sync).median_s * calls  # warm
        affordable = int(budget_s / block_s) if budget_s is not None else reps
        split = time_blocks_split(forward_out, backward_of, between, blocks=agree(max(1, min(reps, affordable))),
                                  calls=calls, sync=sync)
    out = {}
    for name, fn, flops in (("forward", forward, fwd_flops), ("forward_backward", forward_backward, 3 * fwd_flops)):
        how = "each call followed by an all-to-all" if between is not None else "back to back"
        if split is not None:
            timing = split[0] if name == "forward_backward" else split[1]
            how = (f"the forward timed inside forward+backward, in blocks of {calls} back-to-back calls, each block "
                   f"followed by an all-to-all")
        elif budget_s is not None and between is not None:
            once = warm_once_s(fn, sync)
            blocks = agree(max(1, min(reps, int(budget_s / 2 / (WAIT_BLOCK * once)))))
            timing = time_interleaved(fn, between, warmup=1, blocks=blocks, calls=WAIT_BLOCK)
        elif budget_s is not None:
            timing = time_budgeted(fn, budget_s / 2, min_rep_s=min_rep_s, max_reps=reps, sync=sync,
                                   clock=calibration_clock(device))
        elif between is not None:
            timing = time_interleaved(fn, between, warmup=max(1, warmup), blocks=reps, calls=WAIT_BLOCK)
        else:
            inner = calibrate_inner(fn, min_rep_s=min_rep_s, sync=sync, clock=calibration_clock(device))
            timing = time_repeated(fn, warmup=warmup, reps=reps, inner=inner, sync=sync)
        out[name] = Measured(flops / timing.median_s / 1e12, "TFLOP/s", timing,
                             (("micro_batch", shape.micro_batch), ("seq_len", shape.seq_len),
                              ("dtype", shape.dtype), ("layer_kind", kind), ("tp", shape.tp),
                              ("activation_bytes", activation),
                              ("timed", how)))
    return out
