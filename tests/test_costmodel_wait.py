"""Measured costs a training step pays beyond bytes and FLOPs: the wait at each collective that follows compute
(``collective_wait_us``) and the optimizer's fixed cost per parameter tensor (``optimizer_tensor_us``). Each is
charged only where the profile measured it: catalog GPUs and older profiles cost as before."""
from __future__ import annotations

import dataclasses

import pytest

from tangram_launch.costmodel import communication as comm
from tangram_launch.costmodel.compute import edge_param_tensors, layer_param_tensors
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.slice_plan import ParallelConfig
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpu, island

BASE = {"device": "cpu", "allreduce_busbw_gbps": 1.0, "allreduce_group_size": 2, "collective_latency_us": 300.0}


def _measured(**extra):
    return {**BASE, **extra}


def test_absent_figures_charge_nothing():
    for g in (gpu("h100-sxm"), gpu("cpu", measured=_measured())):
        dev = DeviceModel.from_gpu(g, "bf16" if g.type != "cpu" else "fp32")
        assert dev.collective_wait_s == 0.0 and dev.optimizer_tensor_s == 0.0
        assert not {"collective_wait_us", "optimizer_tensor_us"} & set(dev.sources)
    dev = DeviceModel.from_gpu(gpu("cpu", measured=_measured(collective_wait_us=1500.0, optimizer_tensor_us=40.0)),
                               "fp32")
    assert dev.collective_wait_s == pytest.approx(1.5e-3) and dev.optimizer_tensor_s == pytest.approx(40e-6)
    assert {"collective_wait_us", "optimizer_tensor_us"} <= set(dev.sources)


def test_wait_is_the_floor_of_each_intra_node_collective_call():
    dev = DeviceModel.from_gpu(gpu("cpu", measured=_measured(collective_wait_us=1500.0)), "fp32")
    link = comm.group_link(1, 2, stage_gpus=2, gpus_per_node=2, dev=dev, inter_bandwidth_GBps=None)
    assert link.wait_s == pytest.approx(1.5e-3)
    assert comm.collective_s(comm.ALL_TO_ALL, 8.0, 2, link) == pytest.approx(1.5e-3, rel=1e-3)
    big = 1e8  # bytes still take their bandwidth time on top of the per-call cost
    assert comm.collective_s(comm.ALL_REDUCE, big, 2, link) == pytest.approx(big * 1.0 / 1e9 + 1.5e-3)
    # a ring whose steps cost more than the measured wait keeps its latency term
    slow = dataclasses.replace(link, latency_s=1e-3)
    assert comm.collective_s(comm.ALL_REDUCE, 8.0, 4, slow) == pytest.approx(6 * 1e-3, rel=1e-3)
    # the wait was measured inside a node: a group across nodes pays the network's latency, not it
    across = comm.group_link(1, 4, stage_gpus=4, gpus_per_node=2, dev=dev, inter_bandwidth_GBps=10.0)
    assert across.inter_node and across.wait_s == 0.0


def test_expert_parallel_all_to_alls_each_pay_the_wait():
    model = load_model("tiny-moe")
    plain = coster(model, island("cpu", per_node=2, measured=_measured()), b=2, gb=8, seq=64, dtype="fp32")
    waits = coster(model, island("cpu", per_node=2, measured=_measured(collective_wait_us=2000.0)), b=2, gb=8,
                   seq=64, dtype="fp32")
    a, b = plain.layer_terms("moe", 1, 1, 2, 2, 1), waits.layer_terms("moe", 1, 1, 2, 2, 1)
    # forward: counts, dispatch, combine; backward: the gradients of dispatch and combine. Each call costs the
    # measured 2 ms instead of the 0.3 ms tiny all-to-all
    assert b.ep_fwd_s - a.ep_fwd_s == pytest.approx(3 * (2000e-6 - 300e-6), rel=1e-6)
    assert b.ep_bwd_s - a.ep_bwd_s == pytest.approx(2 * (2000e-6 - 300e-6), rel=1e-6)
    assert b.fwd_s == a.fwd_s and b.bwd_s == a.bwd_s  # compute is not touched
    dense = waits.layer_terms("dense", 1, 1, 2, 2, 1)
    assert dense.ep_fwd_s == dense.ep_bwd_s == 0.0


