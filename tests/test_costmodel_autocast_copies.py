"""The torch runtime's ZeRO-0 stages of a 16-bit plan keep fp32 weights and run autocast: the cost model stores
4 + 4 + 8 bytes per parameter there, plus the 16-bit copies of the GEMM weights that autocast made and autograd saved
for the backward: one of every GEMM weight for the whole step where layers are not recomputed whole (the runtime keeps
autocast's cast cache across the step's micro-batches), and under full recompute the output layer's per micro-batch
in flight (tests/test_fsdp_mixed_precision.py shows the copies on real processes). Runtimes with 16-bit weights
(DeepSpeed, Megatron), fp32 plans and FSDP2 stages are priced as before."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_costmodel_runtime_variants import _island

from tangram_launch.capabilities import TORCH, RuntimeCapabilities
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

MODEL = load_model("llama3-8b")
WEIGHTS_16BIT = replace(TORCH, autocast_fp32_weights=False)  # the same runtime with 16-bit weights + master


def _stage(caps: RuntimeCapabilities, *, dtype: str = "bf16", zero: int = 0, recompute: str = "none",
           layers: tuple[int, int] = (0, 8), pp: int = 4) -> tuple:
    """(StageNumbers, breakdown) of the first stage of a 4-stage pipeline over ``layers``."""
    tr = TrainingSpec(global_batch=16, seq_len=2048, dtype=dtype)
    q = SliceQuery(model=MODEL, training=tr, layers=layers, island=_island("h100-sxm"), microbatch_sequences=2,
                   capabilities=caps, pipelined=True)
    coster = SliceCoster(q)
    cfg = ParallelConfig(tp=1, pp=pp, dp=2, zero_stage=zero, recompute=recompute)
    st = coster.stage_sums(1, pp, 2, 1, 1)[0]
    return coster.stage_numbers(st, cfg), coster.fragmentation, st


@pytest.mark.unit
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_zero0_bf16_stores_16_bytes_and_one_16_bit_copy_of_each_gemm_weight_for_the_step(recompute):
    (torch_n, torch_bd), frag, st = _stage(TORCH, recompute=recompute)
    (any_n, any_bd), _, _ = _stage(WEIGHTS_16BIT, recompute=recompute)
    params = st.dense_params + st.expert_params
    states = lambda bd: bd["parameters_bytes"] + bd["gradients_bytes"] + bd["optimizer_bytes"]  # noqa: E731
    assert states(any_bd) == pytest.approx(18 * params, rel=1e-9)  # 2 + 4 + 12
    assert states(torch_bd) == pytest.approx(16 * params, rel=1e-9)  # 4 + 4 + 8
    gemm_weights = params - (st.edge_params - st.head_params)  # the first stage's embedding table is not a GEMM's
    assert gemm_weights < params
    # once, in the static bytes: not per micro-batch in flight
    assert torch_bd["autocast_held_copies_bytes"] == pytest.approx(2 * gemm_weights, rel=1e-9)
    assert torch_n.static_bytes - any_n.static_bytes == pytest.approx(2 * gemm_weights - 2 * params, rel=1e-9)
    assert torch_n.activation_bytes == any_n.activation_bytes and torch_bd["autocast_copies_bytes"] == 0.0
    # time is untouched: storage only
    assert (torch_n.forward_s, torch_n.backward_s) == (any_n.forward_s, any_n.backward_s)


@pytest.mark.unit
def test_full_recompute_keeps_only_the_output_layers_copy():
    """Checkpointed layers save their input alone; the output layer is not checkpointed."""
    last = (MODEL.num_layers - 8, MODEL.num_layers)
    (n_none, _), frag, st = _stage(TORCH, layers=last, pp=1)
    (n_full, bd_full), _, _ = _stage(TORCH, layers=last, pp=1, recompute="full")
    (a_full, _), _, _ = _stage(WEIGHTS_16BIT, layers=last, pp=1, recompute="full")
    assert st.head_params > 0
    assert n_full.activation_bytes - a_full.activation_bytes == pytest.approx(2 * st.head_params * frag, rel=1e-9)
    assert bd_full["autocast_held_copies_bytes"] == 0.0  # the runtime keeps no cast cache under full recompute
    assert n_none.activation_bytes > n_full.activation_bytes


@pytest.mark.unit
@pytest.mark.parametrize("dtype, zero", [("fp32", 0), ("tf32", 0), ("bf16", 1), ("bf16", 3)])
def test_fp32_plans_and_fsdp2_stages_are_priced_as_before(dtype, zero):
    """fp32/tf32 weights are what the runtime keeps anyway; FSDP2 stages gather 16-bit parameters
    (MixedPrecisionPolicy), whose fp32 shards and gradients take the 16-bit storage's bytes."""
    (t, _), _, _ = _stage(TORCH, dtype=dtype, zero=zero)
    (a, _), _, _ = _stage(WEIGHTS_16BIT, dtype=dtype, zero=zero)
    assert t == a


