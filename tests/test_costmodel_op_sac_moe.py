"""torchtitan's op-level SAC on MoE blocks (costmodel/op_sac.py): the routed experts' torch._grouped_mm is outside the
policy's save list (torchtitan/models/qwen3/infra/parallelize.py _op_sac_save_list: aten.mm, the SDPA kernels, ...),
so eager op-SAC keeps none of their outputs and recomputes all of them; under torch.compile torchtitan compiles an MoE
block submodule by submodule inside the eager checkpoint wrapper (apply_compile), where compiled regions are opaque to
the policy (inductor's wrap_inductor_compiled_regions is off by default), so the block keeps its input only."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.memory import layer_activation_bytes, op_sac_bytes_per_token
from tangram_launch.costmodel.moe_dispatch import busiest_rank_load_factor, expert_gemm_rows, grouped_gemm_rows
from tangram_launch.costmodel.op_sac import block_mms
from tangram_launch.islands import Island
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.specs.cluster import ClusterSpec, GpuRef
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec


def _island(gpu_type: str = "h100-sxm", n: int = 8) -> Island:
    spec = ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}},
                                  "nodes": [{"name": "n0", "gpu": gpu_type, "count": n}]})
    return Island(name=gpu_type, nodes=("n0",), gpus=tuple(GpuRef("n0", k) for k in range(n)), gpus_per_node=n,
                  gpu=spec.nodes[0].gpus[0], inter_node_link=None)


def _qwen3(**changes):
    return dataclasses.replace(load_model("qwen3-30b-a3b-24l"), **changes)


def test_the_router_gate_is_the_fifth_mm_and_no_routed_expert_gemm_is_counted():
    """Qwen3-MoE block: wq, wk, wv, wo, gate -- the 1st, 3rd and 5th (wq, wv, the gate's E logits) saved."""
    m = _qwen3()
    mms = block_mms(m, 0)
    assert [(mm.out_width, mm.saved) for mm in mms] == [(4096, True), (512, False), (512, True), (2048, False),
                                                        (128, True)]
    sharded, whole = op_sac_bytes_per_token(m, 0)
    assert sharded == 2 * (4096 + 512) + 2 * 4096 + 4 * 32 + 2 * 2048  # wq, wv, attention out + lse, block input
    assert whole == 2 * 128  # the replicated gate's logits


@settings(max_examples=25, deadline=None)
@given(top_k=st.integers(1, 8), width=st.sampled_from([256, 768, 1536, 4096]))
def test_eager_op_sac_keeps_the_same_bytes_whatever_the_routed_experts(top_k, width):
    """torch._grouped_mm outputs are never saved: top-k and the expert width change nothing a layer keeps."""
    ref = layer_activation_bytes(_qwen3(), 0, seq_len=4096, mbs=2, recompute="selective", flash=True,
                                 selective_policy="op-sac")
    got = layer_activation_bytes(_qwen3(top_k=top_k, expert_ffn_hidden_size=width), 0, seq_len=4096, mbs=2,
                                 recompute="selective", flash=True, selective_policy="op-sac")
    assert got == ref


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_compiled_op_sac_keeps_a_moe_blocks_input_only_and_a_dense_blocks_mm_outputs(tp):
    moe = _qwen3()
    dense = load_model("llama3-8b")
    kw = dict(seq_len=8192, mbs=2, tp=tp, flash=True)
    assert (layer_activation_bytes(moe, 0, recompute="selective", selective_policy="op-sac-compiled", **kw)
            == layer_activation_bytes(moe, 0, recompute="full", **kw))
    assert (layer_activation_bytes(dense, 0, recompute="selective", selective_policy="op-sac-compiled", **kw)
            == layer_activation_bytes(dense, 0, recompute="selective", selective_policy="op-sac", **kw))


def test_op_sac_recomputes_every_routed_expert_gemm_and_compiled_moe_blocks_their_whole_forward():
    m = _qwen3()
    dev = DeviceModel.from_gpu(_island().gpu, "bf16")
    kw = dict(seq_len=4096, mbs=2, tp=1, cp=1, ep=4, dev=dev)
    lc = layer_compute(m, 0, **kw)
    tokens, h, e, k, fe = 2 * 4096, 2048, 128, 8, 768
    m_e = tokens * k * 4 / e  # a local expert's routed tokens (balanced), 32 local experts
    rows = expert_gemm_rows(group_tokens=tokens * 4, top_k=k, num_experts=e, ep=4)  # busiest rank, whole tiles
    assert rows == grouped_gemm_rows(m_e * busiest_rank_load_factor(tokens=tokens * 4, top_k=k, num_experts=e, ep=4))
    routed = dev.gemm_s(rows, 2 * fe, h, count=32) + dev.gemm_s(rows, h, fe, count=32)
    wk, wo = dev.gemm_s(tokens, 512, h), dev.gemm_s(tokens, h, 4096)
    assert lc.recompute_s("selective", "op-sac") == pytest.approx(lc.elementwise_s + wk + wo + routed)
    assert lc.recompute_flops("selective", "op-sac") == pytest.approx(
        2 * tokens * (512 * h + h * 4096) + 2 * m_e * 32 * (2 * fe * h + h * fe))
    assert lc.recompute_s("selective", "op-sac-compiled") == lc.forward_s == lc.recompute_s("full")
    dense = layer_compute(load_model("llama3-8b"), 0, **kw)
    assert dense.recompute_s("selective", "op-sac-compiled") == dense.recompute_s("selective", "op-sac")


def test_a_compiled_ep_stage_keeps_less_and_reruns_its_forward_and_all_to_alls():
    m = _qwen3()
    tr = TrainingSpec(global_batch=16, seq_len=4096, dtype="bf16")
    q = SliceQuery(model=m, training=tr, layers=(0, m.num_layers), island=_island(), microbatch_sequences=8,
                   capabilities=RuntimeCapabilities(name="any"), pipelined=False)
    stage = {p: SliceCoster(q, selective_policy=p).plan(
        ParallelConfig(tp=1, pp=1, dp=8, ep=8, recompute="selective", zero_stage=3)).stages[0]
        for p in ("op-sac", "op-sac-compiled")}
    full = SliceCoster(q, selective_policy="op-sac").plan(
        ParallelConfig(tp=1, pp=1, dp=8, ep=8, recompute="full", zero_stage=3)).stages[0]
    eager, compiled = stage["op-sac"], stage["op-sac-compiled"]
    assert compiled.activation_bytes == pytest.approx(full.activation_bytes)  # every layer is MoE
    assert compiled.activation_bytes < eager.activation_bytes
    assert compiled.backward_s == pytest.approx(full.backward_s)  # forward, EP all-to-alls included, again
    assert compiled.backward_s > eager.backward_s
