"""Trust at first use: what a newcomer from torchrun or DeepSpeed meets in their first runs.

* bad input that every worker finds (the README's main job with ``--lr nan``): the worker's one line, once, and
  one line of the launcher's, exit 2; torch's failure report stays for real crashes;
* after ``tangram-launch calibrate``, a plan whose stage layout no calibrating run ran is warned about once at
  planning time (its prediction is unmeasured);
* the step time a run prints is the one its run report keeps: the slowest rank's;
* the README names every example training script beside the runtime it runs.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tangram_launch.cli import main
from tangram_launch.errors import SpecError
from tangram_launch.launch import run_report, worker_exit
from tangram_launch.specs.cluster import ClusterSpec
from helpers_cli import cli_env
from timeouts import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parent.parent
TRAIN_GPT = REPO / "examples" / "train_gpt.py"
CPU_2 = REPO / "examples" / "clusters" / "cpu-2.yaml"
REFUSED = worker_exit.EXIT_WORKER_INPUT_ERROR
# the README's main job, planned from the example CPU cluster instead of a profile (the same launch, no 20 s profile)
README_JOB = ["--standalone", "--nproc-per-node", "2", "--cluster", str(CPU_2), "--model", "tiny", "--global-batch",
              "8", "--seq-len", "64"]


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tangram_launch.cli", *args], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, stdin=subprocess.DEVNULL)


def _after_launch(stderr: str) -> list[str]:
    """The lines after the launcher's "planned launch" line: what the workers' start and end printed."""
    lines = stderr.splitlines()
    start = max(i for i, line in enumerate(lines) if "planned launch: plan" in line)
    return lines[start + 1:]


# --- bad input every worker finds ----------------------------------------------------------------------------------

def _failure(exitcode: int, *, timestamp: int = 100, line: str | None = None, message: str = "SpecError: x"):
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(timestamp),
                                                          **({worker_exit.LINE_KEY: line} if line else {})}}}
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, error_file_data=data)


@pytest.mark.unit
def test_workers_that_all_refused_their_input_are_reported_in_their_line_once_and_one_more():
    same = "train_gpt: error: field '--lr': out of range (got nan)"
    status, lines = worker_exit.input_error_report({1: _failure(REFUSED, line=same), 0: _failure(REFUSED, line=same)})
    assert status == 2 and lines == [same, "tangram-launch: error: rank 0 (and 1 more) refused its input; exit "
                                           "status 2"]
    # different messages: each once, the lowest rank's line
    _, lines = worker_exit.input_error_report({0: _failure(REFUSED, line="a: error: x", message="E: x"),
                                               1: _failure(REFUSED, line="b: error: y", message="E: y"),
                                               2: _failure(REFUSED, line="c: error: x", message="E: x")})
    assert lines[:2] == ["a: error: x", "b: error: y"] and len(lines) == 3
    # a peer the agent stopped after the refusal is no failure of its own
    _, lines = worker_exit.input_error_report({0: _failure(REFUSED, line=same), 1: _failure(-15, timestamp=101)})
    assert lines == [same, "tangram-launch: error: rank 0 refused its input (1 other worker(s) stopped); exit "
                           "status 2"]


@pytest.mark.unit
@pytest.mark.parametrize("other", [_failure(1), _failure(-11), _failure(-9, timestamp=99), _failure(2)],
                         ids=["exit 1", "SIGSEGV", "SIGKILL before the refusal", "exit 2"])
def test_a_crash_beside_a_refusal_keeps_torchs_report(other):
    failures = {0: _failure(REFUSED, line="train_gpt: error: x"), 1: other}
    assert worker_exit.input_error_report(failures) is None
    assert worker_exit.launcher_status(failures)[0] == 2  # the refusal still decides the status
    assert worker_exit.input_error_report({0: _failure(1)}) is None


@pytest.mark.unit
def test_a_told_worker_leaves_its_line_to_the_launcher_once_it_is_in_the_error_file(tmp_path, capsys):
    told = {worker_exit.ENV_INPUT_ERROR_EXIT: str(REFUSED), "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    bad = SpecError("out of range", field="--lr", value=float("nan"))
    assert worker_exit.exit_status_for(bad, prog="train_gpt", env=told) == REFUSED
    assert capsys.readouterr().err == ""
    data = json.loads((tmp_path / "error.json").read_text())
    assert worker_exit._worker_message(SimpleNamespace(error_file_data=data)) == (
        "SpecError: field '--lr': out of range (got nan)", "train_gpt: error: field '--lr': out of range (got nan)")
    # no error file to write, or not told: the worker prints its line itself
    for env in ({worker_exit.ENV_INPUT_ERROR_EXIT: str(REFUSED)},
                {"TORCHELASTIC_ERROR_FILE": str(tmp_path / "plain.json")}):
        worker_exit.exit_status_for(bad, prog="train_gpt", env=env)
        assert capsys.readouterr().err == "train_gpt: error: field '--lr': out of range (got nan)\n"


@pytest.mark.unit
def test_torchs_lines_about_a_refusal_are_held_and_released_in_order_for_a_crash(caplog):
    agent = logging.getLogger(worker_exit.FAILURE_LOGGERS[0])
    with caplog.at_level(logging.WARNING):
        with worker_exit.failure_lines_held() as held:  # a refusal, the agent stops the other worker
            agent.warning(worker_exit.STOPPING_MSGS[0], 124, "SIGTERM")
            agent.error(worker_exit.FAILED_WORKER_MSG, REFUSED, 0, 123, "python")
        assert caplog.records == [] and len(held.records) == 2
        held.release()  # the outcome was no refusal after all: torch's lines, in its order
        assert [r.args[0] for r in caplog.records] == [124, REFUSED]
        caplog.clear()
        with worker_exit.failure_lines_held() as held:  # a crash: its line settles it at once
            agent.warning(worker_exit.STOPPING_MSGS[0], 124, "SIGTERM")
            agent.error(worker_exit.FAILED_WORKER_MSG, 1, 0, 123, "python")
            agent.warning(worker_exit.STOPPING_MSGS[0], 125, "SIGKILL")
        assert [r.args[0] for r in caplog.records] == [124, 1, 125] and held.records == []


@pytest.mark.distributed
def test_the_readme_job_with_a_bad_learning_rate_says_so_in_two_lines(tmp_path):
    proc = _cli(tmp_path, *README_JOB, str(TRAIN_GPT), "--steps", "5", "--lr", "nan")
    assert proc.returncode == 2, proc.stderr[-3000:]
    after = _after_launch(proc.stderr)
    assert len(after) == 2, proc.stderr[-3000:]
    assert after[0] == "train_gpt: error: field '--lr': out of range (got nan); valid: a finite number > 0 and <= 10"
    # both ranks refused, or one did and the agent stopped the other before it got there
    assert after[1] in ["tangram-launch: error: rank 0 (and 1 more) refused its input; exit status 2",
                        *(f"tangram-launch: error: rank {r} refused its input (1 other worker(s) stopped); exit "
                          "status 2" for r in (0, 1))], after


@pytest.mark.distributed
def test_a_crashing_worker_keeps_torchruns_failure_report(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("raise RuntimeError('boom')\n")
    proc = _cli(tmp_path, *README_JOB, str(crash))
    assert proc.returncode == 1, proc.stderr[-3000:]
    for needle in ("failed (exitcode: 1)", "Root Cause (first observed failure)", "RuntimeError: boom",
                   "tangram-launch: first failure: host"):
        assert needle in proc.stderr, (needle, proc.stderr[-3000:])
    assert "refused its input" not in proc.stderr


# --- a plan from calibrated figures, in a layout no run measured ---------------------------------------------------

def _plan_file(tmp_path: Path, cluster: str | Path, name: str) -> dict:
    out = tmp_path / name
    assert main(["plan", "--cluster", str(cluster), "--model", "tiny", "--global-batch", "8", "--seq-len", "64",
                 "--dtype", "fp32", "--workers", "1", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def _report(plan: dict, plan_hash: str, slow: dict[int, float]) -> dict:
    """The run report of ``plan`` whose ranks ran ``slow[rank]`` x their predicted time (3 steps)."""
    m = plan["num_microbatches"]
    lines = [{"rank": r["rank"], "stage": r["stage"], "step": step, "microbatches": m, "backward_spans": m,
              "forward_s": k * pred["forward_s"] * m, "backward_s": k * pred["backward_s"] * m,
              "step_s": k * plan["predicted"]["iteration_time_s"]}
             for step in (1, 2, 3) for r in plan["rank_layout"]
             for pred, k in [(plan["predicted"]["stages"][r["stage"]], slow.get(r["rank"], 1.0))]]
    return run_report.build_report(plan, plan_hash, lines)


def _plan_at_launch(tmp_path: Path, cluster: Path, caplog) -> tuple[dict, list[str]]:
    """What a launch with ``--cluster`` plans (the launcher's plan provider), and the warnings it logged."""
    from tangram_launch.launch.planning import provide_plan
    from tangram_launch.launch.torchrun import LaunchOptions, PlanRequest

    options = LaunchOptions.from_argv([*README_JOB[:3], "--cluster", str(cluster), *README_JOB[5:], "--dtype",
                                       "fp32", "train.py"])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        path = provide_plan(PlanRequest(options=options, out_dir=str(tmp_path / "plans")))
    return json.loads(Path(path).read_text()), [r.getMessage() for r in caplog.records
                                                if r.levelno >= logging.WARNING]


@pytest.mark.unit
def test_a_plan_in_a_layout_no_calibrating_run_ran_is_warned_about_once_at_planning(tmp_path, monkeypatch, caplog):
    from tangram_launch.launch.calibration import calibration_records, plan_layout, unmeasured_layout_line

    monkeypatch.setenv("TANGRAM_CACHE_DIR", str(tmp_path / "cache"))
    before = _plan_file(tmp_path, CPU_2, "before.json")
    assert len(before["stages"]) == 1  # both CPUs in one data-parallel stage
    (tmp_path / "r1.json").write_text(json.dumps(_report(before, "a" * 64, {1: 3.0})))
    calibrated = tmp_path / "calibrated.yaml"
    assert main(["calibrate", str(tmp_path / "r1.json"), "--cluster", str(CPU_2), "-o", str(calibrated)]) == 0
    spec = ClusterSpec.load(calibrated)
    assert [c["layout"] for c in calibration_records(spec)] == [plan_layout(before)]

    after, warnings = _plan_at_launch(tmp_path, calibrated, caplog)  # CPU 1 is slower now: another layout
    assert plan_layout(after) != plan_layout(before)
    unmeasured = [w for w in warnings if "unmeasured" in w]
    assert len(unmeasured) == 1 and "tangram-launch calibrate" in unmeasured[0], warnings
    assert unmeasured_layout_line(spec, before) is None  # the layout the report ran
    old = dataclasses.replace(spec, profile={})  # calibrated before the record kept the layout: no warning
    assert old.nodes[0].gpus[1].measured["calibration"] and unmeasured_layout_line(old, after) is None
    assert unmeasured_layout_line(ClusterSpec.load(CPU_2), after) is None  # never calibrated

    # calibrated again from a run of the new layout: that layout is measured now, and so is the first
    (tmp_path / "r2.json").write_text(json.dumps(_report(after, "b" * 64, {0: 1.5})))
    assert main(["calibrate", str(tmp_path / "r2.json"), "--cluster", str(calibrated)]) == 0
    again = ClusterSpec.load(calibrated)
    assert [c["plan_hash"] for c in calibration_records(again)] == ["a" * 64, "b" * 64]
    assert unmeasured_layout_line(again, after) is None and unmeasured_layout_line(again, before) is None


# --- the step time: printed and reported alike ---------------------------------------------------------------------

# train_gpt.py with the rank that prints (last stage, dp 0, tp 0) late between steps (its data takes DELAY_S): the
# others wait for it inside every step, so the slowest rank's step time is about DELAY_S longer than its own.
DELAY_S = 0.3
LATE_PRINTER = """
import sys, time
sys.path.insert(0, {examples!r})
import train_gpt
from tangram_launch.worker import current_plan

place = current_plan().place
if place.is_last_stage and place.coords["dp"] == 0 and place.coords["tp"] == 0:
    batch = train_gpt.TokenBatches.batch
    train_gpt.TokenBatches.batch = lambda self, consumed: (time.sleep({delay}), batch(self, consumed))[1]
sys.exit(train_gpt.main())
"""


@pytest.mark.distributed
def test_the_printed_step_time_is_the_slowest_ranks_as_in_the_run_report(tmp_path):
    script = tmp_path / "late_printer.py"
    script.write_text(LATE_PRINTER.format(examples=str(REPO / "examples"), delay=DELAY_S))
    proc = _cli(tmp_path, *README_JOB, "--run-dir", str(tmp_path / "run"), str(script), "--steps", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed_s = [float(ms) / 1e3 for ms in re.findall(r"^step +\d+ .* ([\d.]+) ms \(slowest rank\)$", proc.stdout,
                                                        re.M)]
    report = json.loads((tmp_path / "run" / "run-report.json").read_text())
    assert len(printed_s) == len(report["step_s"]) == 4, proc.stdout
    assert printed_s == pytest.approx(report["step_s"], rel=0.2), (printed_s, report["step_s"])
    # Step 1 starts when each rank is through its own set-up, so the others may start it after the late rank began to
    # sleep; from step 2 on, the previous step's max all-reduce lines the ranks up and the whole delay shows.
    assert all(reported > DELAY_S for reported in report["step_s"][1:]), report["step_s"]


# --- the README's example scripts ----------------------------------------------------------------------------------

@pytest.mark.unit
def test_the_readme_names_every_example_training_script_in_its_runtimes_table():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| `--runtime` |"):]
    table = table[:table.index("\n\n")]
    scripts = sorted(p.name for p in (REPO / "examples").glob("train*.py"))
    assert {"train_gpt.py", "train_gpt_deepspeed.py", "train_gpt_megatron.py", "train_hf.py"} <= set(scripts)
    for name in scripts:
        assert f"(examples/{name})" in table, name
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "train_gpt_deepspeed.py" in rows["`deepspeed`"] and "train_gpt_megatron.py" in rows["`megatron`"]