def test_optimizer_pays_per_parameter_tensor():
    model = load_model("tiny-moe")
    cfg = ParallelConfig(tp=1, dp=2, ep=2, zero_stage=0, recompute="none", pp=1)
    plain = coster(model, island("cpu", per_node=2, measured=_measured()), b=2, gb=8, seq=64, dtype="fp32")
    per_tensor = coster(model, island("cpu", per_node=2, measured=_measured(optimizer_tensor_us=40.0)), b=2, gb=8,
                        seq=64, dtype="fp32")
    s0, s1 = plain.plan(cfg).stages[0], per_tensor.plan(cfg).stages[0]
    tensors = sum(layer_param_tensors(model, i, ep=2) for i in range(model.num_layers)) + edge_param_tensors(
        model, has_embedding=True, has_head=True)
    assert tensors == 47  # what the torch runtime's rank holds (test below)
    assert s1.optimizer_s - s0.optimizer_s == pytest.approx(tensors * 40e-6)
    assert s1.forward_s == s0.forward_s and s1.dp_sync_s == s0.dp_sync_s


def _variants():
    tiny_moe = load_model("tiny-moe")
    yield load_model("tiny"), 1
    yield tiny_moe, 1
    yield tiny_moe, 2
    # layernorm with biases, learned positions, projected embeddings, tied weights, qk-norm, shared experts + gate
    yield dataclasses.replace(tiny_moe, name="variant", norm_type="layernorm", norm_bias=True, linear_bias=True,
                              position_embedding="learned", num_position_embeddings=None, qk_norm=True,
                              num_shared_experts=2, shared_expert_ffn_hidden_size=32, shared_expert_gate=True,
                              router_bias=True, tied_embeddings=True, ffn_type="gelu"), 2
    yield dataclasses.replace(tiny_moe, name="variant2", embedding_dim=32, qkv_bias=True, final_norm=False), 4


@pytest.mark.parametrize("model, ep", list(_variants()), ids=lambda v: getattr(v, "name", str(v)))
def test_tensor_count_matches_the_torch_runtime(model, ep):
    from runtime_adapters.expert_parallel import local_experts
    from runtime_adapters.gpt import StageModule

    experts = local_experts(model, ep, 0) if model.is_moe else None
    n = model.num_layers
    splits = [((0, n), True, True)]
    if not model.tied_embeddings:
        splits += [((0, 1), True, False), ((1, n), False, True)]
    for layers, has_emb, has_head in splits:
        module = StageModule(model, layers, has_embedding=has_emb, has_head=has_head, experts=experts)
        want = len(list(module.parameters()))
        got = sum(layer_param_tensors(model, i, ep=ep) for i in range(*layers)) + edge_param_tensors(
            model, has_embedding=has_emb, has_head=has_head)
        assert got == want, (layers, has_emb, has_head)


