"""ZeRO-3 / FSDP overlap, layer by layer (issue 13): a layer's all-gather / reduce-scatter hides under a layer's
compute only when it is shorter; the first gather of a pass is never hidden."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from tangram_launch.costmodel.breakdown import ParallelConfig, ZeroPart, zero_exposed_s
from tangram_launch.costmodel.compute import RECOMPUTE_MODES
from tangram_launch.costmodel.memory import ModelStateBytes
from tangram_launch.specs.model import load_model
from test_costmodel import coster, island

NONE = ModelStateBytes(0.0, 0.0, 0.0)


def part(layer_fwd_s, layer_bwd_s, n):
    return ZeroPart(0.0, n * layer_fwd_s, n * layer_bwd_s, 0.0, 0.0, 0.0, NONE, NONE, layer_fwd_s, layer_bwd_s, n)


def test_short_collectives_hide_except_the_first_layer():
    fwd, bwd = zero_exposed_s(part(1.0, 2.0, 10), fwd_compute_s=30.0, bwd_compute_s=60.0)
    assert (fwd, bwd) == (1.0, 2.0)


def test_long_collectives_expose_their_excess_on_every_layer():
    fwd, bwd = zero_exposed_s(part(5.0, 8.0, 10), fwd_compute_s=30.0, bwd_compute_s=60.0)
    assert fwd == pytest.approx(5.0 + 9 * (5.0 - 3.0))
    assert bwd == pytest.approx(8.0 + 9 * (8.0 - 6.0))


def test_zero3_time_per_gpu_falls_as_dp_grows_over_a_slow_network_with_a_small_batch():
    """The issue's symptom: ZeRO-3 with one sequence per GPU over 25 GB/s between nodes, 8 -> 64 GPUs."""
    model = load_model("llama3-8b")
    times = {}
    for nodes in (1, 8):
        dp = 8 * nodes
        c = coster(model, island("a100-80gb", nodes=nodes, net_gbps=25.0), b=dp, gb=dp, seq=2048)
        st = c.plan(ParallelConfig(tp=1, pp=1, dp=dp, zero_stage=3)).stages[0]
        times[nodes] = (st.forward_s + st.backward_s, st.breakdown["zero_comm_exposed_s"])
    # NVLink: only the first unit's gather and the last reduce-scatters show (the root unit, embedding and output
    # layer, is 1.05 B of the model's 8 B parameters)
    assert times[1][1] < 0.06 * times[1][0]
    assert times[8][0] > 1.5 * times[1][0]  # across nodes the gathers no longer hide
    assert times[8][1] > 0.3 * times[8][0]


@settings(max_examples=25, deadline=None)
@given(data=hst.data(), dp=hst.sampled_from([1, 2, 4, 8, 16]), pp=hst.sampled_from([1, 2, 3]),
       tp=hst.sampled_from([1, 2]), mbs=hst.sampled_from([1, 2]), name=hst.sampled_from(["llama3-8b", "gpt3-1.3b"]))
def test_fast_rows_are_fast_stage_of_each_combination_in_any_order(data, dp, pp, tp, mbs, name):
    """SliceCoster.fast_rows shares what a (ZeRO stage, offload) pair and what a recompute mode give every
    combination across its loop: its rows are fast_stage's numbers of each combination (summed as the stage table
    keeps them) and the explained plan's, bit for bit, whatever order the combinations come in."""
    model = load_model(name)
    c = coster(model, island("a100-80gb", nodes=4, net_gbps=25.0), b=dp * mbs, gb=dp * mbs * 4, seq=2048,
               layers=(0, 6))
    combos = [(z, r, off) for z in (0, 1, 2, 3) for r in range(len(RECOMPUTE_MODES)) for off in (False, True)]
    savers = tuple(data.draw(hst.permutations(combos))[:data.draw(hst.integers(1, len(combos)))])
    for st in c.stage_sums(tp, pp, dp, 1, 1):
        for (zero, r, off), row in zip(savers, c.fast_rows(st, savers)):
            f, b, static, act, sync, opt = c.fast_stage(st, zero, r, off)
            assert row == (f + b, static, act, sync + opt)
            numbers, _ = c.stage_numbers(st, ParallelConfig(tp=tp, pp=pp, dp=dp, zero_stage=zero,
                                                            recompute=RECOMPUTE_MODES[r], offload=off))
            assert tuple(numbers) == (f, b, static, act, sync, opt)
