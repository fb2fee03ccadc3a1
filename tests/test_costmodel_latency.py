"""Fixed cost per collective call: measured on the node (the profiler's tiny all-to-all) or NVLink's, and MoE's
tokens-per-expert exchange costed as the third all-to-all of an expert-parallel forward."""
from __future__ import annotations

import pytest
import torch

from tangram_launch.costmodel import communication as comm
from tangram_launch.costmodel.efficiency import INTRA_NODE_LATENCY_S, DeviceModel
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpu, island


def _cpu(latency_us=None, group=2):
    measured = {"device": "cpu", "allreduce_busbw_gbps": 1.0, "allreduce_group_size": group}
    if latency_us is not None:
        measured["collective_latency_us"] = latency_us
    return gpu("cpu", measured=measured)


def test_measured_latency_is_per_ring_step():
    assert DeviceModel.from_gpu(_cpu(), "fp32").intra_latency_s == INTRA_NODE_LATENCY_S
    two = DeviceModel.from_gpu(_cpu(300.0, group=2), "fp32")
    assert two.intra_latency_s == pytest.approx(300e-6) and "collective_latency_us" in two.sources
    # the same tiny all-to-all over 4 ranks took 3 steps
    assert DeviceModel.from_gpu(_cpu(300.0, group=4), "fp32").intra_latency_s == pytest.approx(100e-6)
    assert DeviceModel.from_gpu(gpu("h100-sxm"), "bf16").intra_latency_s == INTRA_NODE_LATENCY_S


def test_intra_node_collectives_pay_the_measured_latency():
    dev = DeviceModel.from_gpu(_cpu(300.0), "fp32")
    link = comm.group_link(1, 2, stage_gpus=2, gpus_per_node=2, dev=dev, inter_bandwidth_GBps=None)
    assert link.latency_s == pytest.approx(300e-6)
    tiny = comm.collective_s(comm.ALL_TO_ALL, 8.0, 2, link)  # 8 bytes: the latency is all of it
    assert tiny == pytest.approx(300e-6, rel=1e-3)
    assert comm.p2p_stage_s(8.0, stage_gpus=1, gpus_per_node=2, same_node=True, dev=dev,
                            inter_bandwidth_GBps=None) == pytest.approx(300e-6, rel=1e-3)


def test_expert_parallel_forward_has_the_counts_exchange():
    model = load_model("tiny-moe")
    isl = island("cpu", per_node=2, measured={"device": "cpu", "allreduce_busbw_gbps": 1.0,
                                              "allreduce_group_size": 2, "collective_latency_us": 500.0})
    c = coster(model, isl, b=2, gb=8, seq=64, dtype="fp32")
    t = c.layer_terms("moe", 1, 1, 2, 2, 1)
    # backward: dispatch + combine gradients; forward: the same two plus the E-count exchange (latency-bound)
    assert t.ep_bwd_s >= 2 * 500e-6
    assert t.ep_fwd_s - t.ep_bwd_s == pytest.approx(500e-6, rel=0.01)
    dense = c.layer_terms("dense", 1, 1, 2, 2, 1)
    assert dense.ep_fwd_s == dense.ep_bwd_s == 0.0
    assert c.layer_terms("moe", 1, 1, 1, 2, 1).ep_fwd_s == 0.0  # no expert parallelism, no all-to-all


def test_layer_stand_in_has_the_runtime_operators():
    """The profiled layer uses the torch runtime's separate q/k/v and gate/up projections and rotary embedding."""
    from profiler.layer import build_layer

    model = load_model("tiny-moe")
    layer = build_layer(model, "dense", torch.device("cpu"), "fp32")
    names = {n for n, _ in layer.named_parameters()}
    assert {"q.weight", "k.weight", "v.weight", "ffn.gate.weight", "ffn.up.weight"} <= names
    assert layer.rotary and layer.k.out_features == model.num_kv_heads * model.head_dim
    x = torch.randn(2, 16, model.hidden_size)
    assert layer(x).shape == x.shape
    moe = build_layer(model, "moe", torch.device("cpu"), "fp32")
    assert len(moe.routed.experts) == model.num_experts and moe(x).shape == x.shape
