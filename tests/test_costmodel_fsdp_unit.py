"""FSDP2's cost beyond compute and transfers, as the profiler measures it (profiler/fsdp_unit.py): host work per unit
and pass, and AdamW's step per sharded parameter tensor. The torch runtime shards ZeRO 1-3 stages with FSDP2, one
unit per layer and one for the stage's root module; the cost model charges the measured overhead on those stages
only, beyond the collectives' own fixed cost, and nothing where the profile has no such figure."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import capabilities_for
from tangram_launch.costmodel.compute import edge_param_tensors, layer_param_tensors
from tangram_launch.costmodel.efficiency import FSDP_KEYS, DeviceModel
from tangram_launch.costmodel.slice_plan import ParallelConfig
from tangram_launch.specs.model import load_model
from test_costmodel import coster, gpu, island

BASE = {"device": "cpu", "allreduce_busbw_gbps": 1.0, "allreduce_group_size": 2, "collective_latency_us": 300.0,
        "collective_wait_us": 400.0, "optimizer_tensor_us": 20.0}
# as the profiler writes them: unit figures per dtype the units gather in, the optimizer's per sharded tensor
FSDP = dict(zip(FSDP_KEYS, ({"fp32": 1500.0, "bf16": 1900.0}, {"fp32": 3500.0, "bf16": 4100.0}, 150.0)))
TORCH = capabilities_for("torch")
MODEL = load_model("tiny")


def _stage(measured: dict, zero: int, *, caps=TORCH, b: int = 4, gb: int = 8, dtype: str = "fp32", kind="cpu",
           model=MODEL, seq: int = 64):
    c = coster(model, island(kind, per_node=2, measured=measured), b=b, gb=gb, seq=seq, dtype=dtype, caps=caps)
    return c.plan(ParallelConfig(tp=1, dp=2, zero_stage=zero, recompute="none", pp=1)).stages[0]


def _tensors() -> int:
    return sum(layer_param_tensors(MODEL, i) for i in range(MODEL.num_layers)) + edge_param_tensors(
        MODEL, has_embedding=True, has_head=True)


def test_the_profile_figures_reach_the_device_model():
    dev = DeviceModel.from_gpu(gpu("cpu", measured={**BASE, **FSDP}), "fp32")
    assert (dev.fsdp_unit_forward_s, dev.fsdp_unit_backward_s, dev.optimizer_sharded_tensor_s) == pytest.approx(
        (1.5e-3, 3.5e-3, 150e-6))
    assert set(FSDP_KEYS) <= set(dev.sources)
    half = DeviceModel.from_gpu(gpu("cpu", measured={**BASE, **FSDP}), "bf16")  # a bf16 plan's units gather bf16
    assert (half.fsdp_unit_forward_s, half.fsdp_unit_backward_s) == pytest.approx((1.9e-3, 4.1e-3))
    assert half.optimizer_sharded_tensor_s == pytest.approx(150e-6)
    plain = DeviceModel.from_gpu(gpu("cpu", measured=BASE), "fp32")
    assert plain.fsdp_unit_forward_s == plain.fsdp_unit_backward_s == plain.optimizer_sharded_tensor_s == 0.0


def test_zero3_units_pay_the_overhead_beyond_their_collectives_fixed_cost():
    """Whole-model ZeRO-3 over dp 2 (reshard after forward): every micro-batch's forward pays, per unit (4 layers
    and the root), the measured 1.5 ms less the all-gather's fixed 0.4 ms; its backward 3.5 ms less an all-gather's
    and a reduce-scatter's; the optimizer steps DTensors at the measured 150 us each instead of 20."""
    without, with_ = _stage(BASE, 3), _stage({**BASE, **FSDP}, 3)
    units = MODEL.num_layers + 1
    assert with_.forward_s - without.forward_s == pytest.approx(units * (1.5e-3 - 0.4e-3))
    assert with_.backward_s - without.backward_s == pytest.approx(units * (3.5e-3 - 0.8e-3))
    assert with_.breakdown["fsdp_host_s"] == pytest.approx(units * (1.1e-3 + 2.7e-3))
    assert with_.optimizer_s - without.optimizer_s == pytest.approx(_tensors() * (150e-6 - 20e-6))
    assert with_.dp_sync_s == without.dp_sync_s


@pytest.mark.parametrize("zero", [1, 2])
def test_zero1_and_2_units_pay_it_once_per_step(zero):
    """ZeRO 1-2 units gather and reduce-scatter once per step (reshard_after_forward=False): the overhead goes to
    the step's sync, whatever the micro-batches."""
    units = MODEL.num_layers + 1
    for b in (2, 4):
        without, with_ = _stage(BASE, zero, b=b), _stage({**BASE, **FSDP}, zero, b=b)
        assert with_.forward_s == without.forward_s and with_.backward_s == without.backward_s
        assert with_.dp_sync_s - without.dp_sync_s == pytest.approx(units * (1.1e-3 + 2.7e-3))
        assert with_.optimizer_s - without.optimizer_s == pytest.approx(_tensors() * 130e-6)


