"""Cost-model formulas against published figures, and the monotonicity a planner relies on.

Sources: Kaplan et al. 2020 (C ~ 6N), Korthikanti et al. 2022 (activation memory, Table 2), Rajbhandari et al. 2020
(ZeRO model states, Fig. 1), Shoeybi et al. 2019 (Megatron-LM: 1.2B is the largest GPT that trains on one 32 GB
V100, 2.5B needs 2-way model parallelism), nccl-tests (bus-bandwidth factors).
"""
import dataclasses
import math

import pytest

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel import communication as comm
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster, balanced_split
from tangram_launch.costmodel.pipeline import iteration_time_s, simulate_1f1b
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import GIB, DeviceModel, saturating_efficiency
from tangram_launch.costmodel.memory import (
    korthikanti_activation_bytes,
    layer_activation_bytes,
    layer_param_split,
    model_state_bytes,
)
from tangram_launch.errors import SpecError
from tangram_launch.islands import Island
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.parallelizers.megatron import MegatronParallelizer
from tangram_launch.specs.cluster import ClusterSpec, GpuRef, LinkSpec
from tangram_launch.specs.model import ModelSpec, load_model
from tangram_launch.specs.training import TrainingSpec

ANY = RuntimeCapabilities(name="any")


def gpu(gpu_type, **overrides):
    node = {"name": "x", "gpu": gpu_type, "count": 1, **overrides}
    return ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}}, "nodes": [node]}).nodes[0].gpus[0]


def island(gpu_type, nodes=1, per_node=8, net_gbps=25.0, **overrides):
    names = tuple(f"n{i}" for i in range(nodes))
    return Island(name=gpu_type, nodes=names, gpus=tuple(GpuRef(n, k) for n in names for k in range(per_node)),
                  gpus_per_node=per_node, gpu=gpu(gpu_type, **overrides),
                  inter_node_link=LinkSpec(net_gbps, 2.0) if nodes > 1 else None)


def gpt(name, h, a, layers, vocab=51200, seq=2048):
    return ModelSpec(name=name, num_layers=layers, hidden_size=h, num_heads=a, num_kv_heads=a, ffn_hidden_size=4 * h,
                     vocab_size=vocab, max_seq_len=seq, tied_embeddings=True)


def coster(model, isl, *, b=1, gb=8, seq=None, dtype="bf16", layers=None, caps=ANY, grad_dtype="fp32", **kw):
    tr = TrainingSpec(global_batch=gb, seq_len=seq or model.max_seq_len, dtype=dtype, grad_dtype=grad_dtype)
    q = SliceQuery(model=model, training=tr, layers=layers or (0, model.num_layers), island=isl,
                   microbatch_sequences=b, capabilities=caps)
    return SliceCoster(q, **kw)


# ------------------------------------------------------------------------------------------------ FLOPs
@pytest.mark.parametrize("name", ["gpt3-13b", "llama3-8b"])
def test_training_flops_per_token_is_6n(name):
    """Kaplan et al. 2020: training costs ~6N FLOPs per token (N = parameters that multiply activations). The cost
    model's per-GPU forward FLOPs x 3 (backward = 2x), summed over a TP-4 stage, must be within 6 %: the causal
    attention term s/(12h) (3.3 % for 13B, 4.2 % for 8B at s = 2048) is what 6N leaves out."""
    m = load_model(name)
    c = coster(m, island("a100-80gb"), b=1, seq=2048)
    plan = c.plan(ParallelConfig(tp=4))
    st = plan.stages[0]
    per_token = 3 * st.breakdown["forward_flops"] * st.shape.tp / 2048
    six_n = 6 * m.active_matmul_params()
    assert six_n < per_token < 1.06 * six_n
    assert st.breakdown["backward_flops"] == pytest.approx(2 * st.breakdown["forward_flops"])


def test_recompute_adds_forward_work():
    m = gpt("g", 2048, 16, 4)
    dev = DeviceModel.from_gpu(gpu("v100-32gb"), "fp16")
    lc = layer_compute(m, 0, seq_len=2048, mbs=1, tp=1, cp=1, ep=1, dev=dev)
    assert lc.recompute_s("full") == lc.forward_s
    assert 0 < lc.recompute_s("selective") == lc.attention_core_s < lc.forward_s
    assert lc.recompute_s("none") == 0.0
    assert lc.backward_s == 2 * lc.forward_s


