"""What a runtime stores per parameter (memory.MODEL_STATE_KINDS, SliceCoster's model_states): the paper's mixed
precision (16-bit parameters, fp32 gradients, an fp32 master copy beside Adam's moments), FSDP2 over fp32 parameters
(torchtitan: the sharded fp32 parameters are the optimizer's own) and everything in bf16 (NeMo AutoModel's custom
MoE models, cast to bf16 before torch.optim.Adam builds its moments). Storage changes memory only: the collectives
keep moving the compute and gradient dtypes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_costmodel_runtime_variants import _island
from test_published_runs import bench, data  # noqa: F401  (fixtures: the benchmark module and its data file)

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.memory import MODEL_STATE_KINDS, state_bytes_per_param
from tangram_launch.errors import SpecError
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

# where each source's runtime keeps its states (the data file's header says where each was read)
STATES_OF_FRAMEWORK = {"torchtitan": "fp32-params", "NeMo AutoModel": "param-dtype"}


def _coster(model_states: str, *, dtype: str = "bf16", optimizer: str = "adam") -> SliceCoster:
    m = load_model("llama3-8b")
    tr = TrainingSpec(global_batch=16, seq_len=2048, dtype=dtype, optimizer=optimizer)
    q = SliceQuery(model=m, training=tr, layers=(0, m.num_layers), island=_island("h100-sxm"),
                   microbatch_sequences=8, capabilities=RuntimeCapabilities(name="any"), pipelined=False)
    return SliceCoster(q, model_states=model_states)


@pytest.mark.unit
@pytest.mark.parametrize("kind, per_param", [("mixed", (2, 4, 12)), ("fp32-params", (4, 4, 8)),
                                             ("param-dtype", (2, 2, 4))])
def test_adam_in_bf16_stores_18_16_or_8_bytes_a_parameter(kind, per_param):
    """Megatron's 2 + 4 + 12 (bf16 weights, fp32 main grads, master + moments); FSDP2 over fp32 parameters 4 + 4 + 8
    (no master copy: the sharded fp32 parameter is it); all-bf16 2 + 2 + 4 (moments created like the parameters)."""
    assert kind in MODEL_STATE_KINDS
    got = state_bytes_per_param(kind, dtype_bytes=2, grad_bytes=4, optimizer_bytes=12)
    assert got == pytest.approx(per_param)


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(["bf16", "fp16", "fp32", "fp8"]), optimizer=st.sampled_from(["adam", "sgd"]),
       keeps=st.booleans())
def test_no_layout_stores_more_than_the_mixed_one_and_fp32_training_stores_alike(dtype, optimizer, keeps):
    """The master copy is the only thing fp32 parameters drop and bf16 moments halve: neither layout stores more than
    mixed precision; training in fp32 (no master copy) makes mixed and fp32-params the same layout."""
    tr = TrainingSpec(dtype=dtype, optimizer=optimizer)
    kw = dict(dtype_bytes=tr.param_bytes, grad_bytes=tr.grad_bytes, optimizer_bytes=tr.optimizer_state_bytes,
              keeps_param_dtype_grads=keeps)
    mixed = sum(state_bytes_per_param("mixed", **kw))
    for kind in ("fp32-params", "param-dtype"):
        assert sum(state_bytes_per_param(kind, **kw)) <= mixed + 1e-9
    if tr.param_bytes == 4:
        assert state_bytes_per_param("fp32-params", **kw) == state_bytes_per_param("mixed", **kw)


@pytest.mark.unit
def test_the_coster_stores_by_layout_and_moves_the_training_dtypes():
    """Llama 3 8B, FSDP over 8 GPUs: the model states shrink from 18 to 16 (fp32-params) and 8 (param-dtype) bytes
    per parameter, sharded 8 ways; the gathers and reduce-scatters, and so the iteration time, stay as they were."""
    cfg = ParallelConfig(tp=1, pp=1, dp=8, zero_stage=3, recompute="full")
    plans = {k: _coster(k).plan(cfg, parallelizer="test") for k in MODEL_STATE_KINDS}
    n = load_model("llama3-8b").total_params()
    for kind, per_param in (("mixed", 18), ("fp32-params", 16), ("param-dtype", 8)):
        bd = plans[kind].stages[0].breakdown
        states = bd["parameters_bytes"] + bd["gradients_bytes"] + bd["optimizer_bytes"]
        assert states == pytest.approx(n * per_param / 8, rel=1e-6)
        stage, ref = plans[kind].stages[0], plans["mixed"].stages[0]
        assert (stage.forward_s, stage.backward_s, stage.dp_sync_s) == (ref.forward_s, ref.backward_s, ref.dp_sync_s)


@pytest.mark.unit
def test_an_unknown_layout_is_refused_by_name():
    with pytest.raises(SpecError, match="model_states"):
        _coster("fp64-master")


@pytest.mark.unit
def test_every_torchtitan_and_automodel_row_declares_its_runtimes_states(data):
    rows = [(r, kind) for r in data["runs"] for fw, kind in STATES_OF_FRAMEWORK.items()
            if r.get("framework", "").startswith(fw)]
    assert len(rows) >= 20
    wrong = [r["id"] for r, kind in rows if (r.get("runtime") or {}).get("model_states") != kind]
    assert not wrong, f"rows whose runtime.model_states is not their runtime's: {wrong}"


@pytest.mark.unit
def test_automodels_qwen3_moe_run_fits_its_80_gb_once_its_states_are_bf16(data, bench):
    """NeMo AutoModel, Qwen3-30B-A3B on 8 H100 with EP 8: the experts are not FSDP-sharded (EP 8 covers the 8 GPUs),
    about 3.6 B expert parameters a GPU; at 18 bytes each they alone fill 61 GiB and the run is predicted not to
    fit; in bf16 (8 bytes) it fits, as it ran."""
    row = next(r for r in data["runs"] if r["id"] == "automodel-qwen3-30b-a3b-8")
    model = bench.resolve_model(row["model"], data)
    ran = bench.predict(row, model)
    assert ran["peak_gib"] <= ran["capacity_gib"]
    mixed = {**row, "runtime": {**row["runtime"], "model_states": "mixed"}}
    assert bench.predict(mixed, model)["peak_gib"] > ran["capacity_gib"]
