"""Predicted against measured after every planned run (run-report.json), and `tangram-launch calibrate` folding it
into the cluster file so the next plan changes where measurements disagree."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime_adapters.stage_timing import StageTimer
from tangram_launch.cli import main
from tangram_launch.launch import run_report
from tangram_launch.specs.cluster import ClusterSpec
from timeouts import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parent.parent
CPU2 = str(REPO / "examples" / "clusters" / "cpu-2.yaml")
# a plan file's content, as much of it as the report reads: two stages, one rank each
TWO_STAGES = {"stages": [{"layers": [0, 2], "island": "a"}, {"layers": [2, 4], "island": "b"}],
              "rank_layout": [{"rank": 0, "node": "n", "local_gpu": 0, "stage": 0},
                              {"rank": 1, "node": "n", "local_gpu": 1, "stage": 1}],
              "predicted": {"iteration_time_s": 0.1, "stages": [{"forward_s": 0.01, "backward_s": 0.02}] * 2},
              "num_microbatches": 2}


def _plan(tmp_path: Path, cluster: str, name: str) -> dict:
    out = tmp_path / name
    assert main(["plan", "--cluster", cluster, "--model", "tiny", "--global-batch", "8", "--seq-len", "64",
                 "--dtype", "fp32", "--workers", "1", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def _timings(plan: dict, slow: dict[int, float], steps: int = 4) -> list[dict]:
    """Timing lines as workers write them: each rank at `slow[rank]` x its stage's predicted time."""
    lines = []
    m = plan["num_microbatches"]
    for step in range(1, steps + 1):
        for r in plan["rank_layout"]:
            pred = plan["predicted"]["stages"][r["stage"]]
            k = slow.get(r["rank"], 1.0) * (5.0 if step == 1 else 1.0)  # the first step is warm-up: left out
            lines.append({"rank": r["rank"], "stage": r["stage"], "step": step, "microbatches": m,
                          "forward_s": k * pred["forward_s"] * m, "backward_s": k * pred["backward_s"] * m,
                          "backward_spans": m, "step_s": k * plan["predicted"]["iteration_time_s"]})
    return lines


def test_report_takes_medians_per_micro_batch_and_leaves_the_warm_up_step_out(tmp_path):
    plan = _plan(tmp_path, CPU2, "plan.json")
    report = run_report.build_report(plan, "abc", _timings(plan, {0: 2.0}))
    assert report["steps_measured"] == 3
    for stage in report["stages"]:
        ratios = {row["rank"]: row["ratio"] for row in stage["ranks"]}
        assert ratios[0] == pytest.approx(2.0) and all(v == pytest.approx(1.0) for k, v in ratios.items() if k)
    assert report["iteration"]["measured_median_s"] == pytest.approx(2.0 * plan["predicted"]["iteration_time_s"])
    table = run_report.format_report(report)
    assert "meas/pred" in table and "3 steps measured" in table


def test_calibrate_changes_the_next_plan_where_a_gpu_ran_slower_than_predicted(tmp_path, capsys):
    before = _plan(tmp_path, CPU2, "before.json")
    assert before["stages"][0]["dp"] == 2 and len(before["stages"]) == 1  # both devices alike: one dp 2 stage
    report = run_report.build_report(before, "abc", _timings(before, {1: 3.0}))
    (tmp_path / "run-report.json").write_text(json.dumps(report))
    calibrated = tmp_path / "calibrated.yaml"
    # the run directory (a launch's --run-dir), as a user has it at hand: calibrate reads its run-report.json
    assert main(["calibrate", str(tmp_path), "--cluster", CPU2, "-o", str(calibrated)]) == 0
    out = capsys.readouterr().out
    assert "local GPU 1 (stage 0): ran 3.00x the predicted time (slower)" in out and "GPU 0" not in out
    spec = ClusterSpec.load(calibrated)
    fast, slow = spec.nodes[0].gpus
    assert slow.tflops["fp32"] == pytest.approx(fast.tflops["fp32"] / 3.0, rel=1e-3)
    assert slow.measured["calibration"]["factor"] == pytest.approx(3.0)
    after = _plan(tmp_path, str(calibrated), "after.json")
    work = {}
    for stage in after["stages"]:
        for gpu in stage["gpus"]:
            work[gpu["local_gpu"]] = (stage["layers"][1] - stage["layers"][0]) * stage["micro_batch_size"] / stage["dp"]
    assert after["stages"] != before["stages"]
    assert work.get(1, 0) < work[0], after["stages"]  # the slow device gets less of the model, or none