def test_gemm_efficiency_saturates_with_size_and_drops_with_tp():
    from tangram_launch.costmodel.efficiency import gemm_efficiency_for

    dev = DeviceModel.from_gpu(gpu("a100-80gb"), "bf16")
    e = gemm_efficiency_for("a100-80gb")
    effs = [dev.gemm_efficiency(m, 5120, 5120) for m in (64, 512, 4096, 32768)]
    assert effs == sorted(effs) and e - 0.05 < effs[-1] < e  # approaches e_gemm from below
    assert dev.gemm_efficiency(4096, 5120 / 8, 5120) < dev.gemm_efficiency(4096, 5120, 5120)
    # the closed form of the curve agrees with the kernel model
    m, n, k = 2048, 640, 5120
    intensity = 2 * m * n * k / (2 * (m * k + k * n + m * n))
    assert saturating_efficiency(intensity, dev) == pytest.approx(dev.gemm_efficiency(m, n, k))


def test_measured_gemm_throughput_replaces_peak_times_efficiency():
    base = DeviceModel.from_gpu(gpu("a100-80gb"), "bf16")
    meas = DeviceModel.from_gpu(gpu("a100-80gb", measured={"gemm_tflops": {"bf16": 280.0},
                                                         "allreduce_busbw_gbps": 200}), "bf16")
    from tangram_launch.costmodel.efficiency import gemm_efficiency_for

    assert base.gemm_flops == pytest.approx(312e12 * gemm_efficiency_for("a100-80gb"))
    assert meas.gemm_flops == pytest.approx(280e12) and meas.intra_busbw == pytest.approx(200e9)
    assert "gemm_tflops" in meas.sources
    m = gpt("g", 4096, 32, 2)
    slow = layer_compute(m, 0, seq_len=2048, mbs=1, tp=1, cp=1, ep=1, dev=base).forward_s
    fast = layer_compute(m, 0, seq_len=2048, mbs=1, tp=1, cp=1, ep=1, dev=meas).forward_s
    assert fast < slow


def test_gemm_efficiency_is_per_gpu_generation_where_fitted_and_the_default_elsewhere():
    from tangram_launch.costmodel.efficiency import GEMM_EFFICIENCY, GEMM_EFFICIENCY_BY_GPU

    a100, h100, h200 = (DeviceModel.from_gpu(gpu(t), "bf16") for t in ("a100-80gb", "h100-sxm", "h200"))
    assert a100.gemm_flops == pytest.approx(312e12 * GEMM_EFFICIENCY_BY_GPU["a100-80gb"])
    assert h100.gemm_flops == pytest.approx(989e12 * GEMM_EFFICIENCY_BY_GPU["h100-sxm"])
    # the H200 is the H100's die at the same power: the same figure, so a mixed cluster prices their GEMMs alike
    assert h200.gemm_flops == pytest.approx(h100.gemm_flops)
    # the B200 sustains about the H100's share of its peak in whole jobs (MLPerf Training v4.1: 2.0-2.2x the H100 per
    # GPU at a 2.27x peak ratio): its GEMMs price at the peaks' ratio, not 1.2x beyond it
    b200 = DeviceModel.from_gpu(gpu("b200"), "bf16")
    assert b200.gemm_flops / h100.gemm_flops == pytest.approx(2250 / 989)
    assert DeviceModel.from_gpu(gpu("l40s"), "bf16").gemm_flops == pytest.approx(362e12 * GEMM_EFFICIENCY)
    # an A100 sustains a larger share of its peak than an H100, but the H100 stays the faster GPU (2-2.5x)
    assert GEMM_EFFICIENCY_BY_GPU["a100-80gb"] > GEMM_EFFICIENCY_BY_GPU["h100-sxm"]
    assert 2.0 < h100.gemm_flops / a100.gemm_flops < 2.5
    # the other GH100 parts take the SXM figure against their own (lower) peaks: slower than the SXM part
    pcie = DeviceModel.from_gpu(gpu("h100-pcie"), "bf16")
    assert pcie.gemm_flops == pytest.approx(756e12 * GEMM_EFFICIENCY_BY_GPU["h100-sxm"])
    assert pcie.gemm_flops < h100.gemm_flops
    # fused attention runs on the same tensor cores: it scales with the GPU's sustained bf16 rate, fp8 runs too
    h100_fp8 = DeviceModel.from_gpu(gpu("h100-sxm"), "fp8")
    assert h100.attention_flops / 989e12 == pytest.approx(h100_fp8.attention_flops / 989e12)
    faster = DeviceModel.from_gpu(gpu("h100-sxm", measured={"gemm_tflops": {"bf16": 692.0}}), "bf16")
    assert h100.attention_flops / h100.peak_flops < faster.attention_flops / faster.peak_flops
    assert h200.attention_flops == pytest.approx(h100.attention_flops)


