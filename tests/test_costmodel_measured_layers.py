"""Layer times priced from measured shapes: exact where measured, interpolated between measured shapes, scaled from
the nearest one by the analytic ratio beyond them (above them never below the line through the two largest); and a
plan says which stages were priced so."""
from __future__ import annotations

import json
import math
import os

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

import tangram_launch
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.measured_layers import Point, distance, measured_layer_key, measured_points, price
from tangram_launch.plan import Plan
from tangram_launch.planner import make_plan
from tangram_launch.specs.cluster import ClusterSpec, GPUSpec
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

SCHEMA = os.path.join(os.path.dirname(tangram_launch.__file__), "plan.schema.json")
CPU = dict(type="cpu", tflops={"fp32": 0.1}, memory_gib=16, memory_bandwidth_GBps=10, intra_node_bandwidth_GBps=10)


def _analytic(seq_len: int, mbs: int, tp: int) -> float:
    """A stand-in analytic model: a fixed cost plus work linear in tokens and quadratic in sequence, split by TP."""
    return 1e-4 + (mbs * seq_len * 1e-6 + mbs * seq_len ** 2 * 1e-9) / tp


mbs_sets = st.lists(st.integers(1, 64), min_size=1, max_size=5, unique=True).map(sorted)
times = st.floats(1e-5, 1.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None)
@given(mbs_list=mbs_sets, data=st.data())
def test_a_measured_shape_prices_at_its_measurement_and_between_two_at_a_value_between_theirs(mbs_list, data):
    fwd = [data.draw(times) for _ in mbs_list]
    points = [Point(256, m, 1, f, 3 * f) for m, f in zip(mbs_list, fwd)]
    for m, f in zip(mbs_list, fwd):
        got = price(points, seq_len=256, mbs=m, tp=1, analytic_s=_analytic)
        assert (got.forward_s, got.how, got.distance) == (f, "measured", 0.0)
        assert got.backward_s == pytest.approx(2 * f)
    target = data.draw(st.integers(1, 128))
    got = price(points, seq_len=256, mbs=target, tp=1, analytic_s=_analytic)
    below = [(m, f) for m, f in zip(mbs_list, fwd) if m <= target]
    above = [(m, f) for m, f in zip(mbs_list, fwd) if m >= target]
    if below and above:  # inside the measured range: between the neighbours, never the analytic model's value
        (m_lo, f_lo), (m_hi, f_hi) = below[-1], above[0]
        assert min(f_lo, f_hi) * (1 - 1e-9) <= got.forward_s <= max(f_lo, f_hi) * (1 + 1e-9)
        assert got.how in ("measured", "interpolated")
    else:  # outside: the nearest measurement times the analytic ratio; above them, never below the measured line
        m_near, f_near = (below[-1] if below else above[0])
        assert got.how == "scaled"
        want = f_near * _analytic(256, target, 1) / _analytic(256, m_near, 1)
        if below and len(mbs_list) >= 2:
            (m_lo, f_lo), (m_hi, f_hi) = below[-2], below[-1]
            want = max(want, f_hi + (target - m_hi) * (f_hi - f_lo) / (m_hi - m_lo))
        assert got.forward_s == pytest.approx(want)
    assert got.distance == pytest.approx(min(abs(math.log2(target / m)) for m in mbs_list))


@settings(max_examples=100, deadline=None)
@given(mbs_list=mbs_sets, tps=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=3, unique=True),
       seq=st.sampled_from([128, 256, 512, 1024]), target_mbs=st.integers(1, 64), target_tp=st.sampled_from([1, 2, 4, 8]),
       target_seq=st.sampled_from([64, 128, 256, 512, 2048]), scale=st.floats(0.5, 20.0))
def test_measurements_proportional_to_the_analytic_model_price_every_shape_as_it_does(
        mbs_list, tps, seq, target_mbs, target_tp, target_seq, scale):
    """Where measured times are the analytic model's times a constant factor (framework overhead as a factor),
    every shape is priced at that factor times the analytic time: scaling from the nearest point keeps the factor,
    and interpolating in the micro-batch is exact where time is linear in it (as the stand-in analytic model is)."""
    points = [Point(seq, m, t, scale * _analytic(seq, m, t), None) for m in mbs_list for t in tps]
    got = price(points, seq_len=target_seq, mbs=target_mbs, tp=target_tp, analytic_s=_analytic)
    assert got.backward_s is None
    assert got.forward_s == pytest.approx(scale * _analytic(target_seq, target_mbs, target_tp))
    if target_seq != seq or target_tp not in tps:
        assert got.how == "scaled" and got.distance > 0
    assert got.distance == distance(points, seq_len=target_seq, mbs=target_mbs, tp=target_tp) >= 0


def test_points_of_other_models_and_kinds_and_bad_values_are_ignored():
    fwd = {measured_layer_key("tiny", "dense", 64, 1, 1): 0.01, measured_layer_key("tiny", "moe", 64, 1, 1): 0.02,
           measured_layer_key("other", "dense", 64, 2, 1): 0.03, measured_layer_key("tiny", "dense", 64, 2, 1): -1,
           "tiny|dense|seq=x": 0.04}
    both = {measured_layer_key("tiny", "dense", 64, 1, 1): 0.025}
    assert measured_points(fwd, both, "tiny", "dense") == [Point(64, 1, 1, 0.01, 0.025)]
    assert price([], seq_len=64, mbs=1, tp=1, analytic_s=_analytic) is None