def test_calibrate_plans_the_next_run_within_the_memory_a_gpu_stage_really_took(tmp_path, capsys):
    """A GPU run's report holds each stage's allocated peak; where it exceeded the plan's, calibrate takes each GPU
    of that stage to hold only physical / ratio, and the next plan fits that. No GPU here: the report's memory peaks
    are written as a GPU worker writes them (StageTimer.memory_peaks), the rest is the real CLI on real files."""
    cluster = tmp_path / "v100.yaml"
    ClusterSpec.from_dict({"name": "v100x4", "nodes": [{"name": "n0", "gpu": "v100-16gb", "count": 4}]}).dump(cluster)
    plan_args = ["plan", "--cluster", str(cluster), "--model", "gpt3-1.3b", "--global-batch", "32", "--seq-len",
                 "2048", "--dtype", "fp16", "--workers", "1", "-o"]
    assert main([*plan_args, str(tmp_path / "before.json")]) == 0
    before = json.loads((tmp_path / "before.json").read_text())
    stage0 = before["predicted"]["stages"][0]
    assert stage0["capacity_gib"] == 16.0  # the device's memory (a plan fills it up to the default 5 % headroom)
    ratio = 16.0 / stage0["peak_memory_gib"] + 0.15  # as measured, this stage would not fit a V100-16GB
    lines = _timings(before, {})
    predicted_allocated = stage0["peak_memory_gib"] - 1.0  # RUNTIME_OVERHEAD_BYTES: outside the allocator
    for t in lines:
        t["memory_allocated_peak_bytes"] = int((ratio * predicted_allocated if t["stage"] == 0 else 1.0) * (1 << 30))
        t["memory_reserved_peak_bytes"] = t["memory_allocated_peak_bytes"]
    report = run_report.build_report(before, "abc", lines)
    assert report["stages"][0]["memory"]["ratio"] == pytest.approx(ratio, rel=1e-6)
    report["cluster"] = {"name": "v100x4", "hash": ClusterSpec.load(cluster).content_hash(), "path": str(cluster)}
    (tmp_path / "run-report.json").write_text(json.dumps(report))
    calibrated = tmp_path / "calibrated.yaml"
    assert main(["calibrate", str(tmp_path / "run-report.json"), "-o", str(calibrated)]) == 0
    out = capsys.readouterr().out
    assert f"(stage 0): its stage allocated {ratio:.2f}x the predicted memory" in out
    stage0_gpus = {g["local_gpu"] for g in before["stages"][0]["gpus"]}
    spec = ClusterSpec.load(calibrated)
    for i, gpu in enumerate(spec.nodes[0].gpus):
        if i in stage0_gpus:
            assert gpu.memory_gib == pytest.approx(16.0 / ratio, rel=1e-3)
            assert gpu.measured["memory_calibration"]["memory_gib"] == 16.0
        else:
            assert gpu.memory_gib == 16.0 and "memory_calibration" not in gpu.measured
    assert main([*plan_args.copy()[:2], str(calibrated), *plan_args[3:], str(tmp_path / "after.json")]) == 0
    after = json.loads((tmp_path / "after.json").read_text())
    assert after["stages"] != before["stages"]
    for stage, pred in zip(after["stages"], after["predicted"]["stages"]):
        if {g["local_gpu"] for g in stage["gpus"]} & stage0_gpus:
            assert pred["peak_memory_gib"] <= 0.95 * 16.0 / ratio + 1e-6  # what the run showed it really takes


def test_calibrate_within_tolerance_leaves_the_file_alone(tmp_path, capsys):
    plan = _plan(tmp_path, CPU2, "plan.json")
    (tmp_path / "r.json").write_text(json.dumps(run_report.build_report(plan, "abc", _timings(plan, {1: 1.02}))))
    cluster = tmp_path / "c.yaml"
    cluster.write_bytes(Path(CPU2).read_bytes())
    assert main(["calibrate", str(tmp_path / "r.json"), "--cluster", str(cluster)]) == 0
    assert "is unchanged" in capsys.readouterr().out
    assert cluster.read_bytes() == Path(CPU2).read_bytes()