def test_measured_layer_time_is_used():
    m = gpt("g", 1024, 16, 2)
    key = "g|dense|seq=2048|mbs=1|tp=1"
    dev = DeviceModel.from_gpu(gpu("a100-80gb", measured={"layer_forward_s": {key: 0.0123}}), "bf16")
    lc = layer_compute(m, 0, seq_len=2048, mbs=1, tp=1, cp=1, ep=1, dev=dev)
    analytic = layer_compute(m, 0, seq_len=2048, mbs=1, tp=1, cp=1, ep=1, dev=dev, use_measured=False)
    # no measured backward: the analytic backward/forward ratio (2 x, plus FlashAttention's recomputed scores)
    assert lc.measured and lc.forward_s == 0.0123
    assert lc.backward_s == pytest.approx(0.0123 * analytic.backward_s / analytic.forward_s)
    assert 2.0 * 0.0123 < lc.backward_s < 2.5 * 0.0123


def test_gpu_without_the_dtype_is_refused_with_alternatives():
    with pytest.raises(SpecError, match="fp16"):
        DeviceModel.from_gpu(gpu("v100-32gb"), "bf16")


# ------------------------------------------------------------------------------------------------ activations
def test_korthikanti_reference_values():
    """Korthikanti et al. 2022, sec. 4: GPT-3 175B (a = 96, h = 12288, s = 2048) has 5as/h = 80, more than twice
    the 34 of the rest of the layer; TP without SP keeps 10 sbh unsharded."""
    s, b, h, a = 2048, 1, 12288, 96
    assert korthikanti_activation_bytes(s, b, h, a) == s * b * h * (34 + 80)
    assert korthikanti_activation_bytes(s, b, h, a, 8) == s * b * h * (34 + 80) / 8
    assert korthikanti_activation_bytes(s, b, h, a, 8, sequence_parallel=False) == s * b * h * (10 + 24 / 8 + 10)
    assert korthikanti_activation_bytes(s, b, h, a, 8, recompute="selective") == 34 * s * b * h / 8
    assert korthikanti_activation_bytes(s, b, h, a, 8, recompute="full") == 2 * s * b * h / 8


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_activations_reproduce_korthikanti_for_gpt_layers(tp, recompute):
    """The term-by-term count (GQA/SwiGLU/MoE-aware) equals Table 2 for a GPT layer (MHA, 4h GeLU, 16-bit)."""
    m = gpt("gpt3-175b", 12288, 96, 2)
    got = layer_activation_bytes(m, 0, seq_len=2048, mbs=2, tp=tp, recompute=recompute, flash=False)
    assert got == pytest.approx(korthikanti_activation_bytes(2048, 2, 12288, 96, tp, recompute=recompute))


