"""Two costs of a step that hold for every GPU: FlashAttention's backward recomputes the scores (2.5 x its forward's
FLOPs, not the 2 x of a GEMM), and compute that hides a collective runs slower beside it (the collective's kernels
hold COLLECTIVE_SM_SHARE of the SMs)."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from tangram_launch.costmodel import overlap
from tangram_launch.costmodel.breakdown import ParallelConfig
from tangram_launch.costmodel.compute import BACKWARD_FACTOR, FLASH_BACKWARD_FACTOR, layer_compute
from tangram_launch.costmodel.efficiency import COLLECTIVE_SM_SHARE, DeviceModel
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpu, island


@settings(max_examples=30, deadline=None)
@given(name=hs.sampled_from(["gpt3-13b", "llama3-8b"]), seq=hs.sampled_from([512, 2048, 8192]),
       mbs=hs.sampled_from([1, 2, 4]), tp=hs.sampled_from([1, 2, 8]), flash=hs.booleans())
def test_flash_attention_backward_repeats_the_scores(name, seq, mbs, tp, flash):
    """Fused attention's backward costs 2.5 x its forward; every other term (and unfused attention, which stores
    the scores instead) 2 x. The compute's own terms: without the host's floor, which a small shape here (a
    512-token sequence at TP 8) meets in both passes (test_host_floor.py)."""
    model = load_model(name)
    dev = dataclasses.replace(DeviceModel.from_gpu(gpu("a100-80gb"), "bf16", flash_attention=flash), host_op_s=0.0)
    lc = layer_compute(model, 0, seq_len=seq, mbs=mbs, tp=tp, cp=1, ep=1, dev=dev)
    extra = lc.backward_s - BACKWARD_FACTOR * lc.forward_s
    assert lc.attention_core_s > 0
    if flash:
        assert extra == pytest.approx((FLASH_BACKWARD_FACTOR - BACKWARD_FACTOR) * lc.attention_core_s, rel=1e-12)
    else:
        assert extra == 0.0


def test_flash_attention_backward_weighs_more_at_long_sequences():
    """The attention core grows with s, the GEMMs do not: the backward's share above 2 x grows with the sequence."""
    model = load_model("llama3-8b")
    dev = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16")
    ratios = [(lc.backward_s / lc.forward_s) for lc in (
        layer_compute(model, 0, seq_len=s, mbs=1, tp=1, cp=1, ep=1, dev=dev) for s in (1024, 8192, 32768))]
    assert BACKWARD_FACTOR < ratios[0] < ratios[1] < ratios[2] < FLASH_BACKWARD_FACTOR


@settings(max_examples=60, deadline=None)
@given(transfers=hs.floats(0.0, 10.0), exposed=hs.floats(0.0, 10.0), share=hs.floats(0.0, 0.5))
def test_contention_is_the_sm_share_of_what_hides(transfers, exposed, share):
    c = overlap.contention_s(transfers, exposed, share)
    assert 0.0 <= c <= share * transfers + 1e-12
    assert c == pytest.approx(share * max(0.0, transfers - exposed))


@pytest.mark.parametrize("net_gbps", [2.0, 25.0, 200.0])
def test_zero3_stage_pays_its_exposed_transfers_plus_contention_on_the_hidden_rest(net_gbps):
    """ZeRO-3 against ZeRO-0 on the same stage: the forward and backward differ by the exposed gathers and
    reduce-scatters plus COLLECTIVE_SM_SHARE x the transfers that hid under compute."""
    model = load_model("llama3-8b")
    c = coster(model, island("a100-80gb", nodes=2, net_gbps=net_gbps), b=16, gb=16, seq=4096)
    z0 = c.plan(ParallelConfig(dp=16, zero_stage=0)).stages[0]
    z3 = c.plan(ParallelConfig(dp=16, zero_stage=3)).stages[0]
    bd = z3.breakdown
    hidden = bd["zero_comm_s"] - bd["zero_comm_exposed_s"]
    assert hidden > 0
    assert bd["zero_contention_s"] == pytest.approx(COLLECTIVE_SM_SHARE * hidden, rel=1e-9)
    assert z0.breakdown["zero_contention_s"] == 0.0
    extra = (z3.forward_s + z3.backward_s) - (z0.forward_s + z0.backward_s)
    assert extra == pytest.approx(bd["zero_comm_exposed_s"] + bd["zero_contention_s"], rel=1e-9)
