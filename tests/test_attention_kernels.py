"""Fused attention priced by kernel family, GPU die and shape (costmodel/attention_kernels.py)."""
import math
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.costmodel.attention_kernels import SEQ_POINTS, _CURVES, attention_curve
from tangram_launch.costmodel.compute import layer_compute
from tangram_launch.costmodel.efficiency import FLASH_ATTENTION_EFFICIENCY, DeviceModel
from tangram_launch.errors import SpecError
from tangram_launch.specs.model import load_model
from test_costmodel import gpu

pytestmark = pytest.mark.unit

CURVES = sorted(_CURVES.items())


@pytest.mark.parametrize("key,curve", CURVES, ids=[f"{f}-{k}" for (f, k), _ in CURVES])
def test_each_curve_returns_its_published_figures_at_the_measured_points(key, curve):
    for head_dim, values in curve.tflops_by_head_dim.items():
        for seq, tflops in zip(SEQ_POINTS, values):
            assert curve.fraction(seq, head_dim) * curve.peak_tflops == pytest.approx(tflops)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CURVES), st.floats(256, 262144), st.floats(16, 512), st.floats(1.0, 4.0))
def test_a_curve_stays_within_its_figures_and_never_slows_with_a_longer_sequence(item, seq, head_dim, longer):
    """Interpolation never leaves the published range, and (every published curve rising with the sequence) a
    longer sequence never runs at a lower rate."""
    _, curve = item
    rates = [v for values in curve.tflops_by_head_dim.values() for v in values]
    f = curve.fraction(seq, head_dim) * curve.peak_tflops
    assert min(rates) - 1e-9 <= f <= max(rates) + 1e-9
    assert curve.fraction(seq * longer, head_dim) >= curve.fraction(seq, head_dim) - 1e-12


def test_auto_is_flashattention2_on_ampere_and_cudnn_on_hopper():
    assert attention_curve("a100-80gb") is attention_curve("a100-80gb", "fa2")
    assert attention_curve("h100-sxm") is attention_curve("h100-sxm", "cudnn")
    assert attention_curve("h200") is attention_curve("h100-sxm", "cudnn")
    assert attention_curve("a100-80gb", "cudnn") is None  # no published figures: the single figure applies
    assert attention_curve("b200") is None and attention_curve("b200", "fa2") is None


def test_an_unknown_kernel_is_refused_naming_the_field_and_the_valid_ones():
    with pytest.raises(SpecError) as err:
        attention_curve("h100-sxm", "fa5")
    text = str(err.value)
    assert "attention_kernel" in text and "fa5" in text and "cudnn" in text


def core_s(gpu_name, kernel, seq_len=8192, cp=1):
    dev = DeviceModel.from_gpu(gpu(gpu_name), "bf16", attention_kernel=kernel)
    layer = layer_compute(load_model("llama3-8b"), 0, seq_len=seq_len, mbs=1, tp=1, cp=cp, ep=1, dev=dev)
    return layer.attention_core_s


def test_flashattention2_on_an_h100_runs_the_attention_core_slower_than_cudnn_by_the_papers_ratio():
    fa2, cudnn = core_s("h100-sxm", "fa2"), core_s("h100-sxm", "cudnn")
    # FA2 paper fig. 7 causal hd128 at 8k: 308 TFLOP/s; cuDNN (FA3 paper figs. 5-6): causal fwd 529, bwd 518
    assert fa2 / cudnn == pytest.approx((3.5 / (1 / 529 + 2.5 / 518)) / 308, rel=1e-9)


def test_the_a100_short_sequence_rate_is_the_old_single_figure_and_longer_sequences_run_faster():
    """At 2k the A100's FlashAttention-2 curve is within 1 % of the 0.50 figure it replaces; at 8k it is faster,
    as the FA2 paper measured (155 -> 189 TFLOP/s)."""
    dev = DeviceModel.from_gpu(gpu("a100-80gb"), "bf16")
    assert dev.attention_flops_per_s(2048, 128) == pytest.approx(dev.attention_flops, rel=0.01)
    assert dev.attention_flops / dev.attention_peak_flops == pytest.approx(FLASH_ATTENTION_EFFICIENCY)
    assert dev.attention_flops_per_s(8192, 128) / dev.attention_flops_per_s(2048, 128) == pytest.approx(189 / 155)


