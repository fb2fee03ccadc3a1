"""The profiler times what the torch runtime runs: its MoE layer's routing (auxiliary losses, capacity, sort) and
the parts outside the layers (embedding, head + loss), checked against the runtime's own modules with the same
weights. A stand-in that skips an operator the runtime pays reads fast and the cost model under-predicts."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers_timing import layer_times_in_order
from profiler.layer import EDGE_KINDS, LayerShape, _Embedding, _HeadLoss, build_layer, time_layer
from tangram_launch.specs.model import load_model


def _variants():
    tiny = load_model("tiny-moe")
    yield tiny
    # GShard top-2 with capacity (drops) and a gated shared expert, router bias, GELU experts
    yield dataclasses.replace(tiny, name="gshard-variant", router_type="gshard_top2", capacity_factor=0.6,
                              num_shared_experts=1, shared_expert_ffn_hidden_size=32, shared_expert_gate=True,
                              router_bias=True, ffn_type="gelu")


@pytest.mark.parametrize("model", list(_variants()), ids=lambda m: m.name)
def test_moe_stand_in_routes_as_the_runtime_does(model):
    """Same weights, same input: the stand-in's routed FFN returns the runtime's output and, through the attached
    load-balancing and z-losses, the runtime's router gradient."""
    from runtime_adapters.gpt import MLP
    from runtime_adapters.moe import MoEFFN

    torch.manual_seed(0)
    stand = build_layer(model, "moe", torch.device("cpu"), "fp32").routed
    real = MoEFFN(model, lambda width: MLP(model, width))
    real.aux_loss_coeff, real.z_loss_coeff = stand.aux_loss_coeff, stand.z_loss_coeff
    with torch.no_grad():
        real.router.weight.copy_(stand.router.weight)
        if real.router.bias is not None:
            real.router.bias.copy_(stand.router.bias)
        pairs = [(real.experts[str(e)], stand.experts[e]) for e in range(model.num_experts)]
        if model.num_shared_experts:
            pairs.append((real.shared[0], stand.shared))
            real.shared_gate.weight.copy_(stand.shared_gate.weight)
        for r, s in pairs:
            r.fc_in.weight.copy_(s.up.weight)
            r.fc_out.weight.copy_(s.down.weight)
            if r.gate is not None:
                r.gate.weight.copy_(s.gate.weight)
    x = torch.randn(2, 16, model.hidden_size)
    grad = torch.randn_like(x)
    outs = []
    for module in (real, stand):
        xi = x.clone().requires_grad_()
        y = module(xi)
        y.backward(grad)
        outs.append((y.detach(), xi.grad, module.router.weight.grad))
    (y_r, gx_r, gw_r), (y_s, gx_s, gw_s) = outs
    torch.testing.assert_close(y_s, y_r)
    torch.testing.assert_close(gx_s, gx_r)
    torch.testing.assert_close(gw_s, gw_r)  # includes the auxiliary losses' gradient
    if model.capacity_factor:
        assert real.stats.dropped > 0  # the variant exercises capacity


def test_head_stand_in_is_the_runtimes_head_and_loss():
    from runtime_adapters.gpt import Embedding, Head, lm_loss

    model = dataclasses.replace(load_model("tiny"), name="projected", embedding_dim=32)
    torch.manual_seed(0)
    emb, head = _Embedding(model), _HeadLoss(model)
    r_emb, r_head = Embedding(model), Head(model)
    r_emb.load_state_dict(emb.state_dict())
    r_head.load_state_dict(head.state_dict())
    tokens = torch.randint(0, model.vocab_size, (2, 16))
    torch.testing.assert_close(emb(tokens), r_emb(tokens))
    x = torch.randn(2, 16, model.hidden_size)
    torch.testing.assert_close(head(x, tokens), lm_loss(r_head(x), tokens))


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_edges_are_timed_like_a_layer_kind(kind):
    out = layer_times_in_order(lambda: time_layer(load_model("tiny-moe"), kind, LayerShape(1, 16, "fp32"),
                                                  torch.device("cpu"), warmup=1, reps=3, min_rep_s=0.002))
    assert dict(out["forward"].detail)["layer_kind"] == kind
    with pytest.raises(ValueError, match="edge kind"):
        from profiler.layer import _edge_calls
        _edge_calls(load_model("tiny-moe"), "lm", LayerShape(1, 16, "fp32"), torch.device("cpu"))
