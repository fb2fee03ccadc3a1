"""Mixture-of-experts FFN for the built-in GPT: router, experts, capacity, auxiliary losses, token dispatch.

One ``MoEFFN`` replaces a layer's FFN where ``ModelSpec.is_moe_layer(i)``. Per forward call (one micro-batch of one
data-parallel replica: the *routed token group*)::

    tokens (N, H) -> router logits (N, E) in fp32 -> probabilities -> top-k experts and weights per token
      -> capacity (optional): each expert keeps its first C assignments, C = ModelSpec.expert_capacity(N),
         first choices before second choices (GShard's order), tokens by position; the rest are dropped
      -> dispatch: assignments sorted by expert; with expert parallelism an all_to_all_single sends each expert's
         rows to the rank that holds it and a second one brings the outputs back
      -> combine: out[token] += weight * expert(token) over the kept assignments (a dropped assignment adds 0;
         the residual connection carries the token on), plus the shared experts on every token

Routers (``ModelSpec.router_type``): ``softmax_topk`` (Mixtral/Qwen: softmax over all experts, keep the top k,
renormalised when ``router_norm_topk`` and k > 1) and ``gshard_top2`` (top 2, renormalised, load-balancing loss
counts first choices only). Random second-expert dispatch of the GShard paper is left out: routing is deterministic.

Auxiliary losses per layer and token group, with coefficients from the training config: load balancing
``E * sum_e f_e * P_e`` (Fedus et al. 2022, eq. 4; f_e = share of assignments routed to e before capacity, P_e = mean
router probability of e) and router z-loss ``mean_t logsumexp(logits_t)^2`` (Zoph et al. 2022, eq. 5). They do not
change the forward value: the layer attaches them to its output so that backward adds their gradient (scaled by
``aux_grad_scale``, the factor the caller multiplies its loss by before backward) without any loss plumbing through a
pipeline schedule. The last values and the token counts are kept in ``stats`` for reporting.

Experts are named by *global* expert index (``layers.3.mlp.experts.5.fc_in.weight``) whichever rank holds them, and
each is seeded by (seed, layer, expert), so a rank holding experts [4, 8) starts with the same weights as the whole
model and checkpoints written under one expert layout load under another. Plain torch; collectives only when an
``ExpertDispatch`` group is bound (``runtime_adapters.expert_parallel``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tangram_launch.specs.model import ModelSpec


def expert_seed(seed: int, layer: int, expert: int) -> int:
    """Seed of routed expert ``expert`` of layer ``layer`` (independent of which rank builds it)."""
    return (seed * 1_000_003 + (layer + 1) * 7919 + (expert + 1) * 104_729 + 17) % (2**63 - 1)


@dataclass
class ExpertDispatch:
    """This rank's expert-parallel group: ``size`` ranks, this one at ``rank``, holding global experts
    [rank * local, (rank + 1) * local) of every MoE layer (``group``: a torch ProcessGroup)."""

    group: Any
    size: int
    rank: int


@dataclass
class MoEStats:
    """Counters of one MoE layer since the last ``reset`` (routed = kept + dropped assignments)."""

    routed: int = 0
    dropped: int = 0
    load_balancing_loss: float = 0.0  # of the last forward call
    z_loss: float = 0.0
    calls: int = 0
    expert_load: torch.Tensor | None = None  # (E,) int64: kept assignments per global expert, routed on this rank

    def reset(self) -> None:
        self.routed = self.dropped = self.calls = 0
        self.expert_load = None


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; backward also sends ``scale`` as the gradient of the scalar ``aux`` (so d(aux)/d(router)
    joins the parameter gradients as if ``aux * scale`` had been added to the loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows (M, H) with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        out = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


@dataclass(frozen=True)
class Routing:
    """Kept assignments sorted by expert (stable): row j sends token ``token[j]`` to ``expert[j]`` with ``weight[j]``.

    token, expert: (M,) int64; weight: (M,) fp32; counts: (E,) int64 assignments per expert (sum M).
    """

    token: torch.Tensor
    expert: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor
    dropped: int
    aux: torch.Tensor  # scalar: coefficients already applied
    load_balancing_loss: torch.Tensor
    z_loss: torch.Tensor


def route(logits: torch.Tensor, spec: ModelSpec, *, aux_loss_coeff: float, z_loss_coeff: float) -> Routing:
    """Top-k routing of one token group: logits (N, E) fp32 -> kept assignments, dropped count, auxiliary losses."""
    n, e = logits.shape
    k = spec.top_k
    probs = logits.softmax(dim=-1)  # (N, E)
    top_p, top_e = probs.topk(k, dim=-1)  # (N, k) each, best first
    if k > 1 and (spec.router_type == "gshard_top2" or spec.router_norm_topk):
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    # load balancing: f_e from assignments before capacity (first choices only for GShard), P_e mean probability
    counted = top_e[:, :1] if spec.router_type == "gshard_top2" else top_e  # (N, k') with k' = 1 or k
    f = torch.bincount(counted.reshape(-1), minlength=e).to(probs.dtype) / counted.numel()  # (E,)
    lb = e * torch.sum(f * probs.mean(dim=0))
    z = torch.logsumexp(logits, dim=-1).square().mean()
    aux = aux_loss_coeff * lb + z_loss_coeff * z

    # assignments choice-major: all first choices, then all second choices, ... (GShard's capacity priority)
    expert = top_e.t().reshape(-1)  # (k*N,)
    token = torch.arange(n, device=logits.device).repeat(k)  # (k*N,)
    weight = top_p.t().reshape(-1)  # (k*N,)
    capacity = spec.expert_capacity(n)
    dropped = 0
    if capacity is not None:
        onehot = F.one_hot(expert, e)  # (k*N, E)
        position = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1  # (k*N,) place in its expert's queue
        keep = position < capacity
        dropped = int((~keep).sum())
        expert, token, weight = expert[keep], token[keep], weight[keep]
    order = torch.sort(expert, stable=True).indices
    expert, token, weight = expert[order], token[order], weight[order]
    counts = torch.bincount(expert, minlength=e)
    return Routing(token=token, expert=expert, weight=weight, counts=counts, dropped=dropped, aux=aux,
                   load_balancing_loss=lb.detach(), z_loss=z.detach())


class MoEFFN(nn.Module):
    """Routed experts (the ones this rank holds) + shared experts; (B, T, H) -> (B, T, H).

    ``make_ffn(width)`` builds one FFN of inner width ``width`` (the GPT's own MLP), so experts are the same
    gated/ungated FFNs as the dense layers, at ``expert_ffn_hidden_size``.
    """

    def __init__(self, spec: ModelSpec, make_ffn: Callable[[int], nn.Module], *,
                 experts: range | None = None) -> None:
        super().__init__()
        experts = range(spec.num_experts) if experts is None else experts
        if not (0 <= experts.start < experts.stop <= spec.num_experts and experts.step == 1):
            raise ValueError(f"experts must be a contiguous range inside 0..{spec.num_experts} (got {experts})")
        self.spec = spec
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=spec.router_bias)
        self.shared = nn.ModuleList(make_ffn(spec.shared_expert_ffn_hidden_size)
                                    for _ in range(spec.num_shared_experts))
        self.shared_gate = nn.Linear(spec.hidden_size, 1, bias=False) if spec.shared_expert_gate else None
        self.experts = nn.ModuleDict({str(i): make_ffn(spec.expert_ffn_hidden_size) for i in experts})
        self.local_experts = experts
        self.dispatch: ExpertDispatch | None = None  # set by expert_parallel.bind_expert_parallel
        self.aux_loss_coeff = 0.0
        self.z_loss_coeff = 0.0
        self.aux_grad_scale = 1.0  # what the caller multiplies its loss by before backward (fp16 loss scale)
        self.stats = MoEStats()

    def _experts_on_rows(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows (M, H) grouped by local expert (``counts[j]`` rows for local expert j) -> outputs (M, H)."""
        outs = []
        offset = 0
        for j, module in enumerate(self.experts.values()):  # every expert runs, on 0 rows too: grads always exist
            outs.append(module(rows[offset:offset + counts[j]]))
            offset += counts[j]
        return torch.cat(outs) if outs else rows[:0]

    def _expert_parallel(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (M, H) sorted by global expert, counts (E,) -> outputs (M, H) in the same order, computed on the
        ranks that hold the experts (two all_to_all_single of the rows, one of the counts)."""
        import torch.distributed as dist

        d = self.dispatch
        local = len(self.local_experts)
        recv_counts = torch.empty_like(counts)  # (E,) = (ep sources x local experts) counts for this rank
        dist.all_to_all_single(recv_counts, counts, group=d.group)
        send_splits = counts.view(d.size, local).sum(dim=1).tolist()
        recv_splits = recv_counts.view(d.size, local).sum(dim=1).tolist()
        recv = _AllToAll.apply(rows, recv_splits, send_splits, d.group)  # (R, H) by source, then local expert
        local_expert = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(d.size),
                                               recv_counts)  # (R,)
        order = torch.sort(local_expert, stable=True).indices  # expert-major, sources in rank order inside
        per_expert = recv_counts.view(d.size, local).sum(dim=0).tolist()
        out = self._experts_on_rows(recv[order], per_expert)  # (R, H)
        back = torch.empty_like(out).index_copy(0, order, out)  # by source again
        return _AllToAll.apply(back, send_splits, recv_splits, d.group)  # (M, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)  # (N, H)
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32 (Fedus et al. 2022, sec. 2.4)
            bias = None if self.router.bias is None else self.router.bias.float()
            logits = F.linear(tokens.float(), self.router.weight.float(), bias)  # (N, E)
            r = route(logits, self.spec, aux_loss_coeff=self.aux_loss_coeff, z_loss_coeff=self.z_loss_coeff)
        rows = tokens[r.token]  # (M, H)
        if self.dispatch is None or self.dispatch.size == 1:
            lo = self.local_experts.start
            counts = r.counts[lo:lo + len(self.local_experts)]
            if int(counts.sum()) != r.token.numel():
                raise RuntimeError("tokens routed to experts this rank does not hold, and no expert-parallel group "
                                   "is bound (runtime_adapters.expert_parallel.bind_expert_parallel)")
            y = self._experts_on_rows(rows, counts.tolist())
        else:
            y = self._expert_parallel(rows, r.counts)
        out = torch.zeros_like(tokens, dtype=torch.promote_types(y.dtype, r.weight.dtype))  # (N, H)
        out = out.index_add(0, r.token, y * r.weight[:, None])
        if len(self.shared):
            shared = sum(m(tokens) for m in self.shared)  # (N, H)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(tokens)) * shared
            out = out + shared
        out = out.to(x.dtype).view(b, t, h)
        s = self.stats
        s.routed += int(r.counts.sum()) + r.dropped
        s.dropped += r.dropped
        s.calls += 1
        s.load_balancing_loss, s.z_loss = float(r.load_balancing_loss), float(r.z_loss)
        s.expert_load = r.counts.detach().cpu() + (0 if s.expert_load is None else s.expert_load)
        if torch.is_grad_enabled() and r.aux.requires_grad and (self.aux_loss_coeff or self.z_loss_coeff):
            out = _AttachAuxLoss.apply(out, r.aux, self.aux_grad_scale)
        return out
