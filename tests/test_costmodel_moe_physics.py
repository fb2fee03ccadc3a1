"""An MoE block whose input is replicated over TP, as torchtitan runs TP + EP (costmodel/moe_dispatch.py
``MoERuntime.replicated_tp_input``, costmodel/compute.py, costmodel/breakdown.py ``_sp_pairs`` and
``SliceCoster._expert_comm_s``): torchtitan's apply_moe_ep_tp all-gathers the block's input over TP, scores every
token on every TP rank, and with etp = tp (ExpertTensorParallel) each TP rank dispatches all its tokens over its EP
group with no all-gather over the experts' TP group; Megatron-core's all-to-all dispatcher permutes the SP shard."""
from __future__ import annotations

import pytest

from tangram_launch.costmodel import communication as comm
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.moe_dispatch import MoERuntime, permutation_traffic_h, router_traffic_bytes
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpu, island

QWEN = load_model("qwen3-30b-a3b")  # 128 experts, top-8, expert width 768
TOKENS = 2 * 4096  # mbs 2 at s 4096 per TP group


def _coster(**kw):
    return coster(QWEN, island("h200", nodes=1, per_node=8), b=4, gb=8, seq=4096, **kw)


def test_dtensor_tp_replicates_the_moe_input_and_megatron_does_not():
    """The runtime fact is DTensor TP's (whole_column_inputs: PrepareModuleInput(Shard(1) -> Replicate())), which
    torchtitan applies to the MoE block as to the attention and the MLP; the planner's default stays Megatron's."""
    assert _coster(whole_column_inputs=True).moe_runtime.replicated_tp_input
    assert not _coster().moe_runtime.replicated_tp_input
    rt = MoERuntime(expert_tensor_parallel=4, replicated_tp_input=True)
    assert (rt.dispatch_factor(4), rt.router_factor(4), rt.gathers_over_etp(4)) == (4, 4, False)
    folded = MoERuntime(expert_tensor_parallel=1, replicated_tp_input=True)  # ReordererSequenceParallel
    assert (folded.dispatch_factor(4), folded.router_factor(4), folded.gathers_over_etp(4)) == (1, 4, False)
    assert (MoERuntime().dispatch_factor(4), MoERuntime().router_factor(4), MoERuntime().gathers_over_etp(4)) == \
        (1, 1, True)


def test_a_replicated_moe_input_pays_the_mlps_sequence_parallel_pair():
    """torchtitan all-gathers the block's input before the router and reduce-scatters its Partial output after the
    combine: an EP MoE layer under TP moves M x h over TP twice per forward (attention and MoE), Megatron-core's
    all-to-all dispatcher once (the attention)."""
    dtensor, megatron = _coster(whole_column_inputs=True), _coster()
    tp, ep, dp, mbs = 4, 2, 2, 2
    link = megatron._link(1, tp, tp * dp)
    act = TOKENS * QWEN.hidden_size * 2
    pair = comm.collective_s(comm.ALL_GATHER, act, tp, link) + comm.collective_s(comm.REDUCE_SCATTER, act, tp, link)
    assert megatron.layer_terms("moe", tp, 1, ep, dp, mbs).tp_fwd_s == pytest.approx(pair)
    assert dtensor.layer_terms("moe", tp, 1, ep, dp, mbs).tp_fwd_s == pytest.approx(2 * pair)


def test_expert_tensor_parallel_dispatches_every_token_of_the_tp_rank_and_gathers_none():
    """ExpertTensorParallel (etp = tp = 4, EP 2 over the data-parallel ranks, 4 apart): the all-to-all carries the
    top-k copies of all M tokens, and no all-gather / reduce-scatter over the experts' TP group follows; Megatron's
    dispatcher all-to-alls the copies of M / tp tokens, then gathers etp of those buffers."""
    dtensor, megatron = _coster(whole_column_inputs=True, expert_tensor_parallel=4), _coster(expert_tensor_parallel=4)
    tp, ep, gpus = 4, 2, 8
    ep_link, tp_link = megatron._link(tp, ep, gpus), megatron._link(1, tp, gpus)
    copies = TOKENS * QWEN.top_k * QWEN.hidden_size * 2  # all M tokens' copies
    counts = comm.collective_s(comm.ALL_TO_ALL, QWEN.num_experts * 8, ep, ep_link)
    fwd, bwd = dtensor._expert_comm_s(TOKENS, tp, ep, tp, gpus)
    assert bwd == pytest.approx(2 * comm.collective_s(comm.ALL_TO_ALL, copies, ep, ep_link))
    assert fwd == pytest.approx(bwd + counts)
    shard = copies / tp
    gather = (comm.collective_s(comm.ALL_GATHER, shard * tp, tp, tp_link)
              + comm.collective_s(comm.REDUCE_SCATTER, shard * tp, tp, tp_link))
    assert megatron._expert_comm_s(TOKENS, tp, ep, tp, gpus)[1] == \
        pytest.approx(2 * comm.collective_s(comm.ALL_TO_ALL, shard, ep, ep_link) + gather)


