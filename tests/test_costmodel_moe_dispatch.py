"""MoE token dispatch and the experts' own process grid, as Megatron-core runs them (costmodel/breakdown.py
``SliceCoster._expert_comm_s``, costmodel/compute.py, costmodel/memory.py ``expert_gathered_input_bytes``)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel import communication as comm
from tangram_launch.costmodel.breakdown import ParallelConfig
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.memory import expert_gathered_input_bytes, layer_activation_bytes, layer_param_split
from tangram_launch.costmodel.moe_dispatch import (GROUPED_GEMM_TILE_ROWS, MoERuntime, busiest_rank_load_factor,
                                                   copies_per_token, expected_ranks_reached, grouped_gemm_rows,
                                                   permutation_traffic_h, router_traffic_bytes)
from tangram_launch.errors import SpecError
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpu, island

QWEN = load_model("qwen3-30b-a3b")  # 128 experts, top-8, expert width 768
ETP1 = MoERuntime(expert_tensor_parallel=1)


def _coster(**kw):
    return coster(QWEN, island("h100-sxm", nodes=2, per_node=8, net_gbps=50.0), b=8, gb=16, seq=4096, **kw)


def test_expert_tp_one_keeps_an_ep8_group_on_one_node():
    """Megatron-MoE-ModelZoo's Qwen3-235B 'Intra-node EP strategy' runs TP 2, EP 8, ETP 1: the expert grid is
    (etp, ep, edp) with etp fastest, so EP 8 takes 8 adjacent GPUs, one node; with the experts TP-sharded like the
    attention (Megatron's default, etp = tp = 2) the EP group spans two nodes."""
    folded, default = _coster(expert_tensor_parallel=1), _coster()
    assert not folded._link(folded.etp(2), 8, 16).inter_node
    assert default._link(default.etp(2), 8, 16).inter_node


def test_dispatch_is_all_to_all_then_all_gather_over_the_experts_tp_group():
    """MoEAlltoAllTokenDispatcher: all-to-all of a rank's top-k copies of its SP shard over EP, then (expert TP > 1)
    gather_from_sequence_parallel_region over the experts' TP group; combine is the reduce-scatter and the all-to-all
    back. The forward also exchanges the E token counts."""
    c = _coster()
    tokens, tp, ep = 4 * 4096, 2, 4
    copies = tokens / tp * QWEN.top_k * QWEN.hidden_size * 2
    ep_link, tp_link = c._link(tp, ep, 16), c._link(1, tp, 16)
    a2a = comm.collective_s(comm.ALL_TO_ALL, copies, ep, ep_link)
    gather = (comm.collective_s(comm.ALL_GATHER, copies * tp, tp, tp_link)
              + comm.collective_s(comm.REDUCE_SCATTER, copies * tp, tp, tp_link))
    counts = comm.collective_s(comm.ALL_TO_ALL, QWEN.num_experts * 8, ep, ep_link)
    fwd, bwd = c._expert_comm_s(tokens, tp, ep, c.etp(tp), 16)
    assert bwd == pytest.approx(2 * a2a + gather)
    assert fwd == pytest.approx(bwd + counts)
    fwd1, bwd1 = _coster(expert_tensor_parallel=1)._expert_comm_s(tokens, tp, ep, 1, 16)
    assert bwd1 == pytest.approx(2 * comm.collective_s(comm.ALL_TO_ALL, copies, ep, c._link(1, ep, 16)))
    assert bwd1 < bwd


def test_expert_tp_one_holds_whole_experts_sharded_over_the_expert_data_parallel_group():
    """ETP 1: each GPU holds E / ep whole experts, replicated over edp = tp dp cp / ep GPUs (the ModelZoo table's
    EDP 32 = 256 / (ETP 1 x EP 8)); ETP = TP: E / ep experts, each cut in tp, over dp cp / ep."""
    cfg = ParallelConfig(tp=2, dp=8, ep=8)
    _, experts = layer_param_split(QWEN, 0)
    folded = _coster(expert_tensor_parallel=1).plan(cfg).stages[0].breakdown
    default = _coster().plan(cfg).stages[0].breakdown
    dense_per_gpu = default["params_per_gpu"] - QWEN.num_layers * experts / 16
    assert folded["params_per_gpu"] == pytest.approx(dense_per_gpu + QWEN.num_layers * experts / 8)
    c = _coster(expert_tensor_parallel=1)
    (stage,) = c.stage_sums(2, 1, 8, 1, 8)
    assert stage.eshard == 2 and _coster().stage_sums(2, 1, 8, 1, 8)[0].eshard == 1


class _Recording(DeviceModel):
    """A DeviceModel that records the GEMM shapes it prices."""

    def gemm_s(self, m, n, k, count=1.0):
        self.calls.append((m, n, k, count))
        return super().gemm_s(m, n, k, count)


def test_expert_gemms_keep_their_work_under_either_expert_grid():
    """Per GPU the experts do the same FLOPs whether they are TP-sharded (M k ep / E tokens per expert, width
    f / t) or whole (M / t k ep / E tokens, width f): the expert grid changes the GEMM shapes, not the work. Each
    expert's GEMM is priced on its tokens rounded up to whole tiles (grouped_gemm_rows)."""
    base = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16")
    flops = {}
    for etp in (1, 2):
        dev = _Recording(**{f: getattr(base, f) for f in base.__dataclass_fields__})
        object.__setattr__(dev, "calls", [])
        layer_compute(QWEN, 0, seq_len=4096, mbs=1, tp=2, cp=1, ep=8, dev=dev, use_measured=False,
                      moe_runtime=MoERuntime(expert_tensor_parallel=etp))
        experts = [c for c in dev.calls if c[3] == QWEN.num_experts / 8]
        assert len(experts) == 2
        m_e = 4096 / 2 * etp * QWEN.top_k * 8 / QWEN.num_experts
        rows = grouped_gemm_rows(m_e * busiest_rank_load_factor(tokens=4096 / 2 * etp * 8, top_k=QWEN.top_k,
                                                                num_experts=QWEN.num_experts, ep=8))
        assert all(m == pytest.approx(rows) for m, _, _, _ in experts)
        flops[etp] = sum(2 * m_e * n * k * count for _, n, k, count in experts)
        assert experts[0][1] == (QWEN.ffn_matrices - 1) * QWEN.expert_ffn_hidden_size / etp
    assert flops[1] == pytest.approx(flops[2])


def test_gathered_expert_inputs_are_kept_whole_under_expert_tp():
    """The experts' first GEMM saves the tokens the all-gather over the experts' TP group returned: (M / t) etp k
    copies of h per GPU, (etp - 1) shares beyond the 1/t share; none under ETP 1 or full recompute."""
    tokens, k, h = 4096, QWEN.top_k, QWEN.hidden_size
    assert expert_gathered_input_bytes(QWEN, tokens=tokens, tp=4, expert_tp=1, input_bytes=2) == 0.0
    assert expert_gathered_input_bytes(QWEN, tokens=tokens, tp=4, expert_tp=4, input_bytes=2) == \
        pytest.approx(tokens / 4 * 3 * k * 2 * h)
    kw = dict(seq_len=4096, mbs=1, tp=4, flash=True)
    sel_tp = layer_activation_bytes(QWEN, 0, recompute="selective", **kw)
    sel_one = layer_activation_bytes(QWEN, 0, recompute="selective", moe_runtime=ETP1, **kw)
    assert sel_tp - sel_one == pytest.approx(tokens / 4 * 3 * k * 2 * h)
    assert layer_activation_bytes(QWEN, 0, recompute="full", **kw) == \
        layer_activation_bytes(QWEN, 0, recompute="full", moe_runtime=ETP1, **kw)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_a_bad_expert_tp_is_named(bad):
    with pytest.raises(SpecError, match="expert_tensor_parallel"):
        _coster(expert_tensor_parallel=bad)


def test_an_expert_grid_that_does_not_tile_the_stage_is_refused():
    with pytest.raises(SpecError, match="expert grid"):
        _coster(expert_tensor_parallel=4).plan(ParallelConfig(tp=2, dp=2, ep=2))


# ------------------------------------------------------------------------------------------------ DeepEP
def test_deepep_rows_per_token_match_a_brute_force_count():
    """DeepEP sends a token once to each rank holding one of its experts (is_token_in_rank): the expected number of
    ranks reached, over every choice of k distinct experts out of E equally likely, counted one by one."""
    from itertools import combinations

    e, k, ep = 8, 3, 4
    per_rank = e // ep
    subsets = list(combinations(range(e), k))
    brute = sum(len({x // per_rank for x in s}) for s in subsets) / len(subsets)
    assert expected_ranks_reached(e, k, ep) == pytest.approx(brute)
    assert copies_per_token("alltoall", num_experts=e, top_k=k, ep=ep) == k


@settings(max_examples=200, deadline=None)
@given(ep_log=st.integers(0, 5), per_rank=st.integers(1, 16), k=st.integers(1, 16))
def test_deepep_reaches_between_one_and_min_k_ep_ranks(ep_log, per_rank, k):
    ep = 2 ** ep_log
    e = ep * per_rank
    k = min(k, e)
    got = copies_per_token("deepep", num_experts=e, top_k=k, ep=ep)
    assert 1.0 - 1e-9 <= got <= min(k, ep) + 1e-9
    if per_rank == 1:  # one expert per rank: every chosen expert is another rank
        assert got == pytest.approx(k)


def test_deepep_moves_the_reached_ranks_rows_not_top_k():
    """Qwen3 (E 128, k 8) over EP 8: 5.34 rows per token with DeepEP against 8 with the all-to-all dispatcher; the
    all-to-all time scales with the bytes."""
    tokens, tp, ep = 4 * 4096, 1, 8
    a2a, deep = _coster(expert_tensor_parallel=1), _coster(expert_tensor_parallel=1, moe_dispatcher="deepep")
    link = a2a._link(1, ep, 16)
    row = tokens * QWEN.hidden_size * 2
    for c, rows in ((a2a, 8.0), (deep, expected_ranks_reached(128, 8, 8))):
        _, bwd = c._expert_comm_s(tokens, tp, ep, 1, 16)
        assert bwd == pytest.approx(2 * comm.collective_s(comm.ALL_TO_ALL, row * rows, ep, link))
    assert expected_ranks_reached(128, 8, 8) == pytest.approx(5.339, abs=1e-3)


def test_an_unknown_dispatcher_is_named():
    with pytest.raises(SpecError, match="moe_dispatcher"):
        _coster(moe_dispatcher="deep-ep")


# ------------------------------------------------------------------------------------------------ permutation
def test_permutation_passes_as_the_dispatchers_run_them():
    """Unfused (Megatron-core moe_utils.permute: index_select; unpermute: x probs, zeros, scatter_add_; torchtitan
    and the torch runtime alike): 2k, then the weighted combine 2k + 1 + a scatter-add that reads each added row and
    read-modify-writes its token's output row (3k): 7k + 1 rows per token in the activation dtype; fp32 weighted
    rows (c = 2 under bf16): 2k + 3k + 2 + 6k + a cast back (3) = 11k + 5; unweighted (TEGroupedMLP's weighted
    SwiGLU): 5k + 1. TE's fused moe_permute / moe_unpermute: 2k + 2; the all-to-all dispatcher's
    sort_chunks_by_idxs there and back (EP > 1, several local experts): 4k more, on the etp ranks' gathered copies
    under expert TP; DeepEP none."""
    kw = dict(top_k=8, ep=8, local_experts=16)
    assert permutation_traffic_h(dispatcher="alltoall", fused=False, **kw) == 7 * 8 + 1 + 4 * 8
    assert permutation_traffic_h(dispatcher="alltoall", fused=False, combine_ratio=2.0, **kw) == 11 * 8 + 5 + 4 * 8
    assert permutation_traffic_h(dispatcher="alltoall", fused=False, combine_ratio=2.0, weighted=False, **kw) == \
        5 * 8 + 1 + 4 * 8
    assert permutation_traffic_h(dispatcher="alltoall", fused=True, combine_ratio=2.0, **kw) == 2 * 8 + 2 + 4 * 8
    assert permutation_traffic_h(dispatcher="alltoall", fused=True, etp=4, **kw) == 2 * 8 + 2 + 4 * 8 * 4
    assert permutation_traffic_h(dispatcher="deepep", fused=True, etp=4, **kw) == 2 * 8 + 2
    assert permutation_traffic_h(dispatcher="alltoall", fused=False, top_k=2, ep=1, local_experts=8) == 15
    assert permutation_traffic_h(dispatcher="alltoall", fused=False, top_k=2, ep=8, local_experts=1) == 15


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 16), c=st.sampled_from([1.0, 2.0]), etp=st.sampled_from([1, 2, 4]),
       dispatcher=st.sampled_from(["alltoall", "deepep"]))
def test_unfused_permutation_never_moves_fewer_rows_than_fused(k, c, etp, dispatcher):
    """Whatever the combine's dtype and weighting, the unfused kernels move at least the fused ones' 2k + 2 rows
    (each pass of the fused kernels is one of theirs), and fp32 weighted rows never cost less than 16-bit ones."""
    kw = dict(top_k=k, ep=8, local_experts=16, dispatcher=dispatcher, etp=etp)
    fused = permutation_traffic_h(fused=True, **kw)
    for weighted in (True, False):
        assert permutation_traffic_h(fused=False, combine_ratio=c, weighted=weighted, **kw) >= fused
    assert permutation_traffic_h(fused=False, combine_ratio=2.0, **kw) >= permutation_traffic_h(fused=False, **kw)


def test_permutation_traffic_is_priced_at_memory_bandwidth():
    """The element-wise time of an MoE layer differs between fused and unfused permutation by exactly the rows
    moved through HBM: under bf16 with the default fp32 combine (MoERuntime.combine_bytes), (11k + 5) - (2k + 2)
    h-wide rows of p bytes per token on the GPU's M / t tokens; with a 16-bit combine, (7k + 1) - (2k + 2)."""
    dev = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16")
    kw = dict(seq_len=4096, mbs=2, tp=1, cp=1, ep=8, dev=dev, use_measured=False)
    fused = layer_compute(QWEN, 0, moe_runtime=MoERuntime(permute_fusion=True), **kw)
    row = QWEN.hidden_size * 2 * 2 * 4096
    for runtime, rows in ((MoERuntime(), 9 * QWEN.top_k + 3), (MoERuntime(combine_bytes=2), 5 * QWEN.top_k - 1)):
        unfused = layer_compute(QWEN, 0, moe_runtime=runtime, **kw)
        assert unfused.elementwise_s - fused.elementwise_s == pytest.approx(dev.memory_s(rows * row))
        assert unfused.gemm_s == fused.gemm_s


def test_expert_tp_regroups_the_gathered_copies():
    """Under expert TP the all-to-all dispatcher sorts the buffer the experts' TP all-gather returned by local
    expert, etp ranks' copies: a layer at etp 4 moves 4k x 3 more h-wide rows per token than at etp 1 besides."""
    dev = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16")
    kw = dict(seq_len=4096, mbs=2, tp=4, cp=1, ep=2, dev=dev, use_measured=False)
    whole = layer_compute(QWEN, 0, moe_runtime=ETP1, **kw)
    cut = layer_compute(QWEN, 0, moe_runtime=MoERuntime(expert_tensor_parallel=4), **kw)
    regroup = 4 * QWEN.top_k * 3 * QWEN.hidden_size * 2 * 2 * 4096 / 4  # on the rank's M / t tokens
    assert cut.elementwise_s - whole.elementwise_s == pytest.approx(dev.memory_s(regroup))


def test_the_router_softmax_and_top_k_are_charged_per_token():
    """The router's fp32 softmax over E and its top-k: E (p + 8) + 20 k bytes per token, on the SP-sharded tokens;
    a model with twice the experts (same k) pays E (p + 8) more per token."""
    import dataclasses

    dev = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16")
    assert router_traffic_bytes(num_experts=128, top_k=8, dtype_bytes=2) == 128 * 10 + 8 * 20
    kw = dict(seq_len=4096, mbs=1, tp=1, cp=1, ep=1, dev=dev, use_measured=False)
    more = dataclasses.replace(QWEN, num_experts=256)
    a, b = layer_compute(QWEN, 0, **kw), layer_compute(more, 0, **kw)
    assert b.elementwise_s - a.elementwise_s == pytest.approx(dev.memory_s(128 * 10 * 4096))


@settings(max_examples=300, deadline=None)
@given(m_e=st.floats(0.01, 1e6, allow_nan=False))
def test_a_grouped_gemm_computes_whole_tiles_per_expert(m_e):
    """An expert's GEMM rows: never fewer than its tokens or one tile, at most one tile more than its tokens, and
    non-decreasing in its tokens; the waste a fraction tile / (2 M_e) for large experts."""
    tile = GROUPED_GEMM_TILE_ROWS
    rows = grouped_gemm_rows(m_e)
    assert rows >= max(m_e, tile)
    assert rows <= m_e + tile
    assert grouped_gemm_rows(m_e * 1.5) >= rows
    if m_e >= tile:
        assert rows - m_e == pytest.approx(tile / 2)
    assert grouped_gemm_rows(0.0) == 0.0


def test_many_small_experts_lose_more_to_partial_tiles_than_few_large_ones():
    """The same routed FLOPs, once on few experts with many tokens each and once on many with few (a small
    micro-batch over 128 experts at EP 1): the routed GEMMs of the second take longer per FLOP."""
    dev = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16")
    big = layer_compute(QWEN, 0, seq_len=4096, mbs=8, tp=1, cp=1, ep=8, dev=dev, use_measured=False)
    small = layer_compute(QWEN, 0, seq_len=512, mbs=1, tp=1, cp=1, ep=1, dev=dev, use_measured=False)
    # tokens per expert: 4096 x 8 x 8 x 8 / 128 = 16384 against 512 x 8 / 128 = 32, a quarter tile
    assert grouped_gemm_rows(32) / 32 == pytest.approx(4.0)
    assert small.gemm_s / small.forward_flops > big.gemm_s / big.forward_flops


def test_small_experts_pay_more_for_permutation_than_large_ones():
    """The permutation moves k h-wide rows per token whatever the expert width, while the experts' FLOPs grow with
    it: Qwen3-30B-A3B's 768-wide experts spend a larger share of the layer on it than the same model with 4x wider
    experts (the reason many small experts run below a dense model's MFU)."""
    import dataclasses

    dev = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16")
    kw = dict(seq_len=4096, mbs=2, tp=1, cp=1, ep=8, dev=dev, use_measured=False)
    wide = dataclasses.replace(QWEN, expert_ffn_hidden_size=4 * 768)
    share = {}
    for name, m in (("small", QWEN), ("wide", wide)):
        lc = layer_compute(m, 0, **kw)
        fused = layer_compute(m, 0, moe_runtime=MoERuntime(permute_fusion=True), **kw)
        share[name] = (lc.forward_s - fused.forward_s) / lc.forward_s
    assert share["small"] > 1.5 * share["wide"] > 0


# ------------------------------------------------------------------------------------------------ memory
def test_a_combine_weighted_by_the_routing_probabilities_keeps_the_expert_outputs():
    """Megatron-core's unpermute (`permuted_tokens * permuted_probs`), its 2024 allgather dispatcher
    (`unpermuted_local_hidden * scores`) and this project's torch runtime (`y * r.weight`) multiply the k expert
    outputs of a token by its probabilities, so autograd keeps those k h-wide rows for the probabilities' gradient;
    Megatron's TEGroupedMLP applies the probabilities in its weighted SwiGLU and keeps nothing more. Top-1 routing
    in the 2024 dispatcher skips the multiply; full recompute keeps only the layer input."""
    kw = dict(seq_len=4096, mbs=1, tp=2, flash=True, moe_runtime=MoERuntime(probs_on_output=False))
    for rc in ("none", "selective"):
        weighted = layer_activation_bytes(QWEN, 0, recompute=rc, **{**kw, "moe_runtime": MoERuntime()})
        assert weighted - layer_activation_bytes(QWEN, 0, recompute=rc, **kw) == \
            pytest.approx(4096 / 2 * QWEN.top_k * 2 * QWEN.hidden_size)
    assert layer_activation_bytes(QWEN, 0, recompute="full", **kw) == \
        layer_activation_bytes(QWEN, 0, recompute="full", **{**kw, "moe_runtime": MoERuntime()})
    import dataclasses

    top1 = dataclasses.replace(QWEN, top_k=1)
    assert layer_activation_bytes(top1, 0, recompute="none", **kw) == \
        layer_activation_bytes(top1, 0, recompute="none", **{**kw, "moe_runtime": MoERuntime()})


def test_an_ep_moe_layer_has_only_the_attentions_sequence_parallel_pair():
    """Megatron-core's all-to-all dispatcher permutes the rank's sequence-parallel shard as it is: an MoE layer under
    EP > 1 all-gathers and reduce-scatters M x h over TP once (the attention), not twice; at EP 1 the allgather
    dispatcher gathers the hidden states like a dense MLP and moves nothing more; shared experts gather their input
    like a dense MLP (Qwen1.5-MoE style: 4 shared experts)."""
    import dataclasses

    c = _coster()
    tokens = 4 * 4096  # mbs 4 per replica
    link = c._link(1, 2, 4)
    pair = (comm.collective_s(comm.ALL_GATHER, tokens * QWEN.hidden_size * 2, 2, link)
            + comm.collective_s(comm.REDUCE_SCATTER, tokens * QWEN.hidden_size * 2, 2, link))
    assert c.layer_terms("moe", 2, 1, 2, 2, 4).tp_fwd_s == pytest.approx(pair)
    assert c.layer_terms("moe", 2, 1, 1, 2, 4).tp_fwd_s == pytest.approx(2 * pair)
    assert c._expert_comm_s(tokens, 2, 1, 2, 8) == (0.0, 0.0)
    shared = dataclasses.replace(QWEN, num_shared_experts=4, shared_expert_ffn_hidden_size=768)
    cs = coster(shared, island("h100-sxm", nodes=2, per_node=8, net_gbps=50.0), b=8, gb=16, seq=4096)
    assert cs.layer_terms("moe", 2, 1, 2, 2, 4).tp_fwd_s == pytest.approx(2 * pair)


def test_the_memory_floor_stays_under_the_stage_under_its_own_expert_grid():
    """slice_floors shards the experts' states over the same expert-data-parallel group as the stage (tp dp cp /
    (etp ep)): with whole experts (ETP 1 under TP 2) the floor is still a lower bound of the stage's need."""
    from tangram_launch.costmodel.slice_floors import memory_floor_bytes
    from tangram_launch.specs.constants import RECOMPUTE_MODES

    for runtime in ({}, {"expert_tensor_parallel": 1}):
        c = _coster(**runtime)
        per_kind, emb_b, head_b = memory_floor_bytes(c, 2, 1, 8, 8, [(1, RECOMPUTE_MODES.index("none"), False)])
        need = sum(n * per_kind[k] for k, n in c.layer_counts()) + emb_b + head_b
        st = c.plan(ParallelConfig(tp=2, dp=8, ep=8, zero_stage=1)).stages[0]
        assert 0.5 * (st.static_bytes + st.activation_bytes) < need <= st.static_bytes + st.activation_bytes


# ------------------------------------------------------------------------------------------------ load
def test_the_busiest_rank_load_matches_a_seeded_simulation():
    """Tokens that each pick k distinct experts, all equally likely: the busiest of the EP ranks' loads, averaged
    over seeded draws, exceeds the mean by what busiest_rank_load_factor says (Blom's expected maximum of normal
    draws, which the discrete, slightly skewed loads exceed by a few per cent of the excess)."""
    import random

    rng = random.Random(0)
    tokens, k, e, ep, trials = 256, 8, 128, 16, 200
    per_rank = e // ep
    total = 0.0
    for _ in range(trials):
        loads = [0] * ep
        for _ in range(tokens):
            for x in rng.sample(range(e), k):
                loads[x // per_rank] += 1
        total += max(loads) / (tokens * k / ep)
    excess = busiest_rank_load_factor(tokens=tokens, top_k=k, num_experts=e, ep=ep) - 1.0
    assert excess == pytest.approx(total / trials - 1.0, rel=0.15)


@settings(max_examples=200, deadline=None)
@given(tokens=st.floats(1.0, 1e7), ep_log=st.integers(0, 6), k=st.integers(1, 8))
def test_the_busiest_rank_waits_longer_with_fewer_tokens_and_more_ranks(tokens, ep_log, k):
    """At least the mean; exactly it without EP; the excess shrinks as tokens grow and grows with the ranks."""
    ep, e = 2 ** ep_log, 128
    f = busiest_rank_load_factor(tokens=tokens, top_k=k, num_experts=e, ep=ep)
    assert f >= 1.0
    if ep == 1:
        assert f == 1.0
    assert busiest_rank_load_factor(tokens=4 * tokens, top_k=k, num_experts=e, ep=ep) <= f
    if ep < 64:
        assert busiest_rank_load_factor(tokens=tokens, top_k=k, num_experts=e, ep=2 * ep) >= f


def test_a_small_micro_batch_over_many_ranks_waits_for_its_busiest_rank():
    """4096 tokens over EP 64 (2 experts per rank of 128): the busiest rank holds about a tenth more copies than the
    mean, and the routed GEMMs are priced on its share; 64 x more tokens bring it within 2 %."""
    f = busiest_rank_load_factor(tokens=4096, top_k=8, num_experts=128, ep=64)
    assert 1.05 < f < 1.15
    assert busiest_rank_load_factor(tokens=64 * 4096, top_k=8, num_experts=128, ep=64) < 1.02