def test_activations_adapt_to_gqa_swiglu_moe_and_cp():
    llama = load_model("llama3-8b")
    h, f, q, kv = 4096, 14336, 4096, 1024
    # Llama trains without dropout: no masks (GPT-style models keep Korthikanti's 1-byte masks, below)
    per_token = (2 * h + 2 * (q + 2 * kv) + 2 * q) + (2 * h + 2 * 3 * f) + 4 * h  # attn, SwiGLU MLP, norms
    got = layer_activation_bytes(llama, 0, seq_len=4096, mbs=1, recompute="selective", flash=False)
    assert got == pytest.approx(4096 * per_token)
    with_dropout = dataclasses.replace(llama, dropout=True)
    masks = layer_activation_bytes(with_dropout, 0, seq_len=4096, mbs=1, recompute="selective", flash=False)
    assert masks == pytest.approx(4096 * (per_token + 2 * h))  # attention and MLP dropout masks, 1 byte each
    # CP shards tokens; each query chunk still meets all keys, so the s^2 term shrinks by cp too
    full = layer_activation_bytes(llama, 0, seq_len=4096, mbs=1, cp=1, flash=False)
    assert layer_activation_bytes(llama, 0, seq_len=4096, mbs=1, cp=4, flash=False) == pytest.approx(full / 4)
    # MoE: top-k copies of each token through an expert: more than a dense layer with the expert's width
    mix = load_model("mixtral-8x7b")
    moe = layer_activation_bytes(mix, 0, seq_len=4096, mbs=1, recompute="selective", flash=True)
    assert moe > got * 1.5


def test_recompute_order_of_activation_memory():
    m = load_model("gpt3-13b")
    for flash in (False, True):
        none, sel, full = (layer_activation_bytes(m, 0, seq_len=2048, mbs=1, tp=2, recompute=r, flash=flash)
                           for r in ("none", "selective", "full"))
        assert full < sel <= none
        assert (sel < none) == (not flash)  # FlashAttention never stores the s x s scores


def test_more_tp_means_less_memory_per_gpu():
    m = load_model("gpt3-13b")
    c = coster(m, island("a100-80gb"), b=1, gb=16)
    mem = []
    for tp in (1, 2, 4, 8):
        plan = c.plan(ParallelConfig(tp=tp, recompute="selective"))
        mem.append(plan.stages[0].memory_bytes(0, 16))
    assert all(a > b for a, b in zip(mem, mem[1:])), mem


def test_memory_grows_with_stages_after_until_m():
    m = load_model("gpt3-13b")
    c = coster(m, island("a100-80gb"), b=1, gb=6, layers=(10, 20))
    st = c.plan(ParallelConfig(tp=4)).stages[0]
    mem = [st.memory_bytes(k, 6) for k in range(10)]
    assert all(a < b for a, b in zip(mem[:6], mem[1:6]))
    assert mem[5] == mem[6] == mem[9]  # min(k + 1, m) saturates at m = 6