def test_report_and_calibrate_take_a_run_directory_and_refuse_one_without_a_report(tmp_path, capsys):
    plan = _plan(tmp_path, CPU2, "plan.json")
    run_dir = tmp_path / "run"
    (run_dir / "adapt").mkdir(parents=True)
    for argv in (["report", str(run_dir)], ["calibrate", str(run_dir), "--cluster", CPU2]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "field 'RUN_REPORT': a directory without run-report.json" in err and str(run_dir) in err
    (run_dir / "adapt" / "history.json").write_text(json.dumps({"adaptations": []}))
    assert main(["report", str(run_dir)]) == 0  # a run still going: its history
    assert "no adaptation" in capsys.readouterr().out
    report = run_report.build_report(plan, "abc", _timings(plan, {}))
    (run_dir / "run-report.json").write_text(json.dumps(report))
    assert main(["report", str(run_dir)]) == 0  # the report first, once the run has written it
    assert "meas/pred" in capsys.readouterr().out


def test_calibrate_refuses_a_file_that_is_not_a_run_report(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps({"stages": "nope"}))
    assert main(["calibrate", str(tmp_path / "r.json"), "--cluster", CPU2]) == 2
    err = capsys.readouterr().err
    assert "stages" in err and "Traceback" not in err


def test_the_iteration_splits_into_the_critical_ranks_pipeline_sync_and_optimizer(tmp_path):
    """Where an iteration's gap lies: the plan's pipeline and its longest tail beside the parts of the rank whose
    backward ended last (the other rank's wait for it shows in its own sync, not in the iteration's)."""
    plan = _plan(tmp_path, CPU2, "plan.json")
    pred = plan["predicted"]
    tails = [(s["sync_s"] + s["optimizer_s"], s) for s in pred["stages"]]
    assert all(s["sync_s"] >= 0 and s["optimizer_s"] > 0 for _, s in tails)
    lines = _timings(plan, {})
    for line in lines:  # rank 0's backward ends 30 ms later each step; rank 1 waits those 30 ms for its gradients
        late = 0.030 if line["rank"] == 0 else 0.0
        line.update(pipeline_s=0.02 + late + line["step"] * 1e-3, sync_s=0.034 - late, optimizer_s=0.003)
        line["step_s"] = line["pipeline_s"] + line["sync_s"] + line["optimizer_s"]
    report = run_report.build_report(plan, "abc", lines)
    parts = report["iteration"]["parts"]
    tail, longest = max(tails, key=lambda t: t[0])
    assert parts["predicted"] == pytest.approx({"pipeline_s": pred["iteration_time_s"] - tail,
                                                "sync_s": longest["sync_s"], "optimizer_s": longest["optimizer_s"]})
    # steps 2-4 (the first is warm-up), rank 0's: pipeline 52-54 ms, median 53
    assert parts["measured"] == pytest.approx({"pipeline_s": 0.053, "sync_s": 0.004, "optimizer_s": 0.003})
    stage = report["stages"][0]
    assert stage["predicted"]["sync_s"] == pred["stages"][0]["sync_s"]
    assert stage["measured"]["optimizer_s"] == pytest.approx(0.003)
    rows = {r["rank"]: r for r in stage["ranks"]}  # each rank's own tail against its stage's prediction
    assert rows[1]["sync_s"] == pytest.approx(0.034) and rows[0]["sync_s"] == pytest.approx(0.004)
    assert rows[1]["optimizer_ratio"] == pytest.approx(0.003 / pred["stages"][0]["optimizer_s"])
    table = run_report.format_report(report)
    assert "iteration ms  pipeline" in table and "measured      53.00     4.00" in table


def test_a_plan_without_stage_tails_reports_measured_parts_only():
    """A plan written before its stages carried sync and optimizer: no predicted parts, the measured ones shown."""
    lines = [{"rank": r, "stage": r, "step": step, "microbatches": 2, "forward_s": 0.02, "backward_s": 0.04,
              "step_s": 0.1, "pipeline_s": 0.08, "sync_s": 0.015, "optimizer_s": 0.005}
             for step in (1, 2) for r in (0, 1)]
    report = run_report.build_report(TWO_STAGES, "h", lines)
    assert report["iteration"]["parts"]["predicted"] is None
    assert report["stages"][1]["predicted"]["sync_s"] is None
    table = run_report.format_report(report)
    assert "predicted     -         -      -          100.00" in table


def test_on_gpus_the_report_sets_each_stages_measured_memory_peaks_beside_the_plans(tmp_path):
    """Workers on GPUs write the allocator's peaks (StageTimer's memory_peaks); the report takes each stage's largest,
    first step included (the optimizer's states appear there), and sets the allocated one against the plan's peak
    without the runtime's bytes outside the allocator. Lines without peaks (CPU workers) add no memory."""
    from tangram_launch.costmodel.memory import RUNTIME_OVERHEAD_BYTES

    gib = 1 << 30
    plan = {**TWO_STAGES, "predicted": {"iteration_time_s": 0.1, "stages": [
        {"forward_s": 0.01, "backward_s": 0.02, "peak_memory_gib": 11.0},
        {"forward_s": 0.01, "backward_s": 0.02, "peak_memory_gib": 21.0}]}}
    lines = [{"rank": s, "stage": s, "step": step, "microbatches": 2, "forward_s": 0.02, "backward_s": 0.04,
              "step_s": 0.1, **({"memory_allocated_peak_bytes": (9 + s * 10 + (step == 1)) * gib,
                                 "memory_reserved_peak_bytes": (12 + s * 10) * gib} if s == 0 or step > 2 else {})}
             for s in (0, 1) for step in (1, 2, 3)]
    report = run_report.build_report(plan, "h", lines)
    first, second = (s["memory"] for s in report["stages"])
    overhead = RUNTIME_OVERHEAD_BYTES / gib
    assert first["measured_allocated_gib"] == 10.0 and first["measured_reserved_gib"] == 12.0  # step 1's peak
    assert first["predicted_allocated_gib"] == pytest.approx(11.0 - overhead)
    assert first["ratio"] == pytest.approx(10.0 / (11.0 - overhead))
    assert second["measured_allocated_gib"] == 19.0 and second["predicted_gib"] == 21.0
    table = run_report.format_report(report)
    assert "memory GiB  pred allocated  meas allocated  meas reserved  meas/pred" in table
    assert "stage 0     10.00           10.00           12.00" in table
    cpu = run_report.build_report(plan, "h", [{k: v for k, v in t.items() if not k.startswith("memory")}
                                              for t in lines])
    assert all("memory" not in s for s in cpu["stages"]) and "memory GiB" not in run_report.format_report(cpu)


def test_a_cpu_worker_writes_no_memory_peaks_and_a_gpu_one_writes_both(tmp_path, monkeypatch):
    """The CPU clock reads nothing. The CUDA path cannot run on this GPU-less machine: torch.cuda's two peak readers
    are stood in for by fakes (the only mock here), to show what a GPU worker's line carries."""
    line = _first_stage_step(torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)), tmp_path)
    assert not any(k.startswith("memory") for k in line)
    from runtime_adapters.stage_timing import _Clock

    clock = _Clock(torch.device("cpu"))
    clock.cuda = True
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 5 << 30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a, **k: 6 << 30)
    assert clock.memory_peaks() == {"memory_allocated_peak_bytes": 5 << 30, "memory_reserved_peak_bytes": 6 << 30}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6), st.floats(0, 1), st.floats(0, 1), st.booleans()),
                max_size=30))
