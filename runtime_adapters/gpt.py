"""A small GPT built from a ModelSpec as separately constructible parts: embedding, transformer layer i, head.

Any pipeline stage builds exactly its layer range, and every part initialises itself in its constructor from its own
seeded generator (keyed by the part, not by construction order; a DeepSpeed ``LayerSpec(TransformerLayer, spec, i,
seed=s)`` builds the same weights), so a stage of any layout holds the same weights as the same part of
the whole model: the adapters' tests compare layouts against a single-process reference on that basis.
Parameter names carry the *global* layer index (``layers.7.attn.q.weight``), so state dicts of different layouts
merge and compare by name (and checkpoints stay layout-agnostic). Plain torch: no runtime imports.

Supported: dense decoder-only models with pre-norm blocks (layernorm or rmsnorm), GQA, qk-norm, gelu/relu/swiglu/
geglu FFNs, learned/rotary/no positions, a projected embedding (OPT's project_in/out) and tied embeddings when the
embedding and head live in one module. MoE layers (``runtime_adapters.moe``) where the spec puts them, for runtimes
that ask for them (``as_model_spec(..., moe=True)``). ALiBi is refused with a SpecError.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime_adapters.moe import MoEFFN, expert_seed
from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import RECOMPUTE_MODES
from tangram_launch.specs.model import ModelSpec

INIT_STD = 0.02


def as_model_spec(model: ModelSpec | Mapping[str, Any], *, moe: bool = False) -> ModelSpec:
    """A ModelSpec from a spec or its dict form (``plan.model``), refusing what this GPT cannot build (and MoE
    unless the caller runs MoE layers: ``moe=True``)."""
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_dict(model, source="plan.model")
    if spec.num_experts and not moe:
        raise SpecError("the built-in GPT has no MoE layers", field="model.num_experts", value=spec.num_experts,
                        valid="0 (a dense model)")
    if spec.position_embedding == "alibi":
        raise SpecError("the built-in GPT has no ALiBi", field="model.position_embedding", value="alibi",
                        valid="learned, rotary, none")
    return spec


def gpt_plan_problems(plan, *, moe: bool = False) -> list[str]:
    """What this GPT needs of a plan, whichever runtime runs it (pure; no process group)."""
    try:
        spec = as_model_spec(plan.model, moe=moe)
    except SpecError as exc:
        return [f"model: {exc}"]
    problems = []
    for s in plan.stages:
        for what, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                        ("ffn_hidden_size", spec.ffn_hidden_size)):
            if n % s.tp:
                problems.append(f"stage {s.index}: tp={s.tp} does not divide {what}={n}")
        if spec.num_shared_experts and spec.shared_expert_ffn_hidden_size % s.tp:
            problems.append(f"stage {s.index}: tp={s.tp} does not divide shared_expert_ffn_hidden_size="
                            f"{spec.shared_expert_ffn_hidden_size}")
    if spec.tied_embeddings and plan.num_stages > 1:
        problems.append("tied embeddings need the embedding and the head in one stage")
    seq_len = int(plan.training.get("seq_len", 0))
    if spec.position_embedding == "learned" and seq_len > spec.num_position_embeddings:
        problems.append(f"seq_len {seq_len} exceeds the model's {spec.num_position_embeddings} positions")
    return problems


def part_seed(seed: int, part: int) -> int:
    """Seed of one part: 0 = embedding, i + 1 = layer i, num_layers + 1 = head."""
    return (seed * 1_000_003 + part * 7919) % (2**63 - 1)


def _norm(spec: ModelSpec, width: int) -> nn.Module:
    if spec.norm_type == "rmsnorm":
        return nn.RMSNorm(width, eps=1e-5)
    return nn.LayerNorm(width, eps=1e-5, bias=bool(spec.norm_bias))


def _init_(module: nn.Module, generator: torch.Generator, *, residual_std: float, skip: tuple[str, ...] = ()) -> None:
    """GPT-2 init: N(0, 0.02) weights, residual output projections N(0, 0.02/sqrt(2L)), zero biases, unit norms.
    Parameters whose names start with one of ``skip`` are left alone (routed experts seed themselves)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith(skip):
                continue
            if isinstance(p, nn.Parameter) and p.ndim >= 2:
                std = residual_std if name.endswith(("attn.o.weight", "fc_out.weight")) else INIT_STD
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * std)
            elif name.endswith("bias"):
                p.zero_()
            else:  # norm weights
                p.fill_(1.0)


