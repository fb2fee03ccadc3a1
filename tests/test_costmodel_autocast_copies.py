"""The torch runtime's ZeRO-0 stages of a 16-bit plan keep fp32 weights and run autocast: the cost model stores
4 + 4 + 8 bytes per parameter there, and each micro-batch in flight holds the 16-bit copy of every GEMM weight that
autocast made and autograd saved for the backward (tests/test_fsdp_mixed_precision.py shows the copies on real
processes). Runtimes with 16-bit weights (DeepSpeed, Megatron), fp32 plans and FSDP2 stages are priced as before."""
from __future__ import annotations

from dataclasses import replace

import pytest
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
def test_zero0_bf16_stores_16_bytes_and_a_16_bit_copy_of_each_gemm_weight_per_microbatch():
    (torch_n, torch_bd), frag, st = _stage(TORCH)
    (any_n, any_bd), _, _ = _stage(WEIGHTS_16BIT)
    params = st.dense_params + st.expert_params
    states = lambda bd: bd["parameters_bytes"] + bd["gradients_bytes"] + bd["optimizer_bytes"]  # noqa: E731
    assert states(any_bd) == pytest.approx(18 * params, rel=1e-9)  # 2 + 4 + 12
    assert states(torch_bd) == pytest.approx(16 * params, rel=1e-9)  # 4 + 4 + 8
    gemm_weights = params - (st.edge_params - st.head_params)  # the first stage's embedding table is not a GEMM's
    assert gemm_weights < params
    assert torch_n.activation_bytes - any_n.activation_bytes == pytest.approx(2 * gemm_weights * frag, rel=1e-9)
    # time is untouched: storage only
    assert (torch_n.forward_s, torch_n.backward_s) == (any_n.forward_s, any_n.backward_s)


@pytest.mark.unit
def test_full_recompute_keeps_only_the_output_layers_copy():
    """Checkpointed layers save their input alone; the output layer is not checkpointed."""
    last = (MODEL.num_layers - 8, MODEL.num_layers)
    (n_none, _), frag, st = _stage(TORCH, layers=last, pp=1)
    (n_full, _), _, _ = _stage(TORCH, layers=last, pp=1, recompute="full")
    (a_full, _), _, _ = _stage(WEIGHTS_16BIT, layers=last, pp=1, recompute="full")
    assert st.head_params > 0
    assert n_full.activation_bytes - a_full.activation_bytes == pytest.approx(2 * st.head_params * frag, rel=1e-9)
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
def test_estimate_shows_the_copies_for_the_torch_runtime_and_refuses_a_stage_they_overflow(cluster_path, capsys):
    """Llama 3 8B in 4 stages on the C2 cluster's 8 H100s, ZeRO 0: the first stage holds four micro-batches' copies
    of its 16-bit weights under the torch runtime and no longer fits 80 GB; Megatron keeps 16-bit weights."""
    from tangram_launch.cli import main

    args = ["estimate", "--cluster", cluster_path("c2-modern-het"), "--model", "llama3-8b", "--island", "h100-sxm",
            "--pp", "4", "--dp", "2", "--zero", "0", "--global-batch", "16", "--seq-len", "8192", "--runtime"]
    assert main(args + ["torch"]) == 3  # does not fit
    torch_out = capsys.readouterr().out
    assert main(args + ["megatron"]) == 0
    megatron_out = capsys.readouterr().out
    assert "of which 16-bit weight copies" in torch_out and "of which 16-bit weight copies" not in megatron_out
