"""DTensor tensor parallelism (torchtitan's plan) runs the norms sequence-parallel but hands each column-parallel GEMM
its all-gathered input, which the Linear saves whole for its weight gradient: the attention's and the MLP's inputs and
the output layer's (memory.py, whole_column_inputs). Megatron saves the sharded tensor and gathers it again."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_published_runs import bench, data  # noqa: F401  (fixtures: the benchmark module and its data file)

from tangram_launch.costmodel.efficiency import GIB
from tangram_launch.costmodel.memory import head_activation_bytes, layer_activation_bytes
from tangram_launch.specs.model import load_model

S, B = 4096, 2


@pytest.mark.unit
@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([2, 4, 8]), recompute=st.sampled_from(["none", "selective"]),
       flash=st.booleans(), mbs=st.integers(1, 4))
def test_each_tp_rank_keeps_the_attention_and_mlp_inputs_whole(tp, recompute, flash, mbs):
    """Per token 2 p h are kept whole instead of sharded: (2 p h)(1 - 1/t) more on every TP rank."""
    m = load_model("llama3-8b")
    kw = dict(seq_len=S, mbs=mbs, tp=tp, recompute=recompute, flash=flash)
    megatron = layer_activation_bytes(m, 0, **kw)
    dtensor = layer_activation_bytes(m, 0, whole_column_inputs=True, **kw)
    assert dtensor - megatron == pytest.approx(mbs * S * 2 * 2 * m.hidden_size * (1 - 1 / tp))


@pytest.mark.unit
def test_without_tp_or_under_full_recompute_nothing_changes():
    """One TP rank holds whole tensors anyway; full recompute keeps only the block's input, sharded by SP (the
    rebuilt layer's whole inputs are the no-recompute figure, which the working set reads)."""
    m = load_model("llama3-8b")
    for tp, recompute in ((1, "none"), (8, "full")):
        kw = dict(seq_len=S, mbs=B, tp=tp, recompute=recompute, flash=True)
        assert layer_activation_bytes(m, 0, whole_column_inputs=True, **kw) == layer_activation_bytes(m, 0, **kw)


@pytest.mark.unit
def test_the_output_layer_keeps_its_gathered_input_whole():
    m = load_model("llama3-8b")
    h, tp = m.hidden_size, 8
    for loss in ("fused", "eager"):
        kw = dict(seq_len=S, mbs=B, tp=tp, cross_entropy=loss)
        diff = head_activation_bytes(m, whole_column_inputs=True, **kw) - head_activation_bytes(m, **kw)
        assert diff == pytest.approx(B * S * 2 * h * (1 - 1 / tp))


@pytest.mark.unit
def test_every_torchtitan_row_with_tp_declares_dtensors_whole_inputs(data):
    rows = [r for r in data["runs"] if r.get("framework", "").startswith("torchtitan")
            and r["parallel"].get("tp", 1) > 1]
    assert rows
    assert all((r.get("runtime") or {}).get("whole_column_inputs") is True for r in rows)


@pytest.mark.unit
def test_torchtitans_2d_llama3_70b_run_holds_the_rebuilt_layers_and_heads_whole_inputs(data, bench):
    """TP 8, 16 sequences of 8,192 tokens a GPU, full recompute: the rebuilt layer's two h-wide inputs and the output
    layer's input, each 131,072 x 8,192 bf16 = 2 GiB whole instead of 0.25 GiB: 3 x 1.75 GiB more (+ fragmentation)."""
    row = next(r for r in data["runs"] if r["id"] == "tt-h100-llama3-70b-2d-fp8")
    megatron = copy.deepcopy(row)
    del megatron["runtime"]["whole_column_inputs"]
    model = bench.resolve_model(row["model"], data)
    more_gib = bench.predict(row, model)["peak_gib"] - bench.predict(megatron, model)["peak_gib"]
    tokens = row["parallel"]["mbs"] * row["parallel"]["seq_len"]
    assert more_gib == pytest.approx(3 * tokens * model.hidden_size * 2 * (1 - 1 / 8) / GIB, rel=0.06)
