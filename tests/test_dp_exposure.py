"""ZeRO/FSDP and DP communication left exposed after overlap (costmodel/overlap.py), hierarchical collectives
(costmodel/communication.py) and FSDP2's memory under pipelining (costmodel/breakdown.py)."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from tangram_launch.costmodel import communication as comm
from tangram_launch.costmodel import overlap
from tangram_launch.costmodel.breakdown import ParallelConfig
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import GBPS, NET_EFFICIENCY
from tangram_launch.errors import SpecError
from tangram_launch.specs.cluster import LinkSpec
from tangram_launch.specs.constants import RECOMPUTE_MODES
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpt, island


def simulate(*, root_gather, root_rs, head_gather, head_rs, g_fwd, g_bwd, r, c, b, n, emb_fwd, emb_bwd, head_fwd,
             head_bwd):
    """Exposed seconds of one forward and one backward of FSDP units on one link, event by event: the embedding,
    n layers, the output layer (kept gathered from its forward into its backward, the first); a unit's gather is
    issued when the unit before it starts computing, its reduce-scatter when its backward ends; the link serves in
    issue order."""
    # forward: the embedding, the layers, the output layer, each gathered as a unit
    gathers = [root_gather] + [g_fwd] * n + [head_gather]
    computes = [emb_fwd] + [c] * n + [head_fwd]
    done, clock = gathers[0], 0.0
    for u, cu in enumerate(computes):
        start = max(done, clock)
        if u + 1 < len(gathers):
            done = start + gathers[u + 1]
        clock = start + cu
    fwd = clock - sum(computes)
    # backward: the head's, layers n..1, the embedding's; a FIFO link of (issue time, duration)
    link_free = 0.0

    def send(issue, duration):
        nonlocal link_free
        link_free = max(link_free, issue) + duration
        return link_free

    clock = head_bwd
    ready = send(0.0, g_bwd) if g_bwd > 0 else 0.0
    send(head_bwd, head_rs)
    for k in range(n, 0, -1):
        start = max(clock, ready)
        if k > 1 and g_bwd > 0:
            ready = send(start, g_bwd)
        clock = start + b
        send(clock, r)
    clock += emb_bwd
    finish = max(clock, send(clock, root_rs) if root_rs > 0 else link_free)
    return fwd, finish - (head_bwd + n * b + emb_bwd)


def stage_and_part(cost, cfg):
    st = cost.stage_sums(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep)[0]
    return st, cost._zero_part(st, cfg.zero_stage, cfg.offload)


@settings(max_examples=60, deadline=None)
@given(h=hs.sampled_from([512, 1024, 2048]), layers=hs.integers(2, 10), nodes=hs.sampled_from([1, 2, 4, 8]),
       per_node=hs.sampled_from([4, 8]), net_gbps=hs.floats(0.5, 100.0), seqs_per_gpu=hs.sampled_from([1, 2, 8]),
       zero=hs.integers(0, 3), middle=hs.booleans(), dtype=hs.sampled_from(["bf16", "fp32"]))
def test_exposed_communication_is_never_below_what_cannot_overlap(h, layers, nodes, per_node, net_gbps,
                                                                  seqs_per_gpu, zero, middle, dtype):
    """Over generated models, clusters and batches: the exposed ZeRO communication per micro-batch is what an event
    simulation of the same units gives, and never less than the first gather, the last reduce-scatter and each
    layer's gather beyond the previous layer's compute; the DP sync of ZeRO 0/1 (and of FSDP2 under pipelining)
    is never less than its collectives."""
    model = gpt("g", h, h // 64, layers, seq=1024)
    dp = nodes * per_node
    span = (1, layers - 1) if middle and layers > 2 else None
    cost = coster(model, island("a100-80gb", nodes=nodes, per_node=per_node, net_gbps=net_gbps),
                  b=dp * seqs_per_gpu, gb=dp * seqs_per_gpu, seq=1024, dtype=dtype, layers=span)
    cfg = ParallelConfig(dp=dp, zero_stage=zero)
    plan = cost.plan(cfg)
    bd = plan.stages[0].breakdown
    st, zp = stage_and_part(cost, cfg)
    n = st.layers[1] - st.layers[0]
    e = st.edge_compute
    r = zp.layer_rs_s
    c = (st.fwd_s - e.emb_fwd_s - e.head_fwd_s) / n
    b = (st.bwd_s - e.emb_bwd_s - e.head_bwd_s) / n
    fwd, bwd = simulate(root_gather=zp.root_gather_s, root_rs=zp.root_rs_s, head_gather=zp.head_gather_s,
                        head_rs=zp.head_rs_s, g_fwd=zp.layer_fwd_s,
                        g_bwd=zp.layer_bwd_s - r, r=r, c=c, b=b, n=n, emb_fwd=e.emb_fwd_s, emb_bwd=e.emb_bwd_s,
                        head_fwd=e.head_fwd_s, head_bwd=e.head_bwd_s)
    exposed = bd["zero_comm_exposed_s"]
    assert exposed == pytest.approx(fwd + bwd, rel=1e-9, abs=1e-12)
    # the parts that cannot overlap, from the collectives themselves
    gb, pb = cost.training.grad_bytes, cost.training.param_bytes
    layer_bytes = (st.dense_params - st.edge_params) / n
    gather = comm.collective_s(comm.ALL_GATHER, layer_bytes * pb, dp, st.dp_link)
    rs = comm.collective_s(comm.REDUCE_SCATTER, layer_bytes * gb, dp, st.dp_link)
    pipelined = not (st.has_embedding and st.has_head)
    floor = 0.0
    if zero == 3 and not pipelined:
        root = comm.collective_s(comm.ALL_GATHER, (st.edge_params - st.head_params) * pb, dp, st.dp_link)
        floor += (root if root > 0 else gather) + (n - 1) * max(0.0, gather - c)
    if zero == 3:  # the backward's per-layer gathers beyond the layer's compute beside them
        floor += (n - 1) * max(0.0, gather - b)
    if zero >= 2 and not pipelined:  # the last reduce-scatter: the embedding's, else layer 1's beyond its backward
        root_rs = comm.collective_s(comm.REDUCE_SCATTER, (st.edge_params - st.head_params) * gb, dp, st.dp_link)
        floor += root_rs if root_rs > 0 else max(0.0, rs - e.emb_bwd_s)
    assert exposed >= floor * (1 - 1e-9)
    if zero <= 1 or pipelined and zero >= 2:
        grads = st.dense_params * gb
        need = (comm.collective_s(comm.ALL_REDUCE, grads, dp, st.dp_link) if zero == 0 else
                comm.collective_s(comm.REDUCE_SCATTER, grads, dp, st.dp_link)
                + comm.collective_s(comm.ALL_GATHER, st.dense_params * pb, dp, st.dp_link))
        assert plan.stages[0].dp_sync_s >= need * (1 - 1e-9)


@settings(max_examples=60, deadline=None)
@given(h=hs.sampled_from([512, 1024, 2048]), layers=hs.integers(2, 10), nodes=hs.sampled_from([1, 2, 4, 8]),
       per_node=hs.sampled_from([4, 8]), net_gbps=hs.floats(0.5, 100.0), seqs_per_gpu=hs.sampled_from([1, 2, 8]),
       zero=hs.integers(0, 1), middle=hs.booleans(), kind=hs.sampled_from(["grads", "grads-params"]),
       recompute=hs.sampled_from(["none", "full"]))
def test_overlapped_dp_sync_is_what_bucket_by_bucket_overlap_leaves(h, layers, nodes, per_node, net_gbps,
                                                                   seqs_per_gpu, zero, middle, kind, recompute):
    """A runtime that overlaps its ZeRO-0/1 sync (Megatron-core's overlap_grad_reduce / overlap_param_gather,
    PyTorch DDP): the sync left on the step's path is what an event simulation of one bucket per layer gives
    (reduce beside the last backward, recompute included; the distributed optimizer's gathers beside the next
    forward) plus the compute slowed where they hide, and never less than the last bucket's reduce and the first
    gather, which nothing covers. The same stage without overlap pays its collectives whole."""
    model = gpt("g", h, h // 64, layers, seq=1024)
    dp = nodes * per_node
    span = (1, layers - 1) if middle and layers > 2 else None
    isl = island("a100-80gb", nodes=nodes, per_node=per_node, net_gbps=net_gbps)
    cfg = ParallelConfig(dp=dp, zero_stage=zero, recompute=recompute)
    kw = dict(b=dp * seqs_per_gpu, gb=dp * seqs_per_gpu, seq=1024, layers=span)
    cost = coster(model, isl, dp_overlap=kind, **kw)
    plan = cost.plan(cfg)
    st, zp = stage_and_part(cost, cfg)
    n = st.layers[1] - st.layers[0]
    e = st.edge_compute
    c = st.collectives
    red = "ar" if zero == 0 else "rs"
    gathers = zero == 1 and kind == "grads-params"
    bwd_compute = st.bwd_s + cost._rec_part(st, RECOMPUTE_MODES.index(recompute)).recompute_s
    fwd, bwd = simulate(root_gather=c["ag_root"] if gathers else 0.0, root_rs=c[red + "_root"],
                        head_gather=c["ag_head"] if gathers else 0.0, head_rs=c[red + "_head"],
                        g_fwd=c["ag_layer"] if gathers else 0.0, g_bwd=0.0, r=c[red + "_layer"],
                        c=(st.fwd_s - e.emb_fwd_s - e.head_fwd_s) / n, b=(bwd_compute - e.emb_bwd_s - e.head_bwd_s) / n,
                        n=n, emb_fwd=e.emb_fwd_s, emb_bwd=e.emb_bwd_s, head_fwd=e.head_fwd_s, head_bwd=e.head_bwd_s)
    reduce_all = n * c[red + "_layer"] + c[red + "_root"] + c[red + "_head"]
    gather_all = (n * c["ag_layer"] + c["ag_root"] + c["ag_head"]) if gathers else 0.0
    expected = (fwd + bwd + overlap.contention_s(reduce_all, bwd)
                + (overlap.contention_s(gather_all, fwd) if gathers else 0.0))
    assert plan.stages[0].dp_sync_s == pytest.approx(zp.sync_s + expected, rel=1e-9, abs=1e-12)
    floor = c[red + "_root"] if st.has_embedding else 0.0
    if gathers and st.has_embedding:
        floor += c["ag_root"]
    assert plan.stages[0].dp_sync_s >= floor * (1 - 1e-9)
    # without overlap the same stage pays its collectives whole, once
    whole = coster(model, isl, **kw).plan(cfg).stages[0].dp_sync_s
    need = c["ar_grads"] if zero == 0 else c["rs_grads"] + c["ag_params"]
    others = zp.sync_s - (c["ag_params"] if zero == 1 and not gathers else 0.0)  # tied embeddings, loss report
    assert whole == pytest.approx(need + others, rel=1e-9, abs=1e-12)


def test_dp_overlap_names_the_field_and_the_kinds_it_knows():
    model = gpt("g", 512, 8, 2, seq=1024)
    with pytest.raises(SpecError) as err:
        coster(model, island("a100-80gb"), dp_overlap="bucketed")
    assert err.value.field == "dp_overlap" and "grads-params" in str(err.value)


def opt350m_dp128(dtype, dp=128):
    """The issue's case: OPT-350M, global batch 1024 x 2048 tokens, ZeRO-3 over 4-GPU A100-40GB nodes on one
    6 GB/s, 50 us network, one micro-batch per step."""
    model = load_model("opt-350m")
    isl = dataclasses.replace(island("a100-40gb", nodes=dp // 4, per_node=4), inter_node_link=LinkSpec(6.0, 50.0))
    cost = coster(model, isl, b=1024, gb=1024, seq=2048, dtype=dtype)
    cfg = ParallelConfig(dp=dp, zero_stage=3)
    return cost, cfg, cost.plan(cfg).stages[0]


@pytest.mark.parametrize("dtype", ["fp32", "tf32"])
def test_dp128_zero3_exposes_its_transfers_less_what_per_layer_prefetch_hides(dtype):
    """Per micro-batch each GPU gathers the parameters twice and reduce-scatters the gradients once, 4 bytes each:
    3 x 331 M x 4 B = 4.0 GB. A node's four GPUs need the same gathered parameters, so its interface carries them
    once: about 0.74 s at 6 GB/s x 0.9. What hides is at most, per layer, the part of its collectives that the
    compute beside it covers; the rest is exposed. fp32 (CUDA cores) computes a layer longer than its gather takes,
    so only the first gather and the last reduce-scatters show; TF32 computes a layer faster than the network
    moves it, and most of the transfers are exposed."""
    cost, cfg, stage = opt350m_dp128(dtype)
    bd = stage.breakdown
    params = 331_196_416
    nic = 6.0 * GBPS * NET_EFFICIENCY
    transfers = bd["zero_comm_s"]
    assert transfers == pytest.approx(3 * params * 4 * 127 / 128 / nic, rel=0.08)  # + 3 x 26 units' latency
    st, zp = stage_and_part(cost, cfg)
    n = st.layers[1] - st.layers[0]
    e = st.edge_compute
    c = (st.fwd_s - e.emb_fwd_s - e.head_fwd_s) / n
    b = (st.bwd_s - e.emb_bwd_s - e.head_bwd_s) / n
    hideable = n * min(zp.layer_fwd_s, c) + n * min(zp.layer_bwd_s, b)  # per layer, at most the compute beside it
    exposed = bd["zero_comm_exposed_s"]
    assert exposed >= transfers - hideable - 1e-9
    assert exposed <= transfers
    if dtype == "fp32":
        assert c > zp.layer_fwd_s and b > zp.layer_bwd_s
        assert exposed < 0.15 * transfers  # the root unit's gather and reduce-scatter, layer 1's reduce-scatter
    else:
        assert c < zp.layer_fwd_s
        assert exposed > 0.4 * transfers


def test_strong_scaling_lowers_per_gpu_throughput_once_layers_compute_faster_than_they_communicate():
    """At a fixed global batch, 128 -> 512 GPUs: each GPU computes a quarter as much per layer while its layer
    collectives stay as long, so per-GPU throughput falls."""
    per_gpu = {}
    for dp in (128, 512):
        _, _, stage = opt350m_dp128("tf32", dp=dp)
        per_gpu[dp] = (1024 / dp) / (stage.forward_s + stage.backward_s)  # sequences per second per GPU
    assert per_gpu[512] < 0.8 * per_gpu[128]


@settings(max_examples=200, deadline=None)
@given(c=hs.floats(0.0, 1.0), g=hs.floats(0.0, 1.0), tp=hs.sampled_from([1, 2, 4, 8]))
def test_an_overlapped_tp_collective_shows_its_first_chunk_or_what_the_gemm_cannot_cover(c, g, tp):
    """A TP collective pipelined with its GEMM in tp chunks shows at least one chunk and the transfers beyond the
    other chunks' GEMMs, and never more than the whole collective."""
    got = overlap.tp_exposed_s(c, g, tp)
    assert got <= c * (1 + 1e-12)
    assert got >= max(c / tp, c - g * (tp - 1) / tp) - 1e-12
    if tp == 1:
        assert got == c