def test_report_never_fails_on_any_set_of_timing_lines(rows):
    plan = TWO_STAGES
    lines = [{"rank": s % 2, "stage": s, "step": step, "microbatches": 2, "forward_s": f, "backward_s": b,
              "step_s": f + b, **({"pipeline_s": f, "sync_s": b / 2, "optimizer_s": b / 2} if parted else {})}
             for s, step, f, b, parted in rows]
    report = run_report.build_report(plan, "h", lines)
    assert [s["stage"] for s in report["stages"]] == [0, 1]
    measured = report["iteration"]["parts"]["measured"]
    assert measured is None or all(v >= 0 for v in measured.values())
    assert run_report.report_problem(report) is None  # every report the launcher writes passes its readers' check
    run_report.format_report(report)


@pytest.mark.parametrize("edit, says", [
    (lambda r: r.__setitem__("iteration", "x"), "iteration is 'x', where a planned launch writes a mapping"),
    (lambda r: r["stages"][0].pop("predicted"), "stages[0].predicted is None, where a planned launch writes a mapping"),
    (lambda r: r["stages"][1]["measured"].__setitem__("backward_s", "abc"), "stages[1].measured.backward_s is 'abc'"),
    (lambda r: r["stages"][0].__setitem__("layers", [0]), "stages[0].layers is [0], where a planned launch writes"),
    (lambda r: r["iteration"]["parts"]["measured"].__setitem__("sync_s", [1]), "iteration.parts.measured.sync_s"),
    (lambda r: r.__setitem__("steps_measured", -1), "steps_measured is -1, where a planned launch writes an integer"),
])
def test_report_and_calibrate_name_the_field_an_edited_report_got_wrong(tmp_path, capsys, edit, says):
    lines = [{"rank": s, "stage": s, "step": step, "microbatches": 2, "forward_s": 0.01, "backward_s": 0.02,
              "step_s": 0.05, "pipeline_s": 0.03, "sync_s": 0.01, "optimizer_s": 0.01}
             for s in (0, 1) for step in (1, 2, 3)]
    report = run_report.build_report(TWO_STAGES, "h" * 64, lines)
    edit(report)
    path = tmp_path / "run-report.json"
    path.write_text(json.dumps(report))
    for command in (["report", str(path)], ["calibrate", str(path), "--cluster", CPU2]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"not a run report: {says}" in err and "Traceback" not in err


def _first_stage_step(stage: torch.nn.Module, tmp_path: Path) -> dict:
    """One timed step of a first stage (token ids in) over two micro-batches; its timing line."""
    timer = StageTimer.attach([stage], run_dir=str(tmp_path), rank=0, coords={"stage": 0}, microbatches=2,
                              device=torch.device("cpu"))
    timer.start_step()
    for _ in range(2):
        stage(torch.randint(0, 16, (2, 4))).sum().backward()
    return timer.end_step(1)


def test_stage_timer_counts_a_recompute_forward_as_backward(tmp_path):
    from torch.utils.checkpoint import checkpoint

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return checkpoint(self.lin, self.emb(x), use_reentrant=False)

    stage = Stage()
    line = _first_stage_step(stage, tmp_path)
    assert line["backward_spans"] == 2 and line["forward_s"] > 0 and line["backward_s"] > 0
    assert json.loads((tmp_path / "timings" / "rank0.jsonl").read_text())["step"] == 1


class _SlowBackward(torch.autograd.Function):
    """The identity whose backward takes at least ``SLOW_S`` (a stand-in for work the timer must see)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLOW_S)
        return grad


SLOW_S = 0.05


def test_the_last_stages_loss_counts_in_its_forward_and_backward(tmp_path):
    """The plan prices the head with its loss; the schedule computes the loss outside the stage module."""
    stage = torch.nn.Linear(8, 8)
    timer = StageTimer.attach([stage], run_dir=str(tmp_path), rank=0, coords={"stage": 1}, microbatches=1,
                              device=torch.device("cpu"))

    def slow_loss(out, target):
        time.sleep(SLOW_S)
        return _SlowBackward.apply(torch.nn.functional.mse_loss(out, target))

    loss_fn = timer.timed_loss(slow_loss)
    timer.start_step()
    x = torch.randn(4, 8, requires_grad=True)
    loss_fn(stage(x), torch.zeros(4, 8)).backward()
    line = timer.end_step(1)
    assert line["forward_s"] >= SLOW_S and line["backward_s"] >= SLOW_S
    assert line["step_s"] >= line["forward_s"] + line["backward_s"]


def test_a_step_splits_into_pipeline_sync_and_optimizer_that_sum_to_it(tmp_path):
    """The runtime marks the optimizer step; what comes between the last backward and it, and after it, is sync."""
    stage = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    timer = StageTimer.attach([stage], run_dir=str(tmp_path), rank=0, coords={"stage": 1}, microbatches=1,
                              device=torch.device("cpu"))
    timer.start_step()
    x = torch.randn(4, 8, requires_grad=True)
    stage(x).sum().backward()
    time.sleep(SLOW_S)  # an exposed gradient all-reduce
    timer.optimizer_begins()
    opt.step()
    time.sleep(SLOW_S)  # a slow optimizer
    timer.optimizer_ends()
    time.sleep(SLOW_S)  # the loss report
    line = timer.end_step(1)
    assert line["sync_s"] >= 2 * SLOW_S and SLOW_S <= line["optimizer_s"] < line["sync_s"]
    assert line["pipeline_s"] >= line["forward_s"] + line["backward_s"]
    assert line["pipeline_s"] + line["sync_s"] + line["optimizer_s"] == pytest.approx(line["step_s"], abs=1e-6)
    timer.start_step()  # a step whose optimizer step was skipped (fp16 overflow): no parts
    stage(x).sum().backward()
    assert "sync_s" not in timer.end_step(2)


def test_the_first_stages_backward_includes_the_embeddings_own_backward(tmp_path):
    """Token ids in: the backward ends with the last parameter gradient, after the embedding's output gradient."""
    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16, 8))

        def forward(self, tokens):
            return _SlowBackward.apply(self.weight)[tokens]  # (B, T, 8); the weight's gradient comes SLOW_S late

    stage = torch.nn.Sequential(Embed(), torch.nn.Linear(8, 8))
    line = _first_stage_step(stage, tmp_path)
    assert line["backward_spans"] == 2 and line["backward_s"] >= 2 * SLOW_S


