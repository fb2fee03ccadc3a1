"""A stage's measured parts run in sequence: the profiler times a stage-like sequence back to back against the sum of
its parts timed alone (profiler/worker.py, profiler/assemble.py), and the planner multiplies the stages it prices
from measured layer times by that ratio (costmodel/measured_layers.py); a profile without it, or without measured
layer times, plans as before."""
from __future__ import annotations

import pytest

from profiler.assemble import sequence_times
from profiler.bench import Measured, Timing
from profiler.layer import LayerShape
from profiler.worker import sequence_parts_s
from tangram_launch.costmodel.measured_layers import (SEQUENCE_KEY, SEQUENCE_PARTS_KEY, measured_layer_key,
                                                      parts_correction, sequence_factor, sequence_ratio)
from tangram_launch.planner import PlannerOptions
from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

LAYERS = {"layer_forward_s": {"tiny|dense|seq=64|mbs=8|tp=1": 1e-3}}


def _timed(seconds: float) -> dict:
    return {"forward_backward": Measured(1.0, "TFLOP/s", Timing((seconds,)))}


def test_the_parts_of_the_sequence_add_up_from_the_layer_profile_and_a_missing_part_gives_none():
    model, shape = load_model("tiny"), LayerShape(8, 64, "fp32")
    label = shape.label()
    layer = {f"embedding|{label}": _timed(1e-3), f"dense|{label}": _timed(5e-3), f"head|{label}": _timed(2e-3)}
    assert sequence_parts_s(layer, model, shape, 1) == pytest.approx(8e-3)
    assert sequence_parts_s(layer, model, shape, 4) == pytest.approx(23e-3)  # tiny: four dense layers
    del layer[f"head|{label}"]
    assert sequence_parts_s(layer, model, shape, 4) is None


def test_the_profile_writes_the_sequence_and_its_parts_per_micro_batch_only_with_both_figures():
    rows = [(16, 0.12, 0.1), (8, 0.09, 0.075), (32, 0.3, 0.0), (4, None, 0.01)]
    assert sequence_times(rows) == ({"8": 0.09, "16": 0.12}, {"8": 0.075, "16": 0.1})
    assert sequence_times(()) == ({}, {})


def _factors(pairs: dict) -> dict:
    return {**LAYERS, SEQUENCE_KEY: {str(m): w for m, (w, _p) in pairs.items()},
            SEQUENCE_PARTS_KEY: {str(m): p for m, (_w, p) in pairs.items()}}


def test_the_factor_follows_the_micro_batch_and_applies_only_with_measured_layer_times():
    measured = _factors({8: (1.1, 1.0), 32: (2.6, 2.0)})
    assert sequence_factor(measured, 8) == pytest.approx(1.1)
    assert sequence_factor(measured, 16) == pytest.approx(1.1 + 0.2 * 8 / 24)  # linear between measured sizes
    assert sequence_factor(measured, 4) == pytest.approx(1.1) and sequence_factor(measured, 64) == pytest.approx(1.3)
    no_layers = {k: v for k, v in measured.items() if k not in LAYERS}
    assert sequence_factor(no_layers, 8) == 1.0  # the analytic model: its own constants
    assert sequence_factor(None, 8) == sequence_factor({}, 8) == sequence_factor(LAYERS, 8) == 1.0
    for bad in (5.0, 0.1, -1.0, "1.2"):
        assert sequence_factor(_factors({8: (bad, 1.0)}), 8) == 1.0
    assert sequence_factor(_factors({8: (0.9, 1.0)}), 8) == 1.0  # never below the parts: the search's floors hold


def test_a_ratio_below_one_corrects_the_parts_and_one_above_scales_the_stage():
    """ratio = factor x correction always; the factor is never below 1 and the correction never above."""
    for ratio in (0.6, 0.9, 1.0, 1.3):
        measured = _factors({8: (ratio, 1.0)})
        assert sequence_ratio(measured, 8) == pytest.approx(ratio)
        assert sequence_factor(measured, 8) == max(1.0, sequence_ratio(measured, 8))
        assert parts_correction(measured, 8) == min(1.0, sequence_ratio(measured, 8))
    # between measured sizes the ratio is interpolated first, then split
    mixed = _factors({8: (0.8, 1.0), 16: (1.2, 1.0)})
    assert sequence_ratio(mixed, 12) == pytest.approx(1.0)
    assert sequence_factor(mixed, 10) == 1.0 and parts_correction(mixed, 10) == pytest.approx(0.9)
    assert sequence_factor(mixed, 14) == pytest.approx(1.1) and parts_correction(mixed, 14) == 1.0
    for bad in (0.4, 2.5):  # outside SEQUENCE_FACTOR_RANGE: a broken measurement, neither applies
        assert parts_correction(_factors({8: (bad, 1.0)}), 8) == sequence_factor(_factors({8: (bad, 1.0)}), 8) == 1.0