@pytest.mark.parametrize("kind", ["backward", "pipelined"])
@pytest.mark.parametrize("name, ep, pairs", [("llama3-70b", 1, 2), ("qwen3-30b-a3b", 8, 1), ("mixtral-8x7b", 1, 2)])
def test_tp_overlap_hides_sp_collectives_only_beside_the_gemms_next_to_them(name, ep, pairs, kind):
    """Megatron's linear layers (backward): the forward's collectives and the backward's output-gradient all-gather
    wait, the input-gradient reduce-scatter runs beside the weight-gradient GEMM. --tp-comm-overlap / AsyncTP
    (pipelined): each collective is pipelined with the GEMM beside it (attention: QKV and output projection; a dense
    FFN: up and down). An MoE block with EP > 1 has no FFN pair, and at EP 1 its gathered input feeds the router
    and the dispatch, which no GEMM hides."""
    model = load_model(name)
    tp = 8
    isl = island("h100-sxm", nodes=max(1, ep), per_node=8)
    kw = dict(b=8 * ep, gb=8 * ep, seq=4096, layers=(0, 2))
    lkind = model.layer_kind(0)
    plain = coster(model, isl, **kw).layer_terms(lkind, tp, 1, ep, ep, 1)
    cost = coster(model, isl, tp_overlap=kind, **kw)
    hidden = cost.layer_terms(lkind, tp, 1, ep, ep, 1)
    lc = layer_compute(model, 0, seq_len=4096, mbs=1, tp=tp, cp=1, ep=ep, dev=cost.dev, moe_runtime=cost.moe_runtime)
    link = cost._link(1, tp, tp * ep)
    act = 4096 * model.hidden_size * cost.dev.dtype_bytes
    gather = comm.collective_s(comm.ALL_GATHER, act, tp, link)
    scatter = comm.collective_s(comm.REDUCE_SCATTER, act, tp, link)
    assert plain.tp_fwd_s == plain.tp_bwd_s == pytest.approx(pairs * (gather + scatter))
    beside = lc.sp_gemms_s[:pairs]
    assert len(beside) == (1 if model.num_experts else 2)
    bare = (pairs - len(beside)) * (gather + scatter)
    if kind == "pipelined":
        fwd = bare + sum(overlap.tp_exposed_s(gather, c, tp) + overlap.tp_exposed_s(scatter, r, tp) for c, r in beside)
        bwd = bare + sum(overlap.tp_exposed_s(gather, r, tp) + overlap.tp_exposed_s(scatter, c, tp) for c, r in beside)
        assert hidden.tp_fwd_s < plain.tp_fwd_s
    else:
        fwd = plain.tp_fwd_s
        bwd = bare + sum(gather + overlap.beside_s(scatter, c) for c, r in beside)
    assert hidden.tp_fwd_s == pytest.approx(fwd)
    assert hidden.tp_bwd_s == pytest.approx(bwd)
    assert hidden.tp_bwd_s < plain.tp_bwd_s
    with pytest.raises(SpecError) as err:
        coster(model, isl, tp_overlap="async", **kw)
    assert err.value.field == "tp_overlap" and "pipelined" in str(err.value)