def _launch(tmp_path: Path, plan: str, script: str, steps: int) -> tuple[subprocess.CompletedProcess, Path, dict]:
    """``tangram-launch`` of an example plan on 2 CPU processes: the finished process, the run dir, its report."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2",
                           "--plan", str(REPO / "examples" / "data" / plan), "--run-dir", str(run_dir),
                           str(REPO / "examples" / script), "--steps", str(steps)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, run_dir, json.loads((run_dir / "run-report.json").read_text())


@pytest.mark.distributed
def test_a_planned_launch_writes_a_run_report_with_every_stage_measured(tmp_path):
    done, run_dir, report = _launch(tmp_path, "plan-tiny-2cpu.json", "train_gpt.py", 4)
    assert [s["stage"] for s in report["stages"]] == [0, 1] and report["steps_measured"] == 3
    for stage in report["stages"]:
        assert stage["measured"]["forward_s"] > 0 and stage["measured"]["backward_s"] > 0
        assert [r["rank"] for r in stage["ranks"]] == [stage["stage"]]
    assert report["iteration"]["measured_median_s"] > 0
    measured = report["iteration"]["parts"]["measured"]  # the torch runtime marks its optimizer step
    assert measured["pipeline_s"] > 0 and measured["optimizer_s"] > 0 and measured["sync_s"] >= 0
    assert "iteration ms  pipeline" in done.stdout
    assert "predicted vs measured" in done.stdout and f"run report: {run_dir / 'run-report.json'}" in done.stdout


@pytest.mark.distributed
def test_a_deepspeed_launch_reports_its_stages_and_the_parts_of_its_steps(tmp_path):
    """DeepSpeed's engine runs the schedule and steps the optimizer inside ``train_batch``: the stage module's hooks,
    the timed loss and the optimizer's own step hooks still split each step."""
    pytest.importorskip("deepspeed")
    done, run_dir, report = _launch(tmp_path, "plan-tiny-2cpu-deepspeed.json", "train_gpt_deepspeed.py", 3)
    assert report["runtime"] == "deepspeed" and report["steps_measured"] == 2
    m = report["num_microbatches"]
    lines = run_report.read_timings(str(run_dir))
    for stage in report["stages"]:
        assert stage["measured"]["forward_s"] > 0 and stage["measured"]["backward_s"] > 0
        assert stage["measured"]["optimizer_s"] > 0 and stage["predicted"]["optimizer_s"] > 0
    # every micro-batch's backward seen on each stage (the last stage's loss adds one span per micro-batch)
    assert {(t["stage"], t["backward_spans"]) for t in lines} == {(0, m), (1, 2 * m)}
    for t in lines:
        assert t["pipeline_s"] + t["sync_s"] + t["optimizer_s"] == pytest.approx(t["step_s"], abs=1e-6)
    parts = report["iteration"]["parts"]
    assert parts["predicted"] is not None and parts["measured"]["pipeline_s"] > 0
    assert "iteration ms  pipeline" in done.stdout