def _rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) on x: (B, T, nh, hd), rotate-half form."""
    _, t, _, hd = x.shape
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))  # (hd/2,)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)  # (T, hd/2)
    cos = torch.cat((ang.cos(), ang.cos()), dim=-1)[None, :, None, :].to(x.dtype)  # (1, T, 1, hd)
    sin = torch.cat((ang.sin(), ang.sin()), dim=-1)[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Embedding(nn.Module):
    """Token (+ learned position) embedding: tokens (B, T) int64 -> hidden (B, T, H)."""

    def __init__(self, spec: ModelSpec, *, seed: int = 0) -> None:
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.embedding_dim)
        self.pos = (nn.Embedding(spec.num_position_embeddings, spec.hidden_size)
                    if spec.position_embedding == "learned" else None)
        self.project_in = (nn.Linear(spec.embedding_dim, spec.hidden_size, bias=False)
                           if spec.embedding_dim != spec.hidden_size else None)
        _init_(self, torch.Generator().manual_seed(part_seed(seed, 0)), residual_std=INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)  # (B, T, E)
        if self.project_in is not None:
            x = self.project_in(x)  # (B, T, H)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))[None]
        return x


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections so tensor parallelism can split each by heads.

    Head counts are read from the projection outputs at run time, so the same code runs with the full head set or
    with a tensor-parallel shard of it (columns of q/k/v split by heads, rows of o).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        qkv_bias = spec.linear_bias or spec.qkv_bias
        self.head_dim = hd
        self.group_size = spec.num_heads // spec.num_kv_heads  # query heads per KV head (GQA)
        self.rotary = spec.position_embedding == "rotary"
        self.q = nn.Linear(h, spec.q_dim, bias=qkv_bias)
        self.k = nn.Linear(h, spec.kv_dim, bias=qkv_bias)
        self.v = nn.Linear(h, spec.kv_dim, bias=qkv_bias)
        self.o = nn.Linear(spec.q_dim, h, bias=spec.linear_bias)
        self.q_norm = _norm(spec, hd) if spec.qk_norm else None
        self.k_norm = _norm(spec, hd) if spec.qk_norm else None
        self.recompute_core = False  # selective recompute: re-run only softmax(QK^T)V in backward

    @staticmethod
    def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim)  # (B, T, nh, hd); nh = local heads under TP
        k = self.k(x).view(b, t, -1, self.head_dim)  # (B, T, nkv, hd)
        v = self.v(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = _rotary(q), _rotary(k)
        if self.group_size > 1:
            k = k.repeat_interleave(self.group_size, dim=2)
            v = v.repeat_interleave(self.group_size, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hd)
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, H)


class MLP(nn.Module):
    """One FFN (B, T, H) -> (B, T, H) of inner width ``width`` (default the dense ffn_hidden_size; MoE experts pass
    theirs); also takes rows (M, H)."""

    def __init__(self, spec: ModelSpec, width: int | None = None) -> None:
        super().__init__()
        h, f = spec.hidden_size, width or spec.ffn_hidden_size
        self.gated = spec.ffn_type in ("swiglu", "geglu")
        self.act = F.silu if spec.ffn_type == "swiglu" else F.relu if spec.ffn_type == "relu" else F.gelu
        self.fc_in = nn.Linear(h, f, bias=spec.linear_bias)
        self.gate = nn.Linear(h, f, bias=spec.linear_bias) if self.gated else None
        self.fc_out = nn.Linear(f, h, bias=spec.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.fc_out(self.act(self.gate(x)) * self.fc_in(x))
        return self.fc_out(self.act(self.fc_in(x)))


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); (B, T, H) -> (B, T, H)."""

    def __init__(self, spec: ModelSpec, index: int, *, seed: int = 0, experts: range | None = None) -> None:
        super().__init__()
        if not 0 <= index < spec.num_layers:
            raise SpecError("layer index out of range", field="layer", value=index, valid=f"0..{spec.num_layers - 1}")
        self.index = index
        self.norm1 = _norm(spec, spec.hidden_size)
        self.attn = Attention(spec)
        self.norm2 = _norm(spec, spec.hidden_size)
        moe = spec.is_moe_layer(index)
        # MoE: router, shared experts, and the routed experts in ``experts`` (global indices; default all)
        self.mlp = MoEFFN(spec, lambda width: MLP(spec, width), experts=experts) if moe else MLP(spec)
        self.recompute = "none"
        residual_std = INIT_STD / math.sqrt(2 * spec.num_layers)
        _init_(self, torch.Generator().manual_seed(part_seed(seed, index + 1)), residual_std=residual_std,
               skip=("mlp.experts.",))
        if moe:
            for e, expert in self.mlp.experts.items():
                _init_(expert, torch.Generator().manual_seed(expert_seed(seed, index, int(e))),
                       residual_std=residual_std)

    def set_recompute(self, mode: str) -> None:
        """none | selective (attention core only) | full (whole layer, re-run in backward)."""
        if mode not in RECOMPUTE_MODES:
            raise SpecError("unknown recompute mode", field="recompute", value=mode, valid=", ".join(RECOMPUTE_MODES))
        self.recompute = mode
        self.attn.recompute_core = mode == "selective"

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._block, x, use_reentrant=False)
        return self._block(x)