def test_measured_embedding_and_head_replace_their_bytes_and_flops_estimate():
    """The profiler times the embedding and the head + loss like layer kinds; the cost model charges those times
    on the stages that hold them, forward and backward; at a shape not profiled, the profiled time scaled by the
    analytic ratio between the two shapes."""
    from tangram_launch.costmodel.compute import embedding_compute, head_compute, measured_layer_key

    model = load_model("tiny-moe")
    key = {k: measured_layer_key(model.name, k, 64, 1, 1) for k in ("embedding", "head")}
    times = _measured(layer_forward_s={key["embedding"]: 1e-4, key["head"]: 4e-4},
                      layer_forward_backward_s={key["embedding"]: 3e-4, key["head"]: 9e-4})
    plain = DeviceModel.from_gpu(gpu("cpu", measured=_measured()), "fp32")
    dev = DeviceModel.from_gpu(gpu("cpu", measured=times), "fp32")
    emb, head = (f(model, seq_len=64, mbs=1, tp=1, cp=1, dev=dev) for f in (embedding_compute, head_compute))
    assert (emb.forward_s, emb.backward_s) == pytest.approx((1e-4, 2e-4))
    assert (head.forward_s, head.backward_s) == pytest.approx((4e-4, 5e-4))
    h1 = head_compute(model, seq_len=64, mbs=1, tp=1, cp=1, dev=plain)
    for shape in ({"mbs": 2, "tp": 1}, {"mbs": 1, "tp": 2}):  # not profiled there: scaled as bytes and FLOPs scale
        a = head_compute(model, seq_len=64, cp=1, dev=dev, **shape)
        b = head_compute(model, seq_len=64, cp=1, dev=plain, **shape)
        ratio = b.forward_s / h1.forward_s
        assert (a.forward_s, a.backward_s) == pytest.approx((4e-4 * ratio, 5e-4 * ratio))
        assert a.priced.how == "scaled" and a.priced.distance == 1.0
    cfg = ParallelConfig(tp=1, dp=2, ep=2, zero_stage=0, recompute="none", pp=1)
    s_plain = coster(model, island("cpu", per_node=2, measured=_measured()), b=2, gb=8, seq=64,
                     dtype="fp32").plan(cfg).stages[0]
    s_meas = coster(model, island("cpu", per_node=2, measured=times), b=2, gb=8, seq=64, dtype="fp32").plan(
        cfg).stages[0]
    e0 = embedding_compute(model, seq_len=64, mbs=1, tp=1, cp=1, dev=plain)
    h0 = head_compute(model, seq_len=64, mbs=1, tp=1, cp=1, dev=plain)
    assert s_meas.forward_s - s_plain.forward_s == pytest.approx(5e-4 - e0.forward_s - h0.forward_s)
    assert s_meas.backward_s - s_plain.backward_s == pytest.approx(7e-4 - e0.backward_s - h0.backward_s)


@pytest.mark.parametrize("dp, pp, calls", [(2, 1, 2), (1, 2, 1), (1, 1, 0)])
def test_loss_report_pays_the_wait_per_call(dp, pp, calls):
    """Each step the runtime all-reduces the loss over the last stage's replicas and broadcasts it to every rank:
    with a measured wait, the last stage pays it per call (none on a lone whole-model rank); without, nothing."""
    model = load_model("tiny")
    cfg = ParallelConfig(tp=1, dp=dp, zero_stage=0, recompute="none", pp=pp)
    kw = dict(b=dp, gb=8, seq=64, dtype="fp32")
    plain = coster(model, island("cpu", per_node=2, measured=_measured()), **kw).plan(cfg).stages
    waits = coster(model, island("cpu", per_node=2, measured=_measured(collective_wait_us=2000.0)), **kw).plan(
        cfg).stages
    # the gradient all-reduce's own call pays the wait too, instead of its ring steps' latency
    grad_sync = 2000e-6 - comm.ring_steps(comm.ALL_REDUCE, 2) * 300e-6 if dp > 1 else 0.0
    assert waits[-1].dp_sync_s - plain[-1].dp_sync_s == pytest.approx(calls * 2000e-6 + grad_sync)
    if pp > 1:
        assert waits[0].dp_sync_s == plain[0].dp_sync_s


def test_optimizer_pays_the_larger_of_memory_bound_and_measured_per_parameter_cost():
    model = load_model("tiny-moe")
    cfg = ParallelConfig(tp=1, dp=2, ep=2, zero_stage=0, recompute="none", pp=1)
    kw = dict(b=2, gb=8, seq=64, dtype="fp32")
    plain = coster(model, island("cpu", per_node=2, measured=_measured()), **kw).plan(cfg).stages[0]
    slow = coster(model, island("cpu", per_node=2, measured=_measured(optimizer_param_ns=5.0)), **kw).plan(
        cfg).stages[0]
    tiny = coster(model, island("cpu", per_node=2, measured=_measured(optimizer_param_ns=1e-6)), **kw).plan(
        cfg).stages[0]
    params = slow.breakdown["params_per_gpu"]
    assert slow.optimizer_s == pytest.approx(params * 5e-9)  # above the memory-bound term, which it replaces
    assert plain.optimizer_s < slow.optimizer_s
    assert tiny.optimizer_s == plain.optimizer_s  # below it: the memory-bound term stays
    assert DeviceModel.from_gpu(gpu("h100-sxm"), "bf16").optimizer_param_s == 0.0  # catalog: not charged