def test_report_every_prints_once_each_time_every_stage_passes_another_n_steps(tmp_path):
    plan = TWO_STAGES
    out = io.StringIO()
    watcher = run_report.ReportEvery(str(tmp_path), plan, "h", every=2, out=out)
    folder = tmp_path / "timings"
    folder.mkdir()

    def steps(rank: int, upto: int, partial: bool = False) -> None:
        lines = [json.dumps({"rank": rank, "stage": rank, "step": s, "microbatches": 2, "forward_s": 0.02,
                             "backward_s": 0.04, "step_s": 0.1}) + "\n" for s in range(1, upto + 1)]
        text = "".join(lines) + ('{"rank": 0, "step": 9' if partial else "")  # a line being written is skipped
        (folder / f"rank{rank}.jsonl").write_text(text)

    steps(0, 3, partial=True)
    watcher.poll()
    assert out.getvalue() == ""  # stage 1 has not timed a step yet
    steps(1, 1)
    watcher.poll()
    assert out.getvalue() == ""  # every stage past 1 step, not 2
    steps(1, 2)
    watcher.poll()
    watcher.poll()
    assert out.getvalue().count("predicted vs measured") == 1
    steps(0, 4)
    steps(1, 4)
    watcher.poll()
    assert out.getvalue().count("predicted vs measured") == 2