def test_a_profile_measured_at_mbs_1_and_4_prices_mbs_2_between_them():
    model = load_model("tiny")
    key1, key4 = (measured_layer_key(model.name, "dense", 128, m, 1) for m in (1, 4))
    dev = DeviceModel.from_gpu(GPUSpec(**CPU, measured={"layer_forward_s": {key1: 0.002, key4: 0.005},
                                                        "layer_forward_backward_s": {key1: 0.007, key4: 0.017}}),
                               "fp32")
    lc = layer_compute(model, 0, seq_len=128, mbs=2, tp=1, cp=1, ep=1, dev=dev)
    assert lc.measured and lc.priced.how == "interpolated" and lc.priced.distance == 1.0
    assert 0.002 < lc.forward_s < 0.005 and lc.forward_s == pytest.approx(0.003)
    assert 0.005 < lc.backward_s < 0.012 and lc.backward_s == pytest.approx(0.007 + 0.010 / 3 - 0.003)
    analytic = layer_compute(model, 0, seq_len=128, mbs=2, tp=1, cp=1, ep=1, dev=dev, use_measured=False)
    assert not analytic.measured and analytic.forward_s != lc.forward_s
    at_tp2 = layer_compute(model, 0, seq_len=128, mbs=4, tp=2, cp=1, ep=1, dev=dev)
    a1, a2 = (layer_compute(model, 0, seq_len=128, mbs=4, tp=t, cp=1, ep=1, dev=dev, use_measured=False).forward_s
              for t in (1, 2))
    assert at_tp2.priced.how == "scaled" and at_tp2.forward_s == pytest.approx(0.005 * a2 / a1)


def _cpu_cluster(measured: dict | None) -> ClusterSpec:
    gpu = {**CPU, "tflops": {"fp32": 0.1, "bf16": 0.1}, **({"measured": measured} if measured else {})}
    return ClusterSpec.from_dict({"name": "cpu-measured", "nodes": [{"name": "n0", "gpus": [gpu, gpu]}]},
                                 source="test")


def test_a_plan_marks_the_stages_priced_from_measurement_and_a_plan_without_has_no_mark():
    model = load_model("tiny")
    training = TrainingSpec(global_batch=8, seq_len=64, dtype="fp32")
    fwd, both = {}, {}
    for kind in ("dense", "embedding", "head"):
        for m in (1, 2, 4, 8):
            fwd[measured_layer_key(model.name, kind, 64, m, 1)] = 1e-3 * m
            both[measured_layer_key(model.name, kind, 64, m, 1)] = 3e-3 * m
    plan = make_plan(_cpu_cluster({"layer_forward_s": fwd, "layer_forward_backward_s": both}), model, training)
    with open(SCHEMA, encoding="utf-8") as f:
        schema = json.load(f)
    raw = json.loads(plan.to_json())
    jsonschema.validate(raw, schema)
    for stage, pred in zip(plan.stages, plan.predicted.stages):
        marks = pred.measured
        assert marks["how"] == "measured" and marks["distance"] == 0.0, marks
        assert "dense" in marks["parts"] and ("embedding" in marks["parts"]) == stage.has_embedding
        assert ("head" in marks["parts"]) == stage.has_head and "analytic_parts" not in marks
    assert Plan.from_dict(raw).to_json() == plan.to_json()  # the mark round-trips
    plain = make_plan(_cpu_cluster(None), model, training)
    assert all(p.measured is None for p in plain.predicted.stages)
    assert "measured" not in json.dumps(json.loads(plain.to_json())["predicted"])


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(st.sampled_from([32, 64, 128, 256, 512, 1024, 2048]), min_size=2, max_size=4, unique=True)
       .map(sorted), data=st.data())
def test_between_two_measured_sequence_lengths_the_price_lies_between_theirs(seqs, data):
    fwd = {s: data.draw(times) for s in seqs}
    points = [Point(s, 2, 1, f, None) for s, f in fwd.items()]
    target = data.draw(st.integers(seqs[0], seqs[-1]))
    got = price(points, seq_len=target, mbs=2, tp=1, analytic_s=_analytic)
    lo = max(s for s in seqs if s <= target)
    hi = min(s for s in seqs if s >= target)
    assert min(fwd[lo], fwd[hi]) * (1 - 1e-9) <= got.forward_s <= max(fwd[lo], fwd[hi]) * (1 + 1e-9)
    assert (got.distance == 0) == (target in seqs) and (got.how == "measured") == (target in seqs)


def test_above_the_measured_sizes_time_grows_at_least_as_the_device_measured_it_grow():
    """A CPU device's layer grew faster than its rows between the two largest measured sizes (its caches); an
    analytic model with a per-call cost expects the opposite. Beyond them the price follows the measured line, not
    the analytic ratio (it picked micro-batches twice the largest measured, which then ran 50 % slower than priced)."""
    points = [Point(64, m, 1, f, None) for m, f in ((8, 1e-3), (16, 2.2e-3), (32, 4.8e-3))]

    def overhead_bound(seq_len: int, mbs: int, tp: int) -> float:
        return 2e-3 + mbs * 1e-5

    got = price(points, seq_len=64, mbs=64, tp=1, analytic_s=overhead_bound)
    assert got.how == "scaled" and got.distance == 1.0
    assert overhead_bound(64, 64, 1) / overhead_bound(64, 32, 1) < 1.2  # what the analytic ratio alone gives
    assert got.forward_s == pytest.approx(4.8e-3 + 32 * 2.6e-3 / 16)
    below = price(points, seq_len=64, mbs=4, tp=1, analytic_s=overhead_bound)  # below them: the analytic ratio
    assert below.forward_s == pytest.approx(1e-3 * overhead_bound(64, 4, 1) / overhead_bound(64, 8, 1))
