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
    assert main(["calibrate", str(tmp_path / "run-report.json"), "--cluster", CPU2, "-o", str(calibrated)]) == 0
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


def test_calibrate_within_tolerance_leaves_the_file_alone(tmp_path, capsys):
    plan = _plan(tmp_path, CPU2, "plan.json")
    (tmp_path / "r.json").write_text(json.dumps(run_report.build_report(plan, "abc", _timings(plan, {1: 1.02}))))
    cluster = tmp_path / "c.yaml"
    cluster.write_bytes(Path(CPU2).read_bytes())
    assert main(["calibrate", str(tmp_path / "r.json"), "--cluster", str(cluster)]) == 0
    assert "is unchanged" in capsys.readouterr().out
    assert cluster.read_bytes() == Path(CPU2).read_bytes()


def test_calibrate_refuses_a_file_that_is_not_a_run_report(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps({"stages": "nope"}))
    assert main(["calibrate", str(tmp_path / "r.json"), "--cluster", CPU2]) == 2
    err = capsys.readouterr().err
    assert "stages" in err and "Traceback" not in err


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 6), st.floats(0, 1), st.floats(0, 1)), max_size=30))
def test_report_never_fails_on_any_set_of_timing_lines(rows):
    plan = TWO_STAGES
    lines = [{"rank": s % 2, "stage": s, "step": step, "microbatches": 2, "forward_s": f, "backward_s": b,
              "step_s": f + b} for s, step, f, b in rows]
    report = run_report.build_report(plan, "h", lines)
    assert [s["stage"] for s in report["stages"]] == [0, 1]
    run_report.format_report(report)


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


@pytest.mark.distributed
def test_a_planned_launch_writes_a_run_report_with_every_stage_measured(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2",
                           "--plan", str(REPO / "examples" / "data" / "plan-tiny-2cpu.json"), "--run-dir",
                           str(run_dir), str(REPO / "examples" / "train_gpt.py"), "--steps", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "run-report.json").read_text())
    assert [s["stage"] for s in report["stages"]] == [0, 1] and report["steps_measured"] == 3
    for stage in report["stages"]:
        assert stage["measured"]["forward_s"] > 0 and stage["measured"]["backward_s"] > 0
        assert [r["rank"] for r in stage["ranks"]] == [stage["stage"]]
    assert report["iteration"]["measured_median_s"] > 0
    assert "predicted vs measured" in done.stdout and f"run report: {run_dir / 'run-report.json'}" in done.stdout


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