def test_a_replicated_input_keeps_the_expert_gemms_and_permutes_every_token():
    """Under either runtime a GPU's experts see M k ep / E rows each, cut in etp: the routed GEMMs are the same. The
    replicated input makes every TP rank permute and combine the copies of all M tokens (the tp ranks' shards under
    Megatron) with no regroup of etp ranks' gathered copies, and score all M with the router."""
    dev = DeviceModel.from_gpu(gpu("h200"), "bf16")
    tp, ep, k, h, p = 4, 2, QWEN.top_k, QWEN.hidden_size, 2
    kw = dict(seq_len=4096, mbs=2, tp=tp, cp=1, ep=ep, dev=dev, use_measured=False)
    megatron = layer_compute(QWEN, 0, moe_runtime=MoERuntime(expert_tensor_parallel=tp), **kw)
    dtensor = layer_compute(QWEN, 0, moe_runtime=MoERuntime(expert_tensor_parallel=tp, replicated_tp_input=True),
                            **kw)
    router_gemm = dev.gemm_s(TOKENS, QWEN.num_experts, h) - dev.gemm_s(TOKENS / tp, QWEN.num_experts, h)
    assert dtensor.gemm_s - megatron.gemm_s == pytest.approx(router_gemm)
    perm = dict(top_k=k, ep=ep, local_experts=QWEN.num_experts / ep, dispatcher="alltoall", fused=False,
                combine_ratio=2.0)
    rows_megatron = permutation_traffic_h(etp=tp, **perm) * TOKENS / tp
    rows_dtensor = permutation_traffic_h(etp=1, **perm) * TOKENS
    router = router_traffic_bytes(num_experts=QWEN.num_experts, top_k=k, dtype_bytes=p) * (TOKENS - TOKENS / tp)
    assert dtensor.elementwise_s - megatron.elementwise_s == \
        pytest.approx(dev.memory_s((rows_dtensor - rows_megatron) * h * p + router))
    assert dtensor.elementwise_s > megatron.elementwise_s


def test_without_tp_the_replicated_input_changes_nothing():
    """At tp 1 there is nothing to replicate: the layer's time and communication are Megatron's."""
    dtensor, megatron = _coster(whole_column_inputs=True), _coster()
    a, b = dtensor.layer_terms("moe", 1, 1, 8, 8, 4), megatron.layer_terms("moe", 1, 1, 8, 8, 4)
    assert (a.fwd_s, a.bwd_s, a.tp_fwd_s, a.ep_fwd_s, a.ep_bwd_s) == (b.fwd_s, b.bwd_s, b.tp_fwd_s, b.ep_fwd_s,
                                                                        b.ep_bwd_s)


def test_eager_pytorch_runs_an_moe_blocks_norms_rotary_and_swiglu_as_a_dense_blocks():
    """Without torch.compile an MoE block's RMSNorms make their fp32 passes, RoPE and repeat_kv theirs, and the
    experts' SwiGLU is silu then multiply, as in a dense block (compute.elementwise_bytes_per_token): the eager layer's
    element-wise time exceeds the fused one's by exactly that traffic on the GPU's M / t tokens; GEMMs are the same."""
    from tangram_launch.costmodel.compute import EAGER_SWIGLU_BYTES, elementwise_bytes_per_token

    fused_dev = DeviceModel.from_gpu(gpu("h200"), "bf16")
    eager_dev = DeviceModel.from_gpu(gpu("h200"), "bf16", fused_elementwise=False)
    kw = dict(seq_len=4096, mbs=2, tp=1, cp=1, ep=8, use_measured=False)
    fused, eager = layer_compute(QWEN, 0, dev=fused_dev, **kw), layer_compute(QWEN, 0, dev=eager_dev, **kw)
    block = elementwise_bytes_per_token(QWEN, 0, 2, False) - elementwise_bytes_per_token(QWEN, 0, 2, True)
    swiglu = (EAGER_SWIGLU_BYTES - 2 * 3) * QWEN.top_k * QWEN.expert_ffn_hidden_size
    assert block > 0
    assert eager.elementwise_s - fused.elementwise_s == pytest.approx(fused_dev.memory_s((block + swiglu) * TOKENS))
    assert eager.gemm_s == fused.gemm_s