def test_hierarchical_latency_pays_the_network_only_on_steps_that_cross_nodes():
    """A 128-rank ring over 32 four-GPU nodes: 31 of its 127 all-gather steps cross nodes (NCCL's latency model)."""
    link = comm.GroupLink(busbw=5e9, latency_s=50e-6, inter_node=True, nodes=32, intra_latency_s=2e-6)
    assert link.step_latency_s(comm.ALL_GATHER, 128) == pytest.approx(31 * 50e-6 + 96 * 2e-6)
    assert link.step_latency_s(comm.ALL_REDUCE, 128) == pytest.approx(62 * 50e-6 + 192 * 2e-6)
    inside = comm.GroupLink(busbw=100e9, latency_s=2e-6)
    assert inside.step_latency_s(comm.ALL_GATHER, 8) == pytest.approx(7 * 2e-6)


def test_fsdp_under_pipelining_holds_whole_parameters_and_gradients():
    """torch.distributed.pipelining leaves an FSDP2 stage's parameters gathered and its gradients unsharded across
    the micro-batches (one reduce-scatter after the last backward): a pipelined ZeRO-2/3 stage holds what a
    ZeRO-1 stage does, and its gradient sync is per iteration."""
    model = gpt("g", 2048, 16, 8)
    cost = coster(model, island("a100-80gb", nodes=2), b=16, gb=64, layers=(2, 6))
    states = {}
    for zero in (1, 2, 3):
        stage = cost.plan(ParallelConfig(dp=16, zero_stage=zero)).stages[0]
        bd = stage.breakdown
        states[zero] = (bd["parameters_bytes"], bd["gradients_bytes"], bd["optimizer_bytes"], stage.dp_sync_s)
    params = bd["params_per_gpu"]
    tr = cost.training
    assert states[3][:3] == pytest.approx((params * tr.param_bytes, params * tr.grad_bytes,
                                           params * tr.optimizer_state_bytes / 16))
    assert states[2] == pytest.approx(states[1])
    assert states[3][:3] == pytest.approx(states[1][:3]) and states[3][3] >= states[1][3]