def test_stages_the_runtime_does_not_shard_with_fsdp2_pay_nothing():
    for zero in (0, 1, 3):  # ZeRO-0: DDP-style all-reduce; DeepSpeed's ZeRO keeps flat buffers, no DTensors
        caps = TORCH if zero == 0 else capabilities_for("deepspeed")
        if zero > caps.max_zero_stage:
            continue
        a, b = _stage(BASE, zero, caps=caps), _stage({**BASE, **FSDP}, zero, caps=caps)
        assert (a.forward_s, a.backward_s, a.dp_sync_s, a.optimizer_s) == (
            b.forward_s, b.backward_s, b.dp_sync_s, b.optimizer_s)


def test_a_gpu_pays_only_what_exceeds_a_units_compute():
    """A GPU runs ahead of its host: a unit's host work shows only where it outlasts the unit's GPU compute
    (gpt3-1.3b at 2048 tokens: milliseconds of compute per layer, against 0.2 ms or 0.5 s of host work)."""
    model, kw = load_model("gpt3-1.3b"), {"kind": "a100-80gb", "dtype": "bf16", "b": 2, "gb": 4, "seq": 2048}
    measured = {"allreduce_busbw_gbps": 100.0, "allreduce_group_size": 2}
    small = {**measured, **dict(zip(FSDP_KEYS, (200.0, 400.0, 30.0)))}
    huge = {**measured, **dict(zip(FSDP_KEYS, (5e5, 9e5, 30.0)))}
    base = _stage(measured, 3, model=model, **kw)
    units = model.num_layers + 1
    assert base.breakdown["compute_forward_s"] / units > 200e-6
    quiet = _stage(small, 3, model=model, **kw)
    assert (quiet.forward_s, quiet.backward_s) == (base.forward_s, base.backward_s)
    slow = _stage(huge, 3, model=model, **kw)
    assert slow.forward_s > base.forward_s and slow.backward_s > base.backward_s
    # what shows is the host work beyond each unit's compute, never more than the host work itself
    assert slow.breakdown["fsdp_host_s"] < units * (0.5 + 0.9)
    assert slow.breakdown["fsdp_host_s"] > units * (0.5 + 0.9) - base.breakdown["compute_forward_s"] - base.breakdown[
        "compute_backward_s"] - 1e-3


@settings(max_examples=40, deadline=None)
@given(fwd_us=st.floats(0, 5e4), bwd_us=st.floats(0, 5e4), opt_us=st.floats(0, 1e3), zero=st.sampled_from([1, 2, 3]),
       b=st.sampled_from([2, 4, 8]), cpu=st.booleans())
def test_measured_overhead_never_makes_a_stage_cheaper(fwd_us, bwd_us, opt_us, zero, b, cpu):
    kind, dtype = ("cpu", "fp32") if cpu else ("a100-80gb", "bf16")
    measured = dict(BASE) if cpu else {"allreduce_busbw_gbps": 100.0, "allreduce_group_size": 2}
    a = _stage(measured, zero, b=b, kind=kind, dtype=dtype)
    more = {**measured, **dict(zip(FSDP_KEYS, (fwd_us, bwd_us, opt_us)))}
    c = _stage(more, zero, b=b, kind=kind, dtype=dtype)
    assert c.forward_s >= a.forward_s and c.backward_s >= a.backward_s and c.dp_sync_s >= a.dp_sync_s
    assert c.breakdown["fsdp_host_s"] >= 0.0
    # and a larger figure never costs less
    double = {**measured, **dict(zip(FSDP_KEYS, (2 * fwd_us, 2 * bwd_us, opt_us)))}
    d = _stage(double, zero, b=b, kind=kind, dtype=dtype)
    assert d.forward_s + d.backward_s + d.dp_sync_s >= c.forward_s + c.backward_s + c.dp_sync_s


def test_estimate_prints_the_overhead(tmp_path, capsys):
    import yaml

    from tangram_launch.cli import main

    cluster = {"name": "c", "nodes": [{"name": "n", "gpu": "cpu", "count": 2, "measured": {**BASE, **FSDP}}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster))
    assert main(["estimate", "--cluster", str(path), "--model", "tiny", "--dp", "2", "--zero", "3", "--mbs", "4",
                 "--global-batch", "8", "--seq-len", "64", "--dtype", "fp32", "--runtime", "torch"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "FSDP2 unit overhead" in line)
    assert float(row.split()[-1]) == pytest.approx(5 * (1.1 + 2.7), abs=0.01)


def test_fields_default_to_nothing():
    fields = {f.name: f.default for f in dataclasses.fields(DeviceModel)}
    assert fields["fsdp_unit_forward_s"] == fields["fsdp_unit_backward_s"] == 0.0
    assert fields["optimizer_sharded_tensor_s"] == 0.0
