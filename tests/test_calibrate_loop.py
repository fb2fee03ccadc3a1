"""`tangram-launch calibrate` closes the loop for a profiled cluster: it scales the figures the cost model really
reads (the profiler's, before the spec sheet's), finds the cached profile a `--profile` launch planned from, seals it
again so the next launch plans from it, and refuses a file whose figures the run did not plan from."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.cli import main
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.launch import planning, profile_cache, run_report
from tangram_launch.launch.calibration import calibrate
from tangram_launch.specs.cluster import ClusterSpec
from timeouts import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parent.parent
PROFILED = REPO / "examples" / "clusters" / "profiled-cpu-2.yaml"  # measured gemm_tflops, memory bandwidth
KEY = "sha256:" + "ab" * 16
SWEEP = [[128, 128, 128, 0.05], [512, 512, 512, 0.09], [1024, 1024, 1024, 0.1]]


def _profiled_with_sweep_and_layers() -> ClusterSpec:
    data = ClusterSpec.load(PROFILED).to_dict()
    for gpu in data["nodes"][0]["gpus"]:
        gpu["measured"]["gemm_sweep_tflops"] = {"fp32": [list(row) for row in SWEEP]}
        gpu["measured"]["layer_forward_s"] = {"tiny|dense|64|4|1": 0.002}
    return ClusterSpec.from_dict(data)


def _report_for(cluster_path: str, slow: dict[int, float], tmp_path: Path) -> Path:
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", cluster_path, "--model", "tiny", "--global-batch", "8", "--seq-len", "64",
                 "--dtype", "fp32", "--workers", "1", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    lines = []
    for step in range(1, 5):
        for r in plan["rank_layout"]:
            pred = plan["predicted"]["stages"][r["stage"]]
            k, m = slow.get(r["local_gpu"], 1.0), plan["num_microbatches"]
            lines.append({"rank": r["rank"], "stage": r["stage"], "step": step, "microbatches": m,
                          "forward_s": k * pred["forward_s"] * m, "backward_s": k * pred["backward_s"] * m,
                          "backward_spans": m, "step_s": k * plan["predicted"]["iteration_time_s"]})
    path = tmp_path / "run-report.json"
    path.write_text(json.dumps(run_report.build_report(plan, "h" * 64, lines)))
    return path


@settings(max_examples=30, deadline=None)
@given(factors=st.tuples(st.floats(0.2, 20.0), st.floats(0.2, 20.0)), shape=st.tuples(*[st.integers(16, 4096)] * 3))
def test_a_calibrated_profiled_gpu_prices_every_kernel_factor_times_slower(factors, shape):
    cluster = _profiled_with_sweep_and_layers()
    report = {"plan_hash": "p", "stages": [{"stage": i, "ranks": [
        {"node": cluster.nodes[0].name, "local_gpu": i, "ratio": f}]} for i, f in enumerate(factors)]}
    after, changes = calibrate(cluster, report, tolerance=0.0)
    assert sorted(c.local_gpu for c in changes) == [i for i, f in enumerate(factors) if f != 1.0]
    for i, factor in enumerate(factors):
        for dtype in ("fp32", "bf16"):
            old = DeviceModel.from_gpu(cluster.nodes[0].gpus[i], dtype)
            new = DeviceModel.from_gpu(after.nodes[0].gpus[i], dtype)
            assert new.gemm_s(*shape) == pytest.approx(factor * old.gemm_s(*shape), rel=2e-3)
            assert new.memory_s(1e9) == pytest.approx(factor * old.memory_s(1e9), rel=2e-3)
            assert new.measured_layer_forward_s == {k: pytest.approx(factor * v, rel=2e-3)
                                                    for k, v in old.measured_layer_forward_s.items()}


def test_a_gpu_the_run_left_out_takes_its_timed_twins_factor():
    """Two devices of one kind, the plan used one: left as profiled, the untimed one would look 3x faster than
    its twin and the next plan would move the work there."""
    cluster = _profiled_with_sweep_and_layers()
    node = cluster.nodes[0].name
    report = {"plan_hash": "p", "stages": [{"stage": 0, "ranks": [{"node": node, "local_gpu": 1, "ratio": 3.0}]}]}
    after, changes = calibrate(cluster, report)
    assert [(c.local_gpu, c.stage, c.factor) for c in changes] == [(0, None, 3.0), (1, 0, 3.0)]
    assert "not timed, as the timed cpu devices on " + node in changes[0].line()
    for i in (0, 1):
        old, new = (DeviceModel.from_gpu(c.nodes[0].gpus[i], "fp32") for c in (cluster, after))
        assert new.gemm_s(512, 512, 512) == pytest.approx(3.0 * old.gemm_s(512, 512, 512), rel=2e-3)
    other = ClusterSpec.from_dict({**cluster.to_dict(), "nodes": [{**cluster.to_dict()["nodes"][0], "gpus": [
        {**cluster.to_dict()["nodes"][0]["gpus"][0], "type": "t4"}, cluster.to_dict()["nodes"][0]["gpus"][1]]}]})
    _, changes = calibrate(other, report)
    assert [c.local_gpu for c in changes] == [1]  # no timed twin of its kind: left as it is


def _cache_with_profile(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(planning.ENV_CACHE_DIR, str(tmp_path / "cache"))
    path = tmp_path / "cache" / "profiles" / ("ab" * 16 + ".yaml")
    path.parent.mkdir(parents=True)
    path.write_bytes(PROFILED.read_bytes())
    profile_cache.seal(str(path), KEY, ClusterSpec.load(path).fingerprint)
    return path


def test_calibrate_finds_the_cached_profile_and_the_next_launch_reuses_it(tmp_path, monkeypatch, capsys):
    path = _cache_with_profile(tmp_path, monkeypatch)
    report = _report_for(str(path), {1: 3.0}, tmp_path)
    before = ClusterSpec.load(path)
    assert main(["calibrate", str(report)]) == 0
    out = capsys.readouterr().out
    assert "GPU 1 (stage" in out and "the next launch with --profile on this machine plans from it" in out
    reused = planning.cached_profile(str(tmp_path / "cache"), KEY, nproc_per_node=2, need_full=False)
    assert reused is not None and reused.content_hash() != before.content_hash()
    slow = reused.nodes[0].gpus[1].measured["gemm_tflops"]["fp32"]
    assert slow == pytest.approx(before.nodes[0].gpus[1].measured["gemm_tflops"]["fp32"] / 3.0, rel=1e-3)
    assert [c["plan_hash"] for c in profile_cache.calibrations(str(path))] == ["h" * 64]
    kept = list(path.parent.glob("*.before-calibration-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == PROFILED.read_bytes()
    # the same report again would compound the ratios: refused, the file as it was
    text = path.read_bytes()
    assert main(["calibrate", str(report)]) == 2
    err = capsys.readouterr().err
    assert "already calibrated from this run report" in err and "field 'cluster (the one the run report names)'" in err
    assert path.read_bytes() == text


def test_calibrate_refuses_a_cluster_file_the_run_did_not_plan_from(tmp_path, monkeypatch, capsys):
    path = _cache_with_profile(tmp_path, monkeypatch)
    report = _report_for(str(REPO / "examples" / "clusters" / "cpu-2.yaml"), {1: 3.0}, tmp_path)
    text = path.read_bytes()
    assert main(["calibrate", str(report), "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert "are not the ones the run's plan was made from" in err and "'--cluster'" in err
    assert path.read_bytes() == text
    assert main(["calibrate", str(report)]) == 2  # nor is it found in the cache
    assert "no cached profile in" in capsys.readouterr().err


def test_calibrate_takes_the_cluster_file_a_cluster_launch_names(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(planning.ENV_CACHE_DIR, str(tmp_path / "empty-cache"))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_bytes(PROFILED.read_bytes())
    report_path = _report_for(str(cluster), {1: 2.0}, tmp_path)
    report = json.loads(report_path.read_text())
    report["cluster"]["path"] = str(cluster)  # as run_report.finish writes it for a --cluster launch
    report_path.write_text(json.dumps(report))
    assert main(["calibrate", str(report_path)]) == 0
    copy = tmp_path / "cluster.calibrated.yaml"  # the user's file as written stays; the copy goes beside it
    assert f"plan again with --cluster {copy}" in capsys.readouterr().out
    assert cluster.read_bytes() == PROFILED.read_bytes()
    assert ClusterSpec.load(copy).nodes[0].gpus[1].measured["calibration"]["factor"] == pytest.approx(2.0)
    cluster.unlink()
    assert main(["calibrate", str(report_path)]) == 2
    assert "the cluster file the run was launched with is gone" in capsys.readouterr().err


@pytest.mark.parametrize("what, argv, says", [
    ("a plan file", ["--cluster", str(PROFILED)], "not a run report: no plan_hash and stages (a plan file?"),
    ("a tolerance in percent", ["--tolerance", "5"], "field '--tolerance': is a fraction of the predicted time"),
    ("a negative tolerance", ["--tolerance", "-1"], "valid: 0 <= t < 1 (0.05 = 5 %)"),
])
def test_calibrate_refuses_what_it_cannot_use_saying_which_field(tmp_path, capsys, what, argv, says):
    report = _report_for(str(PROFILED), {1: 2.0}, tmp_path)
    target = tmp_path / "plan.json" if what == "a plan file" else report
    assert main(["calibrate", str(target), *argv]) == 2
    assert says in capsys.readouterr().err
    assert main(["report", str(tmp_path / "plan.json")]) == 2
    assert "not a run report: no plan_hash and stages (a plan file?" in capsys.readouterr().err


def _edit_rank(report: dict, key: str, value) -> None:
    report["stages"][0]["ranks"][0][key] = value


@pytest.mark.parametrize("edit, says", [
    (lambda r: _edit_rank(r, "local_gpu", -1), "field 'stages[0].ranks[0].local_gpu': expected the rank's GPU index"),
    (lambda r: _edit_rank(r, "local_gpu", 7), "field 'stages[].ranks.local_gpu': the report times a GPU that node"),
    (lambda r: _edit_rank(r, "local_gpu", "0"), "(got '0'); valid: an integer >= 0"),
    (lambda r: _edit_rank(r, "ratio", 1e300), "field 'stages[0].ranks[0].ratio': a rank's measured/predicted ratio"),
    (lambda r: _edit_rank(r, "ratio", "2"), "must be a number (got '2'); valid: 0.001 < ratio < 1000"),
    (lambda r: _edit_rank(r, "ratio", -2.0), "must be a positive number a run can measure (got -2.0)"),
    (lambda r: _edit_rank(r, "node", 3), "field 'stages[0].ranks[0].node': expected the rank's node name (got 3)"),
    (lambda r: r["stages"][0]["ranks"].__setitem__(0, "x"), "field 'stages[0].ranks[0]': expected a mapping"),
    (lambda r: r["stages"][0].__setitem__("stage", "0"), "stages[0].stage is '0', where a planned launch writes an"),
    (lambda r: r["stages"][0].__setitem__("memory", {"ratio": 0}), "field 'stages[0].memory.ratio': a stage's"),
])
def test_an_edited_report_is_refused_by_field_and_leaves_the_cluster_file_as_it_was(tmp_path, capsys, edit, says):
    """Every rank row is read whole before anything is written: a GPU index off the node, a ratio no run measures
    (whose inverse would scale the figures to nonsense) or a value of the wrong type is named, where it used to be
    skipped (its GPU then took its twins' factor) or applied."""
    cluster = tmp_path / "cluster.yaml"
    cluster.write_bytes(PROFILED.read_bytes())
    path = _report_for(str(cluster), {1: 2.0}, tmp_path)
    report = json.loads(path.read_text())
    edit(report)
    path.write_text(json.dumps(report))
    assert main(["calibrate", str(path), "--cluster", str(cluster)]) == 2
    assert says in capsys.readouterr().err
    assert cluster.read_bytes() == PROFILED.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.yaml", "plan.json", "run-report.json"]


def test_a_new_profile_keeps_an_edited_or_calibrated_one_aside(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(PROFILED.read_bytes())
    profile_cache.seal(str(path), KEY, ClusterSpec.load(path).fingerprint)
    assert profile_cache.keep_aside(str(path), KEY, "t0") is None  # the profiler's own output: superseded
    profile_cache.reseal_calibrated(str(path), KEY, ClusterSpec.load(path).fingerprint, "p", "t")
    kept = profile_cache.keep_aside(str(path), KEY, "t1")
    assert kept and Path(kept).read_bytes() == path.read_bytes()
    path.write_text(path.read_text() + "\n")
    assert profile_cache.keep_aside(str(path), KEY, "t2")
    assert profile_cache.keep_aside(str(tmp_path / "absent.yaml"), KEY, "t3") is None


@pytest.mark.distributed
def test_the_readme_job_then_calibrate_then_the_job_again_plans_from_the_calibrated_profile(tmp_path):
    """As a user meets it: the README's main job on a cold cache, `calibrate RUN/run-report.json` with no
    --cluster, the same job again: it reuses the calibrated cached profile (no profiling) and plans from it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "home")}
    env.pop(planning.ENV_CACHE_DIR, None)
    env.pop("XDG_CACHE_HOME", None)
    job = [sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2", "--profile",
           "--model", "tiny", "--global-batch", "8", "--seq-len", "64", str(REPO / "examples" / "train_gpt.py"),
           "--steps", "5"]

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=SUBPROCESS_TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    first = run(job)
    assert "[profile rank" in first.stdout + first.stderr
    report = sorted((tmp_path / "tangram-runs").glob("*/run-report.json"))[-1]
    cal = run([sys.executable, "-m", "tangram_launch.cli", "calibrate", str(report), "--tolerance", "0"])
    assert "the next launch with --profile on this machine plans from it" in cal.stdout
    cached = next((tmp_path / "home" / ".cache" / "tangram-launch" / "profiles").glob("*.yaml"))
    second = run(job)
    assert "[profile rank" not in second.stdout + second.stderr  # nothing measured again
    assert "calibrated from 1 run report(s)" in second.stderr
    plan = json.loads(Path(re.search(r"plan written to (\S+)", second.stderr).group(1)).read_text())
    assert plan["cluster"]["hash"] == ClusterSpec.load(cached).content_hash()
    assert plan["cluster"]["hash"] != json.loads(report.read_text())["cluster"]["hash"]


def test_a_straggler_replan_slows_only_the_straggler(tmp_path):
    """The adaptive re-plan's report names only the GPUs that slowed down: their twins keep their figures."""
    from tangram_launch.launch import torchrun as launch
    from tangram_launch.launch.adapt.switch import launcher_replan

    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", str(PROFILED), "--model", "tiny", "--global-batch", "8", "--seq-len", "64",
                 "--dtype", "fp32", "--workers", "1", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    args = launch.build_parser().parse_args(["--cluster", str(PROFILED), "--model", "tiny", "--global-batch", "8",
                                             "--seq-len", "64", "--dtype", "fp32", "train.py"])
    replan = launcher_replan(cluster_path=str(PROFILED), opts=launch.TangramOptions.from_args(args), resume=None,
                             out_dir=str(tmp_path / "adapt"), plan=plan, plan_hash="h" * 64)
    node = ClusterSpec.load(PROFILED).nodes[0]
    candidate = replan({(node.name, 1): 4.0})
    after = ClusterSpec.load(candidate.cluster_path).nodes[0].gpus
    rate = [g.measured["gemm_tflops"]["fp32"] for g in node.gpus]
    assert after[0].measured["gemm_tflops"]["fp32"] == rate[0]
    assert after[1].measured["gemm_tflops"]["fp32"] == pytest.approx(rate[1] / 4.0, rel=1e-3)