def test_under_context_parallelism_the_kernel_runs_at_one_ring_steps_shape():
    """cp 4 at 16k gives each GPU 4k queries: the same work share as one GPU's 4k, at the 4k rate."""
    whole = core_s("h100-sxm", "fa2", seq_len=16384)
    ring = core_s("h100-sxm", "fa2", seq_len=16384, cp=4)
    curve = attention_curve("h100-sxm", "fa2")
    assert ring * 4 / whole == pytest.approx(curve.fraction(16384, 128) / curve.fraction(4096, 128))


def test_a_gpu_without_kernel_figures_keeps_one_rate_at_every_shape():
    dev = DeviceModel.from_gpu(gpu("b200"), "bf16")
    assert dev.attention_curve is None
    assert dev.attention_flops_per_s(1024, 64) == dev.attention_flops_per_s(65536, 128) == dev.attention_flops


def test_no_flash_attention_means_no_curve():
    dev = DeviceModel.from_gpu(gpu("h100-sxm"), "bf16", flash_attention=False)
    assert dev.attention_curve is None


def test_published_rows_take_their_sources_kernel_unless_they_name_their_own():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import bench_costmodel_published as bench

    data = bench.load_data()
    kernels = data["attention_kernels"]
    for name, kernel in kernels.items():
        attention_curve("h100-sxm", kernel)  # every named kernel is one the cost model knows
        assert name in data["sources"], name
    rows = {r["id"]: r for r in data["runs"]}
    tt = bench.with_source_defaults(rows["tt-h100-llama3-8b-fsdp8"], data)
    assert tt["runtime"]["attention_kernel"] == "fa2"
    b200 = bench.with_source_defaults(rows["torchao-b200-llama3-8b-bf16"], data)
    assert b200["runtime"]["attention_kernel"] == "cudnn"  # the row's own, over its source's fa2
    assert math.isfinite(bench.evaluate(rows["tt-h100-llama3-8b-fsdp8"], data)["time_err"])


def _plan(*extra):
    from helpers_cli import REPO
    from tangram_launch.launch.planning import planning_request
    from tangram_launch.planner.plan_search import search
    from test_planning_request import _plan_args

    req = planning_request(_plan_args("--model", "llama3-8b", "--global-batch", "16", "--seq-len", "8192",
                                      "--workers", "1", *extra))
    from tangram_launch.specs.cluster import ClusterSpec

    cluster = ClusterSpec.load(str(REPO / "examples" / "clusters" / "c2-modern-het.yaml"))
    return req, search(cluster, req.model, req.training, runtime=req.runtime, options=req.options).plan


def test_a_user_who_runs_flashattention2_on_hopper_says_so_and_the_plan_records_it_and_costs_it():
    """`plan --attention-kernel fa2` on the C2 cluster (H100 + A100): every candidate's attention on the H100s is
    slower, so the best plan is slower than under auto; the plan's training names the kernel, auto is left out
    (plans made without the option read as before), and launch-time planning takes the option the same way."""
    from tangram_launch.launch import planning as planned, torchrun as launch
    from test_planning_request import _plan_args, _same

    req_auto, auto = _plan()
    req_fa2, fa2 = _plan("--attention-kernel", "fa2")
    assert req_fa2.training.attention_kernel == "fa2" and req_auto.training.attention_kernel == "auto"
    assert fa2.predicted.iteration_time_s > auto.predicted.iteration_time_s
    assert fa2.to_dict()["training"]["attention_kernel"] == "fa2"
    assert "attention_kernel" not in auto.to_dict()["training"]
    _same(planned.planning_request(_plan_args("--model", "tiny", "--attention-kernel", "cudnn")),
          planned.plan_inputs(launch.TangramOptions(model="tiny", attention_kernel="cudnn")))