class Head(nn.Module):
    """Final norm and output projection: hidden (B, T, H) -> logits (B, T, V)."""

    def __init__(self, spec: ModelSpec, *, seed: int = 0) -> None:
        super().__init__()
        self.norm = _norm(spec, spec.hidden_size) if spec.final_norm else None
        self.project_out = (nn.Linear(spec.hidden_size, spec.embedding_dim, bias=False)
                            if spec.embedding_dim != spec.hidden_size else None)
        self.proj = nn.Linear(spec.embedding_dim, spec.vocab_size, bias=False)
        _init_(self, torch.Generator().manual_seed(part_seed(seed, spec.num_layers + 1)), residual_std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.proj(x)


class StageModule(nn.Module):
    """One pipeline stage: [embedding] + layers [start, stop) + [head]; the whole model when it has everything.

    Input: tokens (B, T) on the first stage, hidden (B, T, H) otherwise. Output: logits (B, T, V) on the last stage,
    hidden (B, T, H) otherwise.
    """

    def __init__(self, spec: ModelSpec, layers: tuple[int, int], *, has_embedding: bool, has_head: bool,
                 seed: int = 0, recompute: str = "none", experts: range | None = None) -> None:
        super().__init__()
        start, stop = layers
        if not 0 <= start < stop <= spec.num_layers:
            raise SpecError("layer range must be [start, stop) inside the model", field="layers",
                            value=list(layers), valid=f"0 <= start < stop <= {spec.num_layers}")
        if spec.tied_embeddings and has_embedding != has_head:
            raise SpecError("tied embeddings need the embedding and the head in one stage", field="tied_embeddings",
                            value=True, valid="false for a pipeline that splits them")
        self.spec = spec
        self.layer_range = (start, stop)
        self.embedding = Embedding(spec, seed=seed) if has_embedding else None
        self.layers = nn.ModuleDict({str(i): TransformerLayer(spec, i, seed=seed, experts=experts)
                                     for i in range(start, stop)})
        self.head = Head(spec, seed=seed) if has_head else None
        if spec.tied_embeddings and self.head is not None:
            self.head.proj.weight = self.embedding.tok.weight
        self.compute_dtype: torch.dtype | None = None  # None: run in the parameters' dtype
        self.set_recompute(recompute)

    def set_recompute(self, mode: str) -> None:
        for layer in self.layers.values():
            layer.set_recompute(mode)

    def moe_layers(self) -> list[MoEFFN]:
        """This stage's MoE FFNs, in layer order."""
        return [layer.mlp for layer in self.layers.values() if isinstance(layer.mlp, MoEFFN)]

    def set_moe_losses(self, *, aux_loss_coeff: float, z_loss_coeff: float) -> None:
        """Coefficients of the load-balancing loss and the router z-loss (``training.moe_*_coeff``)."""
        for m in self.moe_layers():
            m.aux_loss_coeff, m.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)

    def set_compute_dtype(self, dtype: torch.dtype | None) -> None:
        """Mixed precision: matmuls under autocast in ``dtype`` (bf16/fp16), parameters and gradients stay fp32."""
        self.compute_dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.compute_dtype or torch.float32,
                            enabled=self.compute_dtype is not None):
            if self.embedding is not None:
                x = self.embedding(x)
            for layer in self.layers.values():
                x = layer(x)
            if self.head is not None:
                x = self.head(x)
        return x

    def tensor_parallel_plan(self) -> dict[str, str]:
        """Megatron-style split of every layer (Shoeybi et al. 2019, sec. 3): q/k/v and the FFN's first matrices
        by columns (heads / FFN width), the attention output and the FFN's last matrix by rows, so each block needs
        one all-reduce forward and one backward. Values: "colwise" | "rowwise"; keys: submodule paths."""
        out: dict[str, str] = {}
        for key, layer in self.layers.items():
            p = f"layers.{key}"
            out.update({f"{p}.attn.q": "colwise", f"{p}.attn.k": "colwise", f"{p}.attn.v": "colwise",
                        f"{p}.attn.o": "rowwise"})
            # an MoE layer splits its shared experts; router and routed experts stay whole on every TP rank
            ffns = ([(f"{p}.mlp.shared.{j}", m) for j, m in enumerate(layer.mlp.shared)]
                    if isinstance(layer.mlp, MoEFFN) else [(f"{p}.mlp", layer.mlp)])
            for q, ffn in ffns:
                out.update({f"{q}.fc_in": "colwise", f"{q}.fc_out": "rowwise"})
                if ffn.gate is not None:
                    out[f"{q}.gate"] = "colwise"
        return out


def build_model(model: ModelSpec | Mapping[str, Any], *, seed: int = 0, recompute: str = "none") -> StageModule:
    """The whole model in one module (the single-process reference)."""
    spec = as_model_spec(model, moe=True)
    return StageModule(spec, (0, spec.num_layers), has_embedding=True, has_head=True, seed=seed, recompute=recompute)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
