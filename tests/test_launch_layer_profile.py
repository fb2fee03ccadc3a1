"""``--profile --model M`` at launch times M's layers at the shapes the planner prices, and the profile cache is
reused only where its layer timings cover them.

In-process: which micro-batch sizes the planner can price (against plans it makes), when a cached profile covers a
launch, the cache's re-profile and reuse with a stand-in profiler, and the launch's lines on how stages were priced.
The real launch (torch's machinery, gloo, 2 processes) is in test_launch_layer_profile_slow.py.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace as Namespace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from tangram_launch.launch import planning as planned, profile_cache
from tangram_launch.launch.profile_cache import LayerShapes, covers, planner_micro_batches, recorded_layer_shapes

REPO = Path(__file__).resolve().parent.parent
PROFILED_CPU_2 = REPO / "examples" / "clusters" / "profiled-cpu-2.yaml"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- which shapes --------------------------------------------------------------------------------------------------

@given(global_batch=st.integers(1, 96), devices=st.integers(1, 8), data=st.data())
@settings(max_examples=100, deadline=None)
def test_planner_micro_batches_are_every_b_over_dp_the_parallelizers_form(global_batch, devices, data):
    asked = data.draw(st.none() | st.lists(st.sampled_from(_divisors(global_batch)), min_size=1, unique=True))
    got = planner_micro_batches(global_batch, tuple(asked) if asked else None, devices)
    bs = asked or _divisors(global_batch)
    brute = {b // dp for b in bs for dp in range(1, devices + 1) if b % dp == 0}  # mbs = b / dp must be whole
    assert set(got) == brute and list(got) == sorted(got)
    assert set(bs) <= set(got)  # dp 1: every b itself
    assert all(global_batch % m == 0 for m in got)


@pytest.mark.slow
@pytest.mark.parametrize("global_batch", [6, 8])
def test_every_stage_the_planner_makes_is_at_a_micro_batch_size_the_launch_times(global_batch):
    """The invariant the shapes are chosen by, against the planner itself (the README's 2 CPU processes)."""
    from tangram_launch.specs.cluster import ClusterSpec

    cluster = ClusterSpec.load(PROFILED_CPU_2)
    inputs = planned.planning_request(Namespace(model="tiny", global_batch=global_batch, seq_len=64,
                                                dtype="fp32", workers=1), progress=False)
    shapes = planned.launch_layer_shapes(inputs, 2, source="tiny", dtype=None)
    assert shapes.seq_lens == (64,) and shapes.tps == (1, 2)  # tiny's 4 heads split over the node's 2 devices
    for b in (None, *_divisors(global_batch)):  # the search's choice, and each size forced
        request = planned.planning_request(Namespace(model="tiny", global_batch=global_batch, seq_len=64,
                                                     dtype="fp32", workers=1,
                                                     microbatch_sequences=[b] if b else None), progress=False)
        plan = planned.make_launch_plan(cluster, request)
        assert {s.micro_batch_size for s in plan.stages} <= set(shapes.micro_batches), (b, plan.stages)
        assert {s.shape.tp for s in plan.stages} <= set(shapes.tps)


def test_a_runtime_without_tensor_parallelism_times_tp_1_only():
    inputs = planned.planning_request(Namespace(model="tiny", global_batch=8, seq_len=64, dtype="fp32",
                                                runtime="deepspeed"), progress=False)
    assert planned.launch_layer_shapes(inputs, 2, source="tiny", dtype="fp32").tps == (1,)


def test_the_layer_budget_is_a_share_per_timing_capped_at_the_quick_budget():
    cpu = [{"name": "vm", "devices": [["cpu", "cpu", ""]] * 2}]
    readme = LayerShapes("tiny", (64,), (1, 2, 4, 8), (1, 2))
    assert readme.jobs(1) == 16  # 4 sizes x (dense at tp 1 and 2, embedding, head)
    fields = planned._layer_fields(readme, cpu)
    assert fields["layer_budget_s"] == pytest.approx(16 * planned.LAUNCH_LAYER_JOB_S["cpu"])
    assert fields["layer_budget_s"] < 15 and fields["layer_timing"] == "back-to-back"
    many = LayerShapes("tiny", (64,), tuple(range(1, 65)), (1, 2))
    assert planned._layer_fields(many, cpu)["layer_budget_s"] == planned.LAUNCH_LAYER_BUDGET_CAP_S
    gpus = [{"name": "n0", "devices": [["cuda", "NVIDIA H100 80GB HBM3", "GPU-0"]] * 8}]
    assert planned._layer_fields(readme, gpus)["layer_budget_s"] == planned.LAUNCH_LAYER_BUDGET_CAP_S  # 16 x 1 s
    assert planned._layer_fields(LayerShapes("tiny", (64,), (1, 2), (1,)), gpus)["layer_budget_s"] == 6.0


# --- whether a cached profile covers them ----------------------------------------------------------------------------

sizes = st.lists(st.integers(1, 64), min_size=1, max_size=5, unique=True).map(lambda v: tuple(sorted(v)))
shapes = st.builds(LayerShapes, model=st.sampled_from(["tiny", "gpt2"]), seq_lens=sizes, micro_batches=sizes,
                   tps=sizes, dtype=st.sampled_from([None, "bf16", "fp32"]))


@given(recorded=shapes, needed=shapes)
@settings(max_examples=150, deadline=None)
def test_covers_means_every_needed_shape_was_asked_for_in_that_model_and_dtype(recorded, needed):
    asked = {(s, m, t) for s in recorded.seq_lens for m in recorded.micro_batches for t in recorded.tps}
    wanted = {(s, m, t) for s in needed.seq_lens for m in needed.micro_batches for t in needed.tps}
    same = recorded.model == needed.model and needed.dtype in (None, recorded.dtype)
    assert covers(recorded, needed) == (same and wanted <= asked)
    assert covers(recorded, recorded) and not covers(None, needed)


@given(recorded=shapes)
@settings(max_examples=100, deadline=None)
def test_the_profiles_model_block_reads_back_as_the_shapes_asked(recorded):
    info = {"name": recorded.model, "micro_batch": recorded.micro_batches[0], "seq_len": recorded.seq_lens[0],
            "dtype": recorded.dtype, "micro_batches": list(recorded.micro_batches),
            "seq_lens": list(recorded.seq_lens), "tp": list(recorded.tps), "layer_kinds": ["dense"]}
    assert recorded_layer_shapes({"model": info}) == recorded


def test_an_older_profiles_model_block_reads_as_its_one_shape_and_none_without_one():
    old = yaml.safe_load((REPO / "examples" / "clusters" / "profiled-h200.yaml").read_text())["profile"]
    assert recorded_layer_shapes(old) == LayerShapes("llama3-8b", (4096,), (1,), (1,), "bf16")
    assert recorded_layer_shapes(yaml.safe_load(PROFILED_CPU_2.read_text())["profile"]) is None


# --- the cache, with a stand-in profiler -----------------------------------------------------------------------------

class FakeProfiler:
    """Writes profiled-cpu-2.yaml with the layer timings a request asks for (no worker starts)."""

    def __init__(self) -> None:
        self.requests: list = []
        self.gemm_tflops: dict | None = None  # every device's measured GEMM rates, where a test sets them

    def __call__(self, request):
        self.requests.append(request)
        spec = yaml.safe_load(PROFILED_CPU_2.read_text())
        spec["profile"]["quick"] = request.quick
        for gpu in spec["nodes"][0]["gpus"]:
            if self.gemm_tflops:
                gpu["measured"]["gemm_tflops"] = dict(self.gemm_tflops)
        if request.model:
            spec["profile"]["model"] = {"name": request.model, "seq_lens": list(request.seq_len),
                                        "micro_batches": list(request.micro_batch), "tp": list(request.tp),
                                        "dtype": request.layer_dtype or "bf16"}
            times = {f"{request.model}|{k}|seq={s}|mbs={m}|tp={t}": 1e-3 * m
                     for s in request.seq_len for m in request.micro_batch for t in request.tp
                     for k in ("dense", "embedding", "head") if t == 1 or k == "dense"}
            for gpu in spec["nodes"][0]["gpus"]:
                gpu["measured"] = {**gpu.get("measured", {}), "layer_forward_s": times,
                                   "layer_forward_backward_s": {k: 3 * v for k, v in times.items()}}
        Path(request.output).write_text(yaml.safe_dump(spec))


@pytest.fixture
def fake_profiler(monkeypatch):
    from tangram_launch.launch import profiling

    fake = FakeProfiler()
    monkeypatch.setattr(profiling, "profile_cluster", fake)
    return fake


def _options():
    from tangram_launch.launch.torchrun import LaunchOptions

    return LaunchOptions.from_argv(["--standalone", "--nproc-per-node", "2", "train.py"])


README_SHAPES = LayerShapes("tiny", (64,), (1, 2, 4, 8), (1, 2))


def test_a_cached_profile_without_the_layers_is_profiled_again_with_them_then_reused(tmp_path, fake_profiler,
                                                                                     caplog):
    _, path, reused = planned.profile_cluster(_options(), directory=str(tmp_path))  # an older launch: no layers
    assert not reused and fake_profiler.requests[-1].model is None
    with caplog.at_level(logging.INFO, logger="tangram_launch.launch.planning"):
        spec, again, reused = planned.profile_cluster(_options(), directory=str(tmp_path), layers=README_SHAPES)
    assert again == path and not reused and len(fake_profiler.requests) == 2
    asked = fake_profiler.requests[-1]
    assert (asked.model, asked.seq_len, asked.micro_batch, asked.tp) == ("tiny", (64,), (1, 2, 4, 8), (1, 2))
    assert asked.layer_budget_s == pytest.approx(16 * planned.LAUNCH_LAYER_JOB_S["cpu"])
    assert asked.layer_dtype in ("fp32", "bf16")  # CPU processes: the dtype likely_cpu_dtype finds faster here
    assert "has no layer timings of tiny at seq 64, micro-batch 1,2,4,8, tp 1,2" in caplog.text
    assert covers(recorded_layer_shapes(spec.profile), README_SHAPES)
    # sealed as the profiler's output: the same launch reuses it, and so does one needing fewer shapes
    for needed in (README_SHAPES, LayerShapes("tiny", (64,), (2, 4), (1,), asked.layer_dtype)):
        _, _, reused = planned.profile_cluster(_options(), directory=str(tmp_path), layers=needed)
        assert reused and len(fake_profiler.requests) == 2
    # another sequence length, another dtype, another model: profiled again, and that profile replaces the cached one
    other_dtype = {"fp32": "bf16", "bf16": "fp32"}[asked.layer_dtype]
    for needed in (LayerShapes("tiny", (32,), (1, 2, 4, 8), (1, 2)),
                   LayerShapes("tiny", (64,), (1,), (1,), other_dtype), LayerShapes("tiny-moe", (32,), (1,), (1,))):
        _, _, reused = planned.profile_cluster(_options(), directory=str(tmp_path), layers=needed)
        assert not reused and fake_profiler.requests[-1].model == needed.model
    assert len(list(Path(path).parent.glob("*.yaml"))) == 1


def test_reprofile_times_the_layers_again(tmp_path, fake_profiler):
    planned.profile_cluster(_options(), directory=str(tmp_path), layers=README_SHAPES)
    _, _, reused = planned.profile_cluster(_options(), directory=str(tmp_path), layers=README_SHAPES, reprofile=True)
    assert not reused and len(fake_profiler.requests) == 2 and fake_profiler.requests[-1].model == "tiny"


def test_a_failed_profile_keeps_the_cached_one(tmp_path, fake_profiler, monkeypatch):
    from tangram_launch.launch import profiling

    _, path, _ = planned.profile_cluster(_options(), directory=str(tmp_path))
    before = Path(path).read_bytes()

    def fails(request):
        Path(request.output).write_text("half a file")
        raise profiling.ProfileError("a worker died")

    monkeypatch.setattr(profiling, "profile_cluster", fails)
    with pytest.raises(profiling.ProfileError):
        planned.profile_cluster(_options(), directory=str(tmp_path), layers=README_SHAPES)
    from tangram_launch.specs.cluster import ClusterSpec

    assert Path(path).read_bytes() == before  # the staged file went, the cached one stays sealed
    assert profile_cache.seal_problem(path, planned.live_fingerprint(2), ClusterSpec.load(path).fingerprint) is None
    assert sorted(p.name for p in Path(path).parent.iterdir()) == [Path(path).name, Path(path).name + ".seal"]


def _launch_request(tmp_path, monkeypatch, *extra: str):
    from tangram_launch.launch.torchrun import LaunchOptions, PlanRequest

    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    options = LaunchOptions.from_argv(["--standalone", "--nproc-per-node", "2", "--profile", "--model", "tiny",
                                       "--global-batch", "8", "--seq-len", "64", *extra, "train.py"])
    request = PlanRequest(options=options, out_dir=str(tmp_path / "plans"))
    return request, planned.plan_inputs(options.tangram)


def test_layers_timed_in_another_dtype_than_the_profile_then_chooses_are_timed_again_in_that_one(
        tmp_path, monkeypatch, fake_profiler):
    monkeypatch.setattr(planned, "likely_cpu_dtype", lambda: "bf16")  # the small product's guess ...
    fake_profiler.gemm_tflops = {"fp32": 0.2, "bf16": 0.01}  # ... which the profile's GEMM contradicts
    cluster, _ = planned._profiled_cluster(*_launch_request(tmp_path, monkeypatch))
    assert [r.layer_dtype for r in fake_profiler.requests] == ["bf16", "fp32"]
    assert recorded_layer_shapes(cluster.profile).dtype == "fp32"
    cluster, _ = planned._profiled_cluster(*_launch_request(tmp_path, monkeypatch))  # cached, in the right dtype
    assert len(fake_profiler.requests) == 2 and recorded_layer_shapes(cluster.profile).dtype == "fp32"


def test_a_given_dtype_is_the_layers_dtype_and_a_hand_written_plan_times_no_layers(tmp_path, monkeypatch,
                                                                                    fake_profiler):
    monkeypatch.setattr(planned, "likely_cpu_dtype", lambda: pytest.fail("a given dtype needs no guess"))
    planned._profiled_cluster(*_launch_request(tmp_path, monkeypatch, "--dtype", "fp32"))
    assert [r.layer_dtype for r in fake_profiler.requests] == ["fp32"]
    request, inputs = _launch_request(tmp_path, monkeypatch, "--reprofile")
    planned._profiled_cluster(dataclasses.replace(request, hand_written="my-plan.yaml"), inputs)
    assert len(fake_profiler.requests) == 2 and fake_profiler.requests[-1].model is None


# --- what the launch says about the plan's pricing --------------------------------------------------------------------

def test_the_launch_says_which_stages_were_priced_from_measured_layers():
    from tangram_launch.specs.cluster import ClusterSpec

    spec = yaml.safe_load(PROFILED_CPU_2.read_text())
    measured = copy.deepcopy(spec)
    times = {f"tiny|{k}|seq=64|mbs={m}|tp=1": 1e-3 * m for m in (1, 2, 4, 8) for k in ("dense", "embedding", "head")}
    for gpu in measured["nodes"][0]["gpus"]:
        gpu["measured"] = {**gpu.get("measured", {}), "layer_forward_s": times,
                           "layer_forward_backward_s": {k: 3 * v for k, v in times.items()}}
    inputs = planned.planning_request(Namespace(model="tiny", global_batch=8, seq_len=64, dtype="fp32",
                                                workers=1), progress=False)
    plan = planned.make_launch_plan(ClusterSpec.from_dict(measured), inputs)
    lines = planned.measurement_lines(plan)
    assert len(lines) == plan.num_stages
    assert all("priced from measured layer times" in line for line in lines), lines
    assert any("embedding" in line for line in lines) and any("head" in line for line in lines)
    analytic = planned.measurement_lines(planned.make_launch_plan(ClusterSpec.from_dict(spec), inputs))
    assert all(line.endswith("priced by the analytic model (no measured layer times of this model)")
               for line in analytic)