def test_a_plan_file_with_an_unknown_attention_kernel_is_refused_naming_the_field():
    from tangram_launch.specs.training import TrainingSpec

    assert TrainingSpec.from_dict({"attention_kernel": "fa2"}).attention_kernel == "fa2"
    with pytest.raises(SpecError) as err:
        TrainingSpec.from_dict({"attention_kernel": "flash3"})
    assert "attention_kernel" in str(err.value) and "flash3" in str(err.value) and "fa2" in str(err.value)


def _estimate_json(capsys, *extra) -> dict:
    import json

    from tangram_launch.cli import main

    rc = main(["estimate", "--cluster", os.path.join(os.path.dirname(__file__), "..", "examples", "clusters",
                                                     "c2-modern-het.yaml"),
               "--model", "llama3-8b", "--island", "h100-sxm", "--dp", "8", "--zero", "1", "--mbs", "1",
               "--global-batch", "16", "--seq-len", "2048", "--format", "json", *extra])
    assert rc in (0, 3)
    return json.loads(capsys.readouterr().out)


def test_eager_attention_is_priced_with_its_scores_kept_and_slower(capsys):
    """`--attention-kernel eager` (transformers' eager attention, train_hf.py --attn eager): on an H100 the layers
    keep the s x s attention probabilities for the backward (Llama 3 8B has no attention dropout: softmax's fp32
    output and P V's bf16 copy, 4 + 2 bytes per head and key pair (eager_attention.py), 32 heads, 32 layers, one
    micro-batch in flight on one stage, with the allocator's fragmentation share; less the fused kernel's fp32
    log-sum-exp per head and token) and attention runs unfused."""
    from tangram_launch.costmodel.memory import FRAGMENTATION_FRACTION

    auto, eager = _estimate_json(capsys)["stages"][0], _estimate_json(capsys, "--attention-kernel", "eager")["stages"][0]
    scores, lse = 32 * 32 * 2048 ** 2 * (4 + 2), 32 * 32 * 2048 * 4
    assert eager["activation_bytes"] - auto["activation_bytes"] == pytest.approx(
        (scores - lse) * (1 + FRAGMENTATION_FRACTION), rel=1e-9)
    assert eager["forward_s"] > auto["forward_s"] and eager["backward_s"] > auto["backward_s"]
    from tangram_launch.specs.training import TrainingSpec

    assert TrainingSpec.from_dict({"attention_kernel": "eager"}).to_dict()["attention_kernel"] == "eager"


def test_train_hf_runs_the_attention_its_plan_priced():
    """examples/train_hf.py --attn: under auto, the plan's kernel decides on a GPU (eager only where the plan priced
    it) and CPU runs eager (exact against an unsplit model); eager asked for on a GPU under a plan that priced a
    fused kernel is refused, naming the option and the fix. (The cuda flag stands in for a GPU this machine lacks.)"""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from train_hf import attention_for

    assert attention_for("auto", {}, cuda=True) == "sdpa"
    assert attention_for("auto", {"attention_kernel": "cudnn"}, cuda=True) == "sdpa"
    assert attention_for("auto", {"attention_kernel": "eager"}, cuda=True) == "eager"
    assert attention_for("auto", {}, cuda=False) == "eager"
    assert attention_for("eager", {"attention_kernel": "eager"}, cuda=True) == "eager"
    assert attention_for("sdpa", {"attention_kernel": "eager"}, cuda=True) == "sdpa"  # keeps less than priced
    assert attention_for("eager", {}, cuda=False) == "eager"
    with pytest.raises(SpecError) as err:
        attention_for("eager", {"attention_kernel": "fa2"}, cuda=True)
    assert "--attn" in str(err.value) and "--attention-kernel eager" in str(err.value) and "fa2" in str(err.value)