@pytest.mark.parametrize("span, pps", [((1, 3), (1, 2)), ((0, 8), (1, 2, 4))])
def test_stage_memory_floor_stays_under_a_pipelined_fsdp_stage(span, pps):
    """slice_floors.stage_need_parts is a floor the planner prunes by: a pipelined ZeRO-2/3 stage of one or two
    layers on dp 2 holds ZeRO-1's states and no gathered working set, which may be less than ZeRO-3's sharded states
    plus its working set; the floor must stay under either."""
    from tangram_launch.costmodel.slice_floors import stage_need_parts
    from tangram_launch.specs.constants import RECOMPUTE_MODES

    model = gpt("g", 2048, 16, 8, vocab=1024)
    cost = coster(model, island("a100-80gb"), b=2, gb=8, layers=span)
    savers = [(z, RECOMPUTE_MODES.index("none"), False) for z in (0, 1, 2, 3)]
    rows, _, _ = stage_need_parts(cost, 1, 1, 1, 2, savers, "dense")
    for pp in pps:
        for (zero, _r, _off), (state, act, working, _per_param) in zip(savers, rows):
            plan = cost.plan(ParallelConfig(dp=2, pp=pp, zero_stage=zero))
            for stage in plan.stages:
                n = stage.layers[1] - stage.layers[0]
                held = stage.static_bytes - stage.breakdown["overhead_bytes"]  # the floor leaves the overhead out
                assert n * (state + act) + working <= held + stage.activation_bytes, (zero, pp, stage.layers)