@pytest.mark.unit
def test_estimate_shows_the_copies_for_the_torch_runtime(cluster_path, capsys):
    """Llama 3 8B in 4 stages on the C2 cluster's 8 H100s, ZeRO 0: under the torch runtime each stage keeps one
    copy of its 16-bit GEMM weights for the step, however many micro-batches are in flight (stage 0: four), and
    under full recompute the last stage its output layer's per micro-batch; Megatron keeps 16-bit weights."""
    from tangram_launch.cli import main

    args = ["estimate", "--cluster", cluster_path("c2-modern-het"), "--model", "llama3-8b", "--island", "h100-sxm",
            "--pp", "4", "--dp", "2", "--zero", "0", "--global-batch", "16", "--seq-len", "8192", "--runtime"]
    assert main(args + ["torch"]) == 0
    torch_out = capsys.readouterr().out
    assert main(args + ["megatron"]) == 0
    megatron_out = capsys.readouterr().out
    assert main(args + ["torch", "--recompute", "full"]) == 0
    full_out = capsys.readouterr().out
    row = lambda out, label: next(line for line in out.splitlines() if line.strip().startswith(label))  # noqa: E731
    held = [float(x) for x in row(torch_out, "16-bit weight copies (kept all step)").split()[-4:]]
    # stages 1-3 hold 16-bit copies where Megatron holds 16-bit parameters: the same GiB
    assert held[1:] == [float(x) for x in row(megatron_out, "parameters").split()[-3:]]
    assert "16-bit weight copies" not in megatron_out and "of which 16-bit weight copies" not in torch_out
    per_microbatch = [float(x) for x in row(full_out, "of which 16-bit weight copies").split()[-4:]]
    assert per_microbatch[:3] == [0.0, 0.0, 0.0] and per_microbatch[3] > 0.0  # the output layer's, last stage
    assert "(kept all step)" not in full_out


@pytest.mark.unit
@settings(max_examples=40, deadline=None)
@given(span=st.sampled_from([(0, 8), (0, 32), (8, 24), (24, 32)]), pp=st.sampled_from([1, 2, 4]),
       recompute=st.sampled_from(["none", "selective", "full"]), dtype=st.sampled_from(["bf16", "fp16"]),
       dp=st.sampled_from([1, 2]))
def test_the_memory_floor_stays_under_a_zero0_autocast_stage(span, pp, recompute, dtype, dp):
    """slice_floors.stage_need_parts is a floor the planner prunes by: it reads the states a ZeRO-0 autocast stage
    really stores (4 + 4 + 8 bytes per parameter, SliceCoster.kept_state_bytes), not 16-bit storage's 18, which
    would lie above a stage that recomputes whole layers (it keeps no copy of their weights)."""
    from tangram_launch.costmodel.slice_floors import stage_need_parts
    from tangram_launch.specs.constants import RECOMPUTE_MODES

    tr = TrainingSpec(global_batch=16, seq_len=2048, dtype=dtype)
    q = SliceQuery(model=MODEL, training=tr, layers=span, island=_island("h100-sxm"), microbatch_sequences=2,
                   capabilities=TORCH, pipelined=span != (0, MODEL.num_layers))
    coster = SliceCoster(q)
    saver = (0, RECOMPUTE_MODES.index(recompute), False)
    (state, act, working, per_param), = stage_need_parts(coster, 1, 1, 1, dp, [saver], "dense")[0]
    plan = coster.plan(ParallelConfig(tp=1, pp=pp, dp=dp, zero_stage=0, recompute=recompute))
    m = q.num_microbatches
    for j, stage in enumerate(plan.stages):
        n, k = stage.layers[1] - stage.layers[0], min(pp - j, m)
        edges = ((MODEL.embedding_params() if stage.breakdown["has_embedding"] else 0)
                 + (MODEL.head_params() if stage.breakdown["has_head"] else 0))
        floor = n * (state + k * act) + edges * per_param + working
        need = stage.static_bytes - stage.breakdown["overhead_bytes"] + k * stage.activation_bytes
        assert floor <= need * (1 + 1e-12), (j, n, k, floor - need)
