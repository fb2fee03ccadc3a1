"""The host's floor under a layer's time (tangram_launch/costmodel/host_floor.py): no pass runs faster than the host
dispatches its operators. The operator counts are checked against the profiler's layer, counted here with a
dispatch-mode counter (the same operators as the torch runtime's layer, profiler/layer.py), over generated models."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from profiler.host_ops import REFERENCE_WIDTHS
from profiler.host_ops import counted_ops as count_ops
from profiler.layer import build_layer
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.host_floor import HOST_OP_S, layer_host_floor_s, layer_host_ops
from tangram_launch.costmodel.slice_plan import ParallelConfig
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpu, island


def counted_ops(model, kind: str, tp: int, tokens: int = 64) -> tuple[int, int]:
    """(forward, backward) aten operators of the profiler's layer, on a CPU at ``tokens`` tokens (enough that every
    expert gets rows)."""
    torch.manual_seed(0)
    layer = build_layer(model, kind, torch.device("cpu"), "fp32", tp=tp)
    x = torch.randn(1, tokens, model.hidden_size, requires_grad=True)
    out: list = []
    fwd = count_ops(lambda: out.append(layer(x)))
    loss = out[0].float().sum()
    return fwd, count_ops(loss.backward)


@settings(max_examples=12, deadline=None)
@given(rotary=st.booleans(), rmsnorm=st.booleans(), kv_heads=st.sampled_from([1, 2, 4]), gated=st.booleans(),
       bias=st.booleans(), tp=st.sampled_from([1, 2, 4]))
def test_a_dense_layers_count_is_the_operators_the_layer_dispatches(rotary, rmsnorm, kv_heads, gated, bias, tp):
    model = dataclasses.replace(load_model("llama3-8b"), **{**REFERENCE_WIDTHS, "num_kv_heads": kv_heads},
                                position_embedding="rotary" if rotary else "learned",
                                num_position_embeddings=0 if rotary else 8192,
                                norm_type="rmsnorm" if rmsnorm else "layernorm", ffn_type="swiglu" if gated else "gelu",
                                linear_bias=bias)
    assert layer_host_ops(model, 0, tp=tp) == counted_ops(model, "dense", tp)


@settings(max_examples=12, deadline=None)
@given(experts=st.sampled_from([2, 4, 8]), top_k=st.sampled_from([1, 2]), shared=st.sampled_from([0, 1, 2]),
       gate=st.booleans(), router_bias=st.booleans(), norm_topk=st.booleans(), capacity=st.booleans(),
       gated=st.booleans(), bias=st.booleans())
def test_an_moe_layers_count_is_the_operators_the_layer_dispatches(experts, top_k, shared, gate, router_bias,
                                                                     norm_topk, capacity, gated, bias):
    model = dataclasses.replace(load_model("tiny-moe"), num_experts=experts, top_k=top_k, num_shared_experts=shared,
                                shared_expert_gate=gate and shared > 0, router_bias=router_bias,
                                router_norm_topk=norm_topk, capacity_factor=1.25 if capacity else None,
                                ffn_type="swiglu" if gated else "gelu", linear_bias=bias)
    moe_layer = next(i for i in range(model.num_layers) if model.is_moe_layer(i))
    assert layer_host_ops(model, moe_layer) == counted_ops(model, "moe", 1)


def test_each_expert_parallel_rank_loops_over_its_own_experts_only():
    model = load_model("qwen3-30b-a3b")
    fwd1, bwd1 = layer_host_ops(model, 0, ep=1)
    fwd8, bwd8 = layer_host_ops(model, 0, ep=8)
    local = model.num_experts - model.num_experts / 8  # experts the EP-8 rank does not run
    assert (fwd1 - fwd8, bwd1 - bwd8) == (pytest.approx(local * 9), pytest.approx(local * 28))  # SwiGLU, no bias


def test_the_device_model_takes_the_measured_figure_else_the_catalogs_on_a_gpu_and_none_on_a_cpu():
    assert DeviceModel.from_gpu(gpu("h100-sxm"), "bf16").host_op_s == HOST_OP_S
    measured = DeviceModel.from_gpu(gpu("h100-sxm", measured={"host_op_us": 11.0}), "bf16")
    assert measured.host_op_s == pytest.approx(11e-6) and "host_op_us" in measured.sources
    assert DeviceModel.from_gpu(gpu("cpu"), "fp32").host_op_s == 0.0
    assert DeviceModel.from_gpu(gpu("cpu", measured={"host_op_us": 5.0}), "fp32").host_op_s == pytest.approx(5e-6)


def _layer(model, dev, **shape):
    return layer_compute(model, 0, cp=1, ep=1, dev=dev, **shape)


def test_a_small_shape_runs_at_the_hosts_pace_and_a_large_one_at_its_compute():
    """A 1.3B GPT layer at TP 8, one 512-token sequence, on an H100 computes in well under the host's dispatch
    time; a Llama-3-8B layer at 8k tokens computes in far more. The floor sets the first and leaves the second."""
    dev = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16")
    bare = dataclasses.replace(dev, host_op_s=0.0)
    small, big = load_model("gpt3-1.3b"), load_model("llama3-8b")
    fwd_floor, bwd_floor = layer_host_floor_s(small, 0, dev.host_op_s, tp=8)
    lc, lc0 = _layer(small, dev, seq_len=512, mbs=1, tp=8), _layer(small, bare, seq_len=512, mbs=1, tp=8)
    assert lc0.forward_s < fwd_floor and lc0.backward_s < bwd_floor
    assert (lc.forward_s, lc.backward_s) == (fwd_floor, bwd_floor)
    assert lc.recompute_s("full") == fwd_floor  # a rerun forward dispatches its operators again
    lb, lb0 = _layer(big, dev, seq_len=8192, mbs=1, tp=1), _layer(big, bare, seq_len=8192, mbs=1, tp=1)
    assert (lb.forward_s, lb.backward_s) == (lb0.forward_s, lb0.backward_s)
    assert lb.forward_s > 10 * layer_host_floor_s(big, 0, dev.host_op_s)[0]


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["tiny", "gpt3-1.3b", "llama3-8b", "tiny-moe", "qwen3-30b-a3b-24l"]),
       seq=st.sampled_from([64, 512, 4096]), mbs=st.sampled_from([1, 2, 8]), tp=st.sampled_from([1, 2, 8]),
       host_us=st.floats(0.0, 50.0))
def test_the_floor_only_raises_a_layers_time_and_to_exactly_the_larger_of_the_two(name, seq, mbs, tp, host_us):
    model = load_model(name)
    dev = dataclasses.replace(DeviceModel.from_gpu(gpu("a100-80gb"), "bf16"), host_op_s=host_us * 1e-6)
    bare = dataclasses.replace(dev, host_op_s=0.0)
    layer = next(i for i in range(model.num_layers) if model.layer_kind(i) == model.layer_kind(model.num_layers - 1))
    kw = dict(seq_len=seq, mbs=mbs, tp=tp, cp=1, ep=1)
    lc, lc0 = layer_compute(model, layer, dev=dev, **kw), layer_compute(model, layer, dev=bare, **kw)
    fwd_floor, bwd_floor = layer_host_floor_s(model, layer, dev.host_op_s, tp=tp)
    assert lc.forward_s == max(lc0.forward_s, fwd_floor)
    assert lc.backward_s == max(lc0.backward_s, bwd_floor)


def test_more_tensor_parallelism_stops_paying_once_the_host_sets_the_pace():
    """A 1.3B GPT at one 512-token sequence on an 8-GPU H100 node: without the floor TP 8 computes each layer about
    8x faster than TP 1; with it, the TP-8 stage's layers take at least the host's dispatch time, so TP 8 is
    priced no faster than that."""
    model = load_model("gpt3-1.3b")
    cfg = ParallelConfig(tp=8, dp=1, zero_stage=0, recompute="none", pp=1)
    stage = coster(model, island("h100-sxm"), b=1, gb=1, seq=512).plan(cfg).stages[0]
    fwd_floor, bwd_floor = layer_host_floor_s(model, 0, HOST_OP_S, tp=8)
    assert stage.forward_s >= model.num_layers * fwd_floor
    assert stage.backward_s >= model.num_layers * bwd_floor
