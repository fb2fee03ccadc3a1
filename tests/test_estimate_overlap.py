"""`tangram-launch estimate --dp-overlap / --tp-overlap`: a job whose stack hides its data-parallel sync or runs its
TP collectives beside GEMMs (PyTorch DDP, Megatron-core's --overlap-grad-reduce, --tp-comm-overlap) is estimated
as it runs; the project's runtimes are checked against what they do."""
from __future__ import annotations

import json

import pytest

from tangram_launch.cli import main
from tangram_launch.specs.cluster import ClusterSpec

pytestmark = pytest.mark.unit


@pytest.fixture
def cluster(tmp_path):
    path = tmp_path / "c.yaml"
    ClusterSpec.from_dict({"name": "a100x16", "network": {"default": {"bandwidth_GBps": 12.5}},
                           "nodes": [{"name": f"n{i}", "gpu": "a100-80gb", "count": 8} for i in range(2)]}).dump(path)
    return path


def _estimate(capsys, cluster, *extra: str) -> tuple[int, dict]:
    rc = main(["estimate", "--cluster", str(cluster), "--model", "llama3-8b", "--global-batch", "64",
               "--seq-len", "2048", "--dtype", "bf16", "--format", "json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_dp_overlap_hides_part_of_the_gradient_sync_and_is_recorded(capsys, cluster):
    rc, none = _estimate(capsys, cluster, "--dp", "16", "--zero", "1")
    assert rc == 0 and none["dp_overlap"] == "none"
    for kind in ("grads", "grads-params"):
        rc, hid = _estimate(capsys, cluster, "--dp", "16", "--zero", "1", "--dp-overlap", kind)
        assert rc == 0 and hid["dp_overlap"] == kind
        # the sync over two nodes' NICs is longer than nothing and shorter than unhidden
        assert 0.0 < hid["stages"][0]["dp_sync_s"] < none["stages"][0]["dp_sync_s"]
        assert hid["iteration_s"] < none["iteration_s"]
        # compute and memory are the same job's
        assert hid["stages"][0]["forward_s"] == pytest.approx(none["stages"][0]["forward_s"])
        assert hid["stages"][0]["peak_memory_gib"] == pytest.approx(none["stages"][0]["peak_memory_gib"])


def test_tp_overlap_shortens_the_backward_then_the_forward(capsys, cluster):
    base = ("--tp", "8", "--dp", "2", "--zero", "1")
    times = {}
    for kind in ("none", "backward", "pipelined"):
        rc, out = _estimate(capsys, cluster, *base, "--tp-overlap", kind)
        assert rc == 0 and out["tp_overlap"] == kind
        times[kind] = (out["stages"][0]["forward_s"], out["stages"][0]["backward_s"])
    assert times["backward"][0] == pytest.approx(times["none"][0])  # the forward's collectives still wait
    assert times["backward"][1] < times["none"][1]
    assert times["pipelined"][0] < times["none"][0] and times["pipelined"][1] <= times["backward"][1]


@pytest.mark.parametrize("runtime, flags, refused", [
    ("torch", ("--dp-overlap", "grads"), "dp_overlap=grads"),
    ("deepspeed", ("--tp-overlap", "backward"), "tp_overlap=backward"),
    ("megatron", ("--tp-overlap", "pipelined"), "tp_overlap=pipelined"),
    ("megatron", ("--tp-overlap", "backward"), None),
])
def test_a_runtime_is_held_to_the_overlap_it_runs(capsys, cluster, runtime, flags, refused):
    rc, out = _estimate(capsys, cluster, "--tp", "2", "--dp", "8", "--zero", "1", "--runtime", runtime, *flags)
    named = [p for p in out["runtime_problems"] if "overlap" in p]
    if refused is None:
        assert named == []
    else:
        assert rc == 3 and len(named) == 1 and named[0].startswith(refused)


def test_an_unknown_overlap_names_the_option_and_the_kinds(capsys, cluster):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", "--cluster", str(cluster), "--model", "llama3-8b", "--dp-overlap", "always"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--dp-overlap" in err and "'always'" in err and "grads-params" in err


def test_each_runtime_declares_overlap_kinds_the_cost_model_prices():
    from tangram_launch.capabilities import BUILTIN
    from tangram_launch.costmodel.overlap import DP_OVERLAP_KINDS, TP_OVERLAP_KINDS

    for caps in BUILTIN.values():
        assert "none" in caps.dp_overlaps and set(caps.dp_overlaps) <= set(DP_OVERLAP_KINDS), caps.name
        assert "none" in caps.tp_overlaps and set(caps.tp_overlaps) <= set(TP_OVERLAP_KINDS), caps.name
        assert caps.overlap_problems(dp_overlap="none", tp_overlap="none") == []


def test_a_runtime_is_priced_as_it_runs_launched_here_by_estimate_and_by_the_planner(capsys, cluster):
    """Megatron-core's linear layers run the backward's TP collective beside a GEMM (its workers start with
    CUDA_DEVICE_MAX_CONNECTIONS=1), so a Megatron job is estimated, and planned, with that overlap unless told
    otherwise; the torch runtime's collectives wait."""
    from dataclasses import replace

    from tangram_launch.capabilities import MEGATRON, TORCH
    from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
    from tangram_launch.costmodel.slice_plan import SliceQuery
    from tangram_launch.islands import build_islands
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    base = ("--tp", "8", "--dp", "2", "--zero", "1")
    _, megatron = _estimate(capsys, cluster, *base, "--runtime", "megatron")
    _, told = _estimate(capsys, cluster, *base, "--runtime", "megatron", "--tp-overlap", "none")
    _, torch_rt = _estimate(capsys, cluster, *base, "--runtime", "torch")
    assert (megatron["tp_overlap"], told["tp_overlap"], torch_rt["tp_overlap"]) == ("backward", "none", "none")
    assert megatron["stages"][0]["backward_s"] < told["stages"][0]["backward_s"]
    assert megatron["stages"][0]["forward_s"] == pytest.approx(told["stages"][0]["forward_s"])

    # the cost model the parallelizers and hand-written plans share reads the query's runtime the same way
    [island] = build_islands(ClusterSpec.load(cluster), dtype="bf16").islands
    model, training = load_model("llama3-8b"), TrainingSpec(global_batch=64, seq_len=2048, dtype="bf16")
    cfg = ParallelConfig(tp=8, pp=1, dp=2, cp=1, ep=1, zero_stage=1, recompute="none", offload=False)
    backward = {}
    for caps in (MEGATRON, replace(MEGATRON, tp_overlaps=("none",)), TORCH):
        q = SliceQuery(model=model, training=training, layers=(0, model.num_layers), island=island,
                       microbatch_sequences=16, capabilities=caps, pipelined=False)
        coster = SliceCoster(q)
        backward[caps] = (coster.tp_overlap, coster.plan(cfg, parallelizer="test").stages[0].backward_s)
    got = list(backward.values())
    assert [k for k, _ in got] == ["backward", "none", "none"]
    assert got[0][1] < got[1][1] and got[1][1] == pytest.approx(got[2][1])