def _finish_with(tmp_path: Path, slow: dict[int, float]) -> str:
    """finish() over timing files as the workers of TWO_STAGES write them, each rank at slow[rank] x its prediction."""
    run_dir = tmp_path / "run"
    (run_dir / "timings").mkdir(parents=True)
    for line in _timings(TWO_STAGES, slow):
        with open(run_dir / "timings" / f"rank{line['rank']}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    out = io.StringIO()
    assert run_report.finish(str(run_dir), TWO_STAGES, "abc", out=out) == str(run_dir / "run-report.json")
    return out.getvalue()


@pytest.mark.unit
def test_the_end_of_a_run_says_what_its_ratios_mean(tmp_path):
    """Both stages slow by about as much: the devices' speed, not the plan's balance; one stage slow: that stage.
    Within 10 %: nothing is added to the table."""
    both = _finish_with(tmp_path / "both", {0: 1.18, 1: 1.14})
    assert "every stage ran about 16% slower than priced" in both and "the balance holds" in both
    assert f"tangram-launch calibrate {tmp_path / 'both' / 'run' / 'run-report.json'}" in both
    one = _finish_with(tmp_path / "one", {1: 1.3})
    assert "stage 1 30% slower than priced" in one and "every stage" not in one and "stage 0" not in one
    assert "rebalances" in one
    fine = _finish_with(tmp_path / "fine", {0: 1.05, 1: 0.97})
    assert "calibrate" not in fine and "run report:" in fine


_RATIOS = st.lists(st.floats(0.97, 1.03), min_size=2, max_size=6)


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(ratios=_RATIOS, factor=st.one_of(st.floats(1.15, 3.0), st.floats(0.3, 0.86)), odd=st.integers(0, 5),
       push=st.one_of(st.floats(1.2, 3.0), st.floats(0.3, 0.8)))
def test_a_common_factor_reads_as_the_devices_speed_and_one_stage_off_reads_as_that_stage(ratios, factor, odd, push):
    """Ratios near 1 read as nothing; the same ratios all scaled by one factor beyond the tolerance read as every
    stage off by about as much; one stage pushed beyond it while the others stay near 1 is named, alone."""

    def report(rs):
        return {"stages": [{"stage": k, "ratio": r} for k, r in enumerate(rs)]}
    assert run_report.reading(report(ratios), "r.json") is None
    scaled = run_report.reading(report([r * factor for r in ratios]), "r.json")
    assert scaled is not None and scaled.startswith("every stage ran about")
    assert ("slower" if factor > 1 else "faster") in scaled
    k = odd % len(ratios)
    pushed = [r * push if i == k else r for i, r in enumerate(ratios)]
    one = run_report.reading(report(pushed), "r.json")
    assert one is not None and one.startswith(f"stage {k} ") and "every stage" not in one
    assert all(f"stage {i} " not in one for i in range(len(ratios)) if i != k)
