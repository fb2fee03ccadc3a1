"""A profiled cluster's measured activation bytes (``layer_activation_bytes``, written by ``profile --model``: what
autograd saved for one micro-batch of a layer kind) correct the memory model's kept bytes of that kind, without and
with selective recompute, by the measured-over-analytic ratio at the shape asked (measured_layers.price: exact,
interpolated, or scaled from the nearest measured shape); full recompute keeps the layer input either way."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.measured_layers import measured_layer_key
from tangram_launch.costmodel.memory import layer_activation_bytes, measured_activation_factor
from tangram_launch.islands import Island
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.specs.cluster import ClusterSpec, GpuRef
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

SEQ = 512


def _profiled_island(measured: dict | None, n: int = 4) -> Island:
    """A one-node A100 island whose profile has ``measured`` figures, read through the ClusterSpec parser."""
    node = {"name": "n0", "gpu": "a100-80gb", "count": n, **({"measured": measured} if measured else {})}
    spec = ClusterSpec.from_dict({"network": {"default": {"bandwidth_GBps": 25}}, "nodes": [node]})
    return Island(name="a100-80gb", nodes=("n0",), gpus=tuple(GpuRef("n0", k) for k in range(n)), gpus_per_node=n,
                  gpu=spec.nodes[0].gpus[0], inter_node_link=None)


def _analytic(model, mbs: int, tp: int = 1, seq: int = SEQ) -> float:
    """What the profiler ran, costed analytically: no recompute, the TP shard holding the whole sequence."""
    return layer_activation_bytes(model, 0, seq_len=seq, mbs=mbs, tp=tp, flash=True, sequence_parallel=False)


def _profile(model, ratio: float, mbs_list=(1, 2), tps=(1,)) -> dict:
    """A profile whose measured bytes are ``ratio`` times the analytic figure at each measured shape."""
    return {"layer_activation_bytes": {measured_layer_key(model.name, "dense", SEQ, m, t): int(ratio * _analytic(
        model, m, t)) for m in mbs_list for t in tps}}


def _acts(measured: dict | None, *, mbs: int = 2, tp: int = 1) -> tuple[float, float, float]:
    m = load_model("tiny")
    tr = TrainingSpec(global_batch=16, seq_len=SEQ, dtype="bf16")
    q = SliceQuery(model=m, training=tr, layers=(0, m.num_layers), island=_profiled_island(measured),
                   microbatch_sequences=mbs, capabilities=RuntimeCapabilities(name="any"), pipelined=False)
    coster = SliceCoster(q, flash_attention=True)
    return coster.layer_terms(m.layer_kind(0), tp, 1, 1, 1, mbs).act_bytes


@pytest.mark.unit
@settings(max_examples=30, deadline=None)
@given(ratio=st.floats(0.5, 3.0), mbs=st.integers(1, 8))
def test_a_profile_that_measured_more_raises_the_kept_bytes_by_its_ratio(ratio, mbs):
    """Measured at micro-batches 1 and 2, asked at 1..8 (exact, or scaled by the analytic ratio beyond 2): the
    no-recompute and selective figures are the analytic ones times the measured ratio, full recompute's stays."""
    model = load_model("tiny")
    plain = _acts(None, mbs=mbs)
    measured = _acts(_profile(model, ratio), mbs=mbs)
    assert measured[0] == pytest.approx(ratio * plain[0], rel=1e-5)
    assert measured[1] == pytest.approx(ratio * plain[1], rel=1e-5)
    assert measured[2] == plain[2]


@pytest.mark.unit
def test_between_two_measured_shapes_the_bytes_are_interpolated():
    """Measured at micro-batch 1 (1.0 x analytic) and 4 (2.0 x): at 2 the measured bytes lie between, linear in the
    micro-batch, and the factor is that over the analytic figure at 2."""
    model = load_model("tiny")
    table = {measured_layer_key(model.name, "dense", SEQ, 1, 1): _analytic(model, 1),
             measured_layer_key(model.name, "dense", SEQ, 4, 1): 2.0 * _analytic(model, 4)}
    got = measured_activation_factor({"layer_activation_bytes": table}, model, 0, seq_len=SEQ, mbs=2, tp=1,
                                     flash=True)
    lo, hi = _analytic(model, 1), 2.0 * _analytic(model, 4)
    assert got == pytest.approx((lo + (hi - lo) / 3) / _analytic(model, 2))


@pytest.mark.unit
def test_another_models_profile_or_none_leaves_the_analytic_figure():
    model = load_model("tiny")
    other = {"layer_activation_bytes": {measured_layer_key("llama3-8b", "dense", SEQ, 1, 1): 10 ** 9}}
    assert measured_activation_factor(other, model, 0, seq_len=SEQ, mbs=1, tp=1, flash=True) is None
    assert measured_activation_factor({}, model, 0, seq_len=SEQ, mbs=1, tp=1, flash=True) is None
    assert _acts(other) == _acts(None)


@pytest.mark.unit
def test_a_plan_on_a_profiled_cluster_holds_the_measured_activations():
    """The stage's activation bytes per micro-batch (all layers of tiny, no recompute, dp 4) follow the profile."""
    model = load_model("tiny")
    tr = TrainingSpec(global_batch=16, seq_len=SEQ, dtype="bf16")
    cfg = ParallelConfig(tp=1, pp=1, dp=4, zero_stage=1, recompute="none")
    acts = {}
    for ratio in (None, 2.0):
        island = _profiled_island(_profile(model, ratio) if ratio else None)
        q = SliceQuery(model=model, training=tr, layers=(0, model.num_layers), island=island,
                       microbatch_sequences=8, capabilities=RuntimeCapabilities(name="any"), pipelined=False)
        stage = SliceCoster(q, flash_attention=True).plan(cfg, parallelizer="test").stages[0]
        acts[ratio] = stage.activation_bytes
    layers = model.num_layers * _acts(None)[0]
    assert acts[2.0] - acts[None] == pytest.approx(layers, rel=0.06)  # + fragmentation