# ------------------------------------------------------------------------------------------------ model states
@pytest.mark.parametrize("zero,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(zero, expected_gb):
    """Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12):
    120 GB -> 31.4 GB (P_os) -> 16.6 GB (P_os+g) -> 1.9 GB (P_os+g+p) per GPU."""
    got = model_state_bytes(7.5e9, shard=64, zero_stage=zero, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    assert got.total / 1e9 == pytest.approx(expected_gb, abs=0.06)


def test_zero_through_the_stage_cost():
    """The same figures come out of a stage's breakdown with a TrainingSpec of 2/2/12 bytes per parameter (a stage
    holding the whole model: under pipelining FSDP2 keeps more, tests/test_dp_exposure.py)."""
    m = gpt("g", 2048, 16, 8)
    c = coster(m, island("a100-80gb", nodes=8), b=64, gb=64, grad_dtype="fp16")
    params = None
    per_zero = {}
    for zero in range(4):
        st = c.plan(ParallelConfig(dp=64, zero_stage=zero)).stages[0]
        params = st.breakdown["params_per_gpu"]
        per_zero[zero] = st.breakdown["parameters_bytes"] + st.breakdown["gradients_bytes"] + \
            st.breakdown["optimizer_bytes"]
    assert per_zero[0] == pytest.approx(16 * params)
    assert per_zero[1] == pytest.approx((4 + 12 / 64) * params)
    assert per_zero[2] == pytest.approx((2 + 14 / 64) * params)
    assert per_zero[3] == pytest.approx(16 / 64 * params)


def test_offload_moves_the_optimizer_state_to_the_host_and_nothing_else():
    """runtime_adapters/offload.py: the optimizer (state, update and the parameter copy it updates) on the host;
    parameters and gradients stay on the GPU under their ZeRO sharding, whatever the ZeRO stage."""
    for zero in range(4):
        kept = model_state_bytes(1e9, shard=4, zero_stage=zero)
        off = model_state_bytes(1e9, shard=4, zero_stage=zero, offload=True, host_master_bytes=4)
        assert off.parameters == kept.parameters > 0 and off.gradients == kept.gradients > 0
        assert off.optimizer == 0 and off.host == pytest.approx(kept.optimizer + 4e9 / (4 if zero else 1))
    z3 = model_state_bytes(1e9, shard=4, zero_stage=3, offload=True)
    assert z3.total == pytest.approx((2 + 2) * 1e9 / 4) and z3.host == pytest.approx(12e9 / 4)


def test_offload_charges_host_memory_and_pcie_traffic_per_iteration():
    """What runtime_adapters/offload.py does per step: this GPU's gradients down and its parameters up over PCIe;
    the optimizer state lives in host memory."""
    m = gpt("g", 2048, 16, 8)
    c = coster(m, island("a100-80gb", nodes=1), b=8, gb=64, grad_dtype="fp16", layers=(2, 6))
    kept = c.plan(ParallelConfig(dp=8, zero_stage=1)).stages[0]
    off = c.plan(ParallelConfig(dp=8, zero_stage=1, offload=True)).stages[0]
    params = off.breakdown["params_per_gpu"]
    assert off.breakdown["offload_pcie_bytes"] == pytest.approx(params / 8 * (2 + 2))  # ZeRO-1: its shard
    assert kept.breakdown["offload_pcie_bytes"] == 0.0 and kept.breakdown["host_offload_bytes"] == 0.0
    assert off.breakdown["host_offload_bytes"] == pytest.approx(kept.breakdown["optimizer_bytes"])
    assert off.breakdown["optimizer_bytes"] == 0.0
    assert off.optimizer_s > kept.optimizer_s  # PCIe copies and CPU Adam are slower than a fused GPU update


def test_moe_expert_parameters_split_from_the_rest():
    mix = load_model("mixtral-8x7b")
    dense, experts = layer_param_split(mix, 0)
    assert experts == pytest.approx(8 * 3 * 4096 * 14336)
    assert dense + experts == mix.layer_params(0)


# ------------------------------------------------------------------------------------------------ published fit
def _fits_one_v100(model):
    """Megatron-LM 2019 setting: fp16 mixed precision (16 bytes/param), Adam, activation checkpointing per layer,
    8 sequences of 1024 tokens per GPU; no ZeRO, no offload."""
    caps = RuntimeCapabilities(name="megatron-2019", max_zero_stage=0, offload=False, recompute_modes=("full",),
                               context_parallel=False)
    tr = TrainingSpec(global_batch=8, seq_len=1024, dtype="fp16", grad_dtype="fp16")
    q = SliceQuery(model=model, training=tr, layers=(0, model.num_layers), island=island("v100-32gb", per_node=1),
                   microbatch_sequences=8, capabilities=caps)
    return MegatronParallelizer().query(q)


def test_megatron_2019_largest_model_on_one_v100_32gb():
    """Shoeybi et al. 2019 (Megatron-LM), sec. 5.1 and Table 1: the 1.2B GPT (h 1536, 16 heads, 40 layers) is the
    largest that trains on a single 32 GB V100; the 2.5B one (h 1920, 20 heads, 54 layers) needs 2 GPUs."""
    small = _fits_one_v100(gpt("megatron-1.2b", 1536, 16, 40, seq=1024))
    assert small.plans and small.infeasible is None
    big = _fits_one_v100(gpt("megatron-2.5b", 1920, 20, 54, seq=1024))
    assert not big.plans and big.infeasible is not None
    assert big.infeasible.min_memory_bytes > 32 * GIB
    assert big.infeasible.breakdown["parameters_bytes"] + big.infeasible.breakdown["gradients_bytes"] + \
        big.infeasible.breakdown["optimizer_bytes"] == pytest.approx(16 * 2.5e9, rel=0.05)


# ------------------------------------------------------------------------------------------------ communication
def test_nccl_tests_bus_factors():
    assert comm.bus_factor(comm.ALL_REDUCE, 8) == pytest.approx(2 * 7 / 8)
    assert comm.bus_factor(comm.ALL_GATHER, 8) == comm.bus_factor(comm.REDUCE_SCATTER, 8) == pytest.approx(7 / 8)
    assert comm.bus_factor(comm.ALL_TO_ALL, 4) == pytest.approx(3 / 4)
    assert comm.bus_factor(comm.SEND_RECV, 2) == 1.0
    assert comm.bus_factor(comm.ALL_REDUCE, 1) == 0.0
    link = comm.GroupLink(busbw=100e9, latency_s=0.0)
    assert comm.collective_s(comm.ALL_REDUCE, 1e9, 4, link) == pytest.approx(1e9 * 1.5 / 100e9)
    # all-reduce = reduce-scatter + all-gather
    assert comm.collective_s(comm.ALL_REDUCE, 1e9, 4, link) == pytest.approx(
        comm.collective_s(comm.REDUCE_SCATTER, 1e9, 4, link) + comm.collective_s(comm.ALL_GATHER, 1e9, 4, link))


def test_groups_crossing_nodes_share_the_network():
    dev = DeviceModel.from_gpu(gpu("a100-80gb"), "bf16")
    intra = comm.group_link(1, 8, stage_gpus=16, gpus_per_node=8, dev=dev, inter_bandwidth_GBps=25.0)
    assert not intra.inter_node and intra.busbw == dev.intra_busbw == pytest.approx(600 / 2 * 0.8 * 1e9)
    # dp group of a tp=8 stage over 2 nodes: 8 such groups share each node's 25 GB/s link
    across = comm.group_link(8, 2, stage_gpus=16, gpus_per_node=8, dev=dev, inter_bandwidth_GBps=25.0)
    assert across.inter_node and across.busbw == pytest.approx(25e9 * 0.9 / 8)


def test_dp_sync_uses_the_slow_link_when_dp_spans_nodes():
    m = load_model("gpt3-1.3b")
    c = coster(m, island("a100-80gb", nodes=2, net_gbps=3.125), b=2, gb=16)
    across = c.plan(ParallelConfig(tp=8, dp=2)).stages[0].dp_sync_s
    c1 = coster(m, island("a100-80gb", nodes=1), b=2, gb=16)
    inside = c1.plan(ParallelConfig(tp=4, dp=2)).stages[0].dp_sync_s
    assert across > 20 * inside


# ------------------------------------------------------------------------------------------------ stages
def test_balanced_split_even_and_lighter_edges():
    assert balanced_split([1.0] * 10, 3) in ((3, 3, 4), (3, 4, 3), (4, 3, 3))
    assert sum(balanced_split([1.0] * 40, 4, last_extra=2.0)) == 40
    sizes = balanced_split([1.0] * 40, 4, first_extra=0.2, last_extra=2.0)
    assert sizes[-1] < max(sizes)  # the head's stage carries fewer layers
    # bottleneck equals the optimum of a brute force over all splits of a small instance
    w = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    best = min(max(sum(w[:i]) + 0.5, sum(w[i:j]), sum(w[j:]) + 1.5) for i in range(1, 7) for j in range(i + 1, 8))
    a, b, _c = balanced_split(w, 3, first_extra=0.5, last_extra=1.5)
    got = max(sum(w[:a]) + 0.5, sum(w[a:a + b]), sum(w[a + b:]) + 1.5)
    assert got == pytest.approx(best)


def test_balanced_split_memo_returns_the_computed_split():
    """The cross-context memo answers exactly what the bisection computes, for lists and tuples alike, and still
    rejects impossible splits."""
    from tangram_launch.costmodel import partition
    import random
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(2, 60)
        w = [round(rng.random() * 3, 4) for _ in range(n)]
        parts, fe, le = rng.randint(1, min(n, 9)), round(rng.random(), 3), round(rng.random() * 4, 3)
        want = partition._balanced_split(w, parts, first_extra=fe, last_extra=le)
        assert balanced_split(w, parts, first_extra=fe, last_extra=le) == want
        assert balanced_split(tuple(w), parts, first_extra=fe, last_extra=le) == want
        assert sum(want) == n and len(want) == parts
    with pytest.raises(ValueError):
        balanced_split([1.0] * 3, 4)


def test_head_stage_holds_logits_and_tied_embedding_copy():
    from tangram_launch.costmodel.memory import FRAGMENTATION_FRACTION, embedding_activation_bytes, \
        head_activation_bytes

    m = load_model("gpt3-13b")  # tied embeddings
    c = coster(m, island("a100-80gb"), b=1, gb=8)
    first, last = c.plan(ParallelConfig(pp=2, tp=4)).stages
    assert first.breakdown["has_embedding"] and last.breakdown["has_head"]
    per_layer = layer_activation_bytes(m, 0, seq_len=2048, mbs=1, tp=4, flash=True)
    head = head_activation_bytes(m, seq_len=2048, mbs=1, tp=4)
    # 4sbh + (2 + 4)sbv: bf16 logits and their fp32 copy (softmax, then gradient, in place), / t
    assert head == pytest.approx(2048 * (4 * 5120 + 6 * 51200) / 4)
    n_last = last.layers[1] - last.layers[0]
    assert last.activation_bytes == pytest.approx((n_last * per_layer + head) * (1 + FRAGMENTATION_FRACTION))
    n_first = first.layers[1] - first.layers[0]
    emb = embedding_activation_bytes(m, seq_len=2048, mbs=1, tp=4)
    assert first.activation_bytes == pytest.approx((n_first * per_layer + emb) * (1 + FRAGMENTATION_FRACTION))
    # the last stage keeps a copy of the tied output weights and all-reduces their gradient with the first stage
    assert last.breakdown["params_per_gpu"] > (n_last * m.layer_params(0) + m.output_embedding_params()) / 4 * 0.999
    assert last.dp_sync_s > 0


def test_iteration_time_1f1b():
    m = load_model("gpt3-1.3b")
    c = coster(m, island("a100-80gb"), b=2, gb=16)
    plan = c.plan(ParallelConfig(pp=4, dp=2))
    est = iteration_time_s(plan.stages, 8)
    t = [s.time_s for s in plan.stages]
    # the 1F1B simulation of the stage times (the one every prediction uses), bounded by the closed form
    simulated = max(b.end_s for b in simulate_1f1b([s.forward_s for s in plan.stages],
                                                   [s.backward_s for s in plan.stages], [0.0] * 3, 8))
    assert est["pipeline_s"] == pytest.approx(simulated)
    assert 8 * max(t) <= est["pipeline_s"] <= sum(t) + 7 * max(t) + 1e-12  # the bottleneck runs all 8; the bound
    assert est["bubble_s"] == pytest.approx(est["pipeline_s"] - 8 * max(t))
    assert math.isclose(est["iteration_s"], est["pipeline_s"] + max(s.dp_sync_s + s.optimizer_s for s in plan.stages))


def test_bad_configuration_is_a_spec_error():
    m = load_model("gpt3-13b")
    c = coster(m, island("a100-80gb"), b=1, gb=8)
    with pytest.raises(SpecError, match="tp=3"):
        c.plan(ParallelConfig(tp=3))
    with pytest.raises(SpecError, match="GPUs"):
        c.plan(ParallelConfig(tp=8, pp=2))
    with pytest.raises(SpecError, match="recompute"):
        ParallelConfig(recompute="some")


def test_measured_forward_backward_replaces_the_2x_rule():
    """A profile with forward and forward+backward times per layer gives the measured backward (CPUs run it at
    3-3.5x the forward, not 2x); with only the forward measured the 2x rule stands."""
    from tangram_launch.costmodel.compute import layer_compute, measured_layer_key
    from tangram_launch.costmodel.efficiency import DeviceModel
    from tangram_launch.specs.cluster import GPUSpec
    from tangram_launch.specs.model import load_model

    model = load_model("tiny")
    key = measured_layer_key(model.name, "dense", 64, 2, 1)
    base = dict(type="cpu", tflops={"fp32": 0.1}, memory_gib=16, memory_bandwidth_GBps=10,
                intra_node_bandwidth_GBps=10)
    both = GPUSpec(**base, measured={"layer_forward_s": {key: 0.010}, "layer_forward_backward_s": {key: 0.043}})
    fwd_only = GPUSpec(**base, measured={"layer_forward_s": {key: 0.010}})
    kw = dict(seq_len=64, mbs=2, tp=1, cp=1, ep=1)
    lc = layer_compute(model, 0, dev=DeviceModel.from_gpu(both, "fp32"), **kw)
    assert lc.measured and lc.forward_s == pytest.approx(0.010) and lc.backward_s == pytest.approx(0.033)
    lc = layer_compute(model, 0, dev=DeviceModel.from_gpu(fwd_only, "fp32"), **kw)
    assert lc.backward_s == pytest.approx(0.020)



def test_eager_elementwise_kernels_move_the_counted_bytes_and_slow_a_layer():
    """torchtitan's eager Llama (no torch.compile): RMSNorm in six fp32 passes, RoPE through complex fp32, GQA's
    repeat_kv copies, SwiGLU as silu then multiply; the default (fused, as Megatron/TE or torch.compile run them)
    is what the planner uses."""
    from tangram_launch.costmodel.compute import elementwise_bytes_per_token, ffn_elementwise_bytes_per_token

    llama = load_model("llama3-8b")
    h, q, kv, f = llama.hidden_size, llama.q_dim, llama.kv_dim, llama.ffn_hidden_size
    eager = elementwise_bytes_per_token(llama, 0, 2, fused=False) + ffn_elementwise_bytes_per_token(llama, f, 2, False)
    fused = elementwise_bytes_per_token(llama, 0, 2, fused=True) + ffn_elementwise_bytes_per_token(llama, f, 2, True)
    assert eager == 2 * 36 * h + 20 * (q + kv) + 4 * (kv + q) + 4 * q + 12 * h + 10 * f
    assert fused == 2 * (11 * h + 3 * f) and 2.5 * fused < eager
    kw = dict(seq_len=8192, mbs=1, tp=1, cp=1, ep=1)
    dev = DeviceModel.from_gpu(gpu("a100-80gb"), "bf16")
    slow = layer_compute(llama, 0, dev=DeviceModel.from_gpu(gpu("a100-80gb"), "bf16", fused_elementwise=False), **kw)
    fast = layer_compute(llama, 0, dev=dev, **kw)
    assert dev.fused_elementwise and slow.gemm_s == fast.gemm_s
    assert slow.elementwise_s == pytest.approx(fast.elementwise_s * eager / fused)
    assert 1.05 < slow.forward_s / fast.forward_s < 1.25  # a few to 20 % of a layer: memory-bound passes


@pytest.mark.parametrize("name, layers", [("gpt3-1.3b", (0, 24)), ("gpt3-1.3b", (3, 17)), ("gshard-moe-2.4b", (1, 16))])
def test_some_stages_of_a_grid_are_the_whole_grids_stages(name, layers):
    """stage_sums(stages=...) (the stage table costs only the first stage of each signature it has not met) gives
    the full grid's sums at those stages to the last bit, p2p terms to both neighbours included; split is
    stage_ranges of split_sizes."""
    m = load_model(name)
    isl = island("a100-80gb", nodes=2, per_node=4)
    skip = {"zero_parts", "collectives", "rec_parts"}  # caches filled on use
    for tp, pp, dp in ((1, 4, 2), (2, 4, 1), (1, 8, 1), (4, 2, 1), (2, 2, 2)):
        full = coster(m, isl, b=8, gb=64, layers=layers).stage_sums(tp, pp, dp, 1, 1)
        c = coster(m, isl, b=8, gb=64, layers=layers)  # a fresh coster: no grid cached
        picked = [pp - 1, 0, pp // 2]
        part = c.stage_sums(tp, pp, dp, 1, 1, stages=picked)
        for j, st in zip(picked, part):
            for f in dataclasses.fields(st):
                if f.name not in skip:
                    assert getattr(st, f.name) == getattr(full[j], f.name), (tp, pp, dp, j, f.name)
        assert c.split(pp, tp, 1, 1, dp, 8 // dp) == c.stage_ranges(c.split_sizes(pp, tp, 1, 1, dp, 8 // dp))
        assert tuple(st.layers for st in full) == c.split(pp, tp, 1, 1, dp, 8 // dp)