def test_an_island_keeps_its_slowest_devices_sequence_times():
    from tangram_launch.islands import build_islands

    fast, slow = _factors({8: (1.0, 1.0)}), _factors({8: (3.6, 3.0)})
    base = dict(type="cpu", tflops={"fp32": 0.1}, memory_gib=16, memory_bandwidth_GBps=10,
                intra_node_bandwidth_GBps=10)
    cluster = ClusterSpec.from_dict({"name": "c", "nodes": [{"name": "n0", "gpus": [
        {**base, "measured": fast}, {**base, "measured": slow}]}]}, source="test")
    (island,) = build_islands(cluster, dtype="fp32").islands
    assert sequence_factor(island.gpu.measured, 8) == pytest.approx(1.2)


def _plan(factor: float | None, *, layers: bool = True):
    model = load_model("tiny")
    measured: dict = {}
    if layers:
        fwd, both = {}, {}
        for kind in ("dense", "embedding", "head"):
            for m in (4, 8):
                fwd[measured_layer_key(model.name, kind, 32, m, 1)] = 1e-3 * m
                both[measured_layer_key(model.name, kind, 32, m, 1)] = 3e-3 * m
        measured.update(layer_forward_s=fwd, layer_forward_backward_s=both)
    if factor is not None:
        measured.update({SEQUENCE_KEY: {"4": factor, "8": factor}, SEQUENCE_PARTS_KEY: {"4": 1.0, "8": 1.0}})
    gpu = dict(type="cpu", tflops={"fp32": 0.1}, memory_gib=16, memory_bandwidth_GBps=10,
               intra_node_bandwidth_GBps=10, **({"measured": measured} if measured else {}))
    cluster = ClusterSpec.from_dict({"name": "cpu", "nodes": [{"name": "n0", "gpus": [gpu, gpu]}]}, source="test")
    manual = parse_manual_plan({"stages": [{"layers": [0, 1], "island": "cpu", "dp": 1},
                                           {"layers": [1, 4], "island": "cpu", "dp": 1}],
                                "microbatch_sequences": 8}, num_layers=model.num_layers,
                               island_names=["cpu"])
    return cost_manual_plan(manual, cluster, model, TrainingSpec(global_batch=64, seq_len=32, dtype="fp32"),
                            runtime="torch", options=PlannerOptions(max_workers=1, progress=False))


def test_stages_priced_from_measured_parts_cost_the_factor_more_and_the_iteration_grows():
    plain, scaled = _plan(None), _plan(1.25)
    assert [s.micro_batch_size for s in scaled.stages] == [8, 8]
    for p, s in zip(plain.predicted.stages, scaled.predicted.stages):
        assert s.forward_s == pytest.approx(1.25 * p.forward_s)
        assert s.backward_s == pytest.approx(1.25 * p.backward_s)
    assert scaled.predicted.iteration_time_s > plain.predicted.iteration_time_s


def test_stages_whose_sequence_ran_faster_than_their_parts_cost_the_ratio_less():
    """The layer profile timed the parts slow against the stage-like sequence (a slow spell of the host during their
    windows): the stages cost their parts times the ratio, as with a ratio above 1, through the parts themselves.
    The boundary's p2p, in the first stage's forward and the second's backward (two stages of one grid on one
    island: one slice, as the search prices it), is no part and keeps its time."""
    from tangram_launch.costmodel import communication as comm
    from tangram_launch.costmodel.efficiency import DeviceModel

    plain, fast = _plan(None), _plan(0.8)
    gpu = ClusterSpec.from_dict({"name": "cpu", "nodes": [{"name": "n0", "gpus": [dict(
        type="cpu", tflops={"fp32": 0.1}, memory_gib=16, memory_bandwidth_GBps=10,
        intra_node_bandwidth_GBps=10)]}]}, source="test").nodes[0].gpus[0]
    p2p = comm.p2p_stage_s(8 * 32 * load_model("tiny").hidden_size * 4, stage_gpus=1, gpus_per_node=2,
                           same_node=True, dev=DeviceModel.from_gpu(gpu, "fp32"), inter_bandwidth_GBps=None)
    assert p2p > 0.0
    (p0, p1), (s0, s1) = plain.predicted.stages, fast.predicted.stages
    assert s0.forward_s - p2p == pytest.approx(0.8 * (p0.forward_s - p2p))
    assert s0.backward_s == pytest.approx(0.8 * p0.backward_s)
    assert s1.forward_s == pytest.approx(0.8 * p1.forward_s)
    assert s1.backward_s - p2p == pytest.approx(0.8 * (p1.backward_s - p2p))
    assert fast.predicted.iteration_time_s < plain.predicted.iteration_time_s


def test_without_measured_layer_times_the_factor_changes_nothing():
    for ratio in (1.25, 0.8):
        plain, with_factor = _plan(None, layers=False), _plan(ratio, layers=False)
        assert [(p.forward_s, p.backward_s) for p in plain.predicted.stages] == [
            (p.forward_s, p.backward_s) for p in with_factor.predicted.stages]
        assert plain.predicted.iteration_time_s == with_factor.predicted.iteration_time_s
