"""The launcher's side of adapting, in-process (unit tier): the switch request, the watcher, the report command."""
from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

from tangram_launch.cli import main
from tangram_launch.errors import SpecError
from tangram_launch.launch.adapt import handshake
from tangram_launch.launch.adapt.decide import Candidate, Controller, Policy
from tangram_launch.launch.adapt.detect import DetectConfig
from tangram_launch.launch.adapt.history import History
from tangram_launch.launch.adapt.switch import SwitchCosts, Watcher, check_adapt_options

from test_adapt_decide import GPUS, pipeline_plan, replan, timing_lines


def _write_timings(run_dir, plan, steps, slow_from=None):
    os.makedirs(os.path.join(run_dir, "timings"), exist_ok=True)
    for step in steps:
        speed = {g: (3.0 if slow_from is not None and step >= slow_from and g == GPUS[1] else 1.0) for g in GPUS}
        for line in timing_lines(plan, step, speed, [1.0] * len(GPUS), 1.5):
            with open(os.path.join(run_dir, "timings", f"rank{line['rank']}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")


def _watcher(tmp_path, acting=True, start_step=0):
    plan = pipeline_plan({g: 1.0 for g in GPUS})
    controller = Controller(plan=plan, plan_hash="old", replan=replan,
                            policy=Policy(DetectConfig(window_steps=6), horizon_steps=1000))
    segment = {"index": 0, "start_step": start_step, "started_unix_s": time.time(), "stopped_unix_s": None}
    history = History(str(tmp_path))
    history.segments.append(segment)
    return plan, Watcher(run_dir=str(tmp_path), controller=controller, acting=acting, costs=SwitchCosts(),
                         history=history, segment=segment)


def test_a_straggler_makes_the_watcher_ask_for_a_checkpoint_ahead_of_every_rank(tmp_path):
    plan, watcher = _watcher(tmp_path, start_step=40)
    _write_timings(str(tmp_path), plan, range(1, 9))
    watcher.poll()  # the baseline window
    assert watcher.pending is None and watcher.controller.baseline_step_s is not None
    _write_timings(str(tmp_path), plan, range(9, 20), slow_from=10)
    watcher.poll()
    assert watcher.pending is not None
    at = handshake.SwitchWatch({handshake.ENV_RUN_DIR: str(tmp_path)}).at_step()
    assert at == watcher.pending.at_step and at > 40 + 19  # absolute, and ahead of the last step timed
    entry = watcher.history.adaptations[0]
    assert entry["switch"] and entry["at_step"] == at and "(n:1," in entry["cause"]
    new = watcher.pending.decision.new_plan  # the report says where the switch puts the layers
    names = [[f"{g['node']}:{g['local_gpu']}" for g in st["gpus"]] for st in new["stages"]]
    assert entry["new_stages"] == [{"layers": st["layers"], "gpus": n} for st, n in zip(new["stages"], names)]
    assert entry["new_stages"][1]["gpus"] == ["n:1"]
    saved = json.loads((tmp_path / "adapt" / "history.json").read_text())
    assert saved["adaptations"][0]["new_plan_hash"] == entry["new_plan_hash"]


@pytest.mark.parametrize("steps_total, switches", [(40 + 19 + 2, False), (40 + 19 + 3, True)])
def test_no_switch_whose_restart_would_train_no_step(tmp_path, caplog, steps_total, switches):
    """A switch lands 2 steps past the last one timed (1 s ahead at 1.5 s a step): with the script's last step at or
    before it, the restart would train nothing, whatever the horizon says."""
    plan, watcher = _watcher(tmp_path, start_step=40)
    handshake.SwitchWatch({handshake.ENV_RUN_DIR: str(tmp_path)}).announce_steps(steps_total)
    _write_timings(str(tmp_path), plan, range(1, 9))
    watcher.poll()
    _write_timings(str(tmp_path), plan, range(9, 20), slow_from=10)
    with caplog.at_level("INFO"):
        watcher.poll()
    entry = watcher.history.adaptations[0]
    assert (watcher.pending is not None) == switches == entry["switch"]
    assert (tmp_path / "adapt" / handshake.REQUEST_NAME).exists() == switches
    if not switches:
        assert f"the run ends at step {steps_total}" in entry["reason"] and "kept the plan" in caplog.text


def test_without_adapt_the_watcher_only_logs_what_it_would_do(tmp_path, caplog):
    plan, watcher = _watcher(tmp_path, acting=False)
    _write_timings(str(tmp_path), plan, range(1, 9))
    watcher.poll()
    _write_timings(str(tmp_path), plan, range(9, 20), slow_from=10)
    with caplog.at_level("INFO"):
        watcher.poll()
    assert watcher.pending is None and not (tmp_path / "adapt" / handshake.REQUEST_NAME).exists()
    assert "would switch" in caplog.text and "no --adapt" in caplog.text


def test_a_request_names_one_step_and_the_worker_stops_only_there(tmp_path):
    watch = handshake.SwitchWatch({handshake.ENV_RUN_DIR: str(tmp_path)})
    assert not watch.stop_at(5)
    handshake.write_request(str(tmp_path), 7, plan_hash="abc")
    assert [s for s in range(1, 12) if watch.stop_at(s)] == [7]
    handshake.clear_request(str(tmp_path))
    assert watch.at_step() is None
    assert handshake.request_in_time(6, 7) and not handshake.request_in_time(7, 7)


def test_the_switch_cost_is_what_the_run_measured(tmp_path):
    costs = SwitchCosts()
    assert costs.estimate(str(tmp_path)) == 0.0
    costs.startup_s.append(4.0)
    watch = handshake.SwitchWatch({handshake.ENV_RUN_DIR: str(tmp_path)})
    for s in (1.0, 3.0, 2.0):
        watch.record_save(10, s)
    assert costs.estimate(str(tmp_path)) == pytest.approx(2 * 4.0 + 2 * 2.0)  # start-ups, a save and its load
    costs.downtime_s.append(9.5)
    assert costs.estimate(str(tmp_path)) == 9.5  # once a switch was measured, its downtime


@pytest.mark.parametrize("given, field", [({"cluster": None}, "--adapt"), ({"checkpoint_dir": None}, "--adapt")])
def test_adapt_refuses_a_launch_it_cannot_switch(given, field):
    opts = SimpleNamespace(**{"adapt": True, "cluster": "c.yaml", "checkpoint_dir": "ck", "resume": None, **given})
    with pytest.raises(SpecError) as err:
        check_adapt_options(opts, single_node=True)
    assert err.value.field == field
    with pytest.raises(SpecError, match="one node"):
        check_adapt_options(SimpleNamespace(adapt=True, cluster="c", checkpoint_dir="ck", resume=None),
                            single_node=False)


def _history_report():
    return {"segments": [{"plan_hash": "a" * 64, "started_unix_s": 0.0, "first_step_unix_s": 5.0,
                          "ended_unix_s": 60.0},
                         {"plan_hash": "b" * 64, "started_unix_s": 60.0, "first_step_unix_s": 70.0,
                          "ended_unix_s": 120.0}],
            "adaptations": [{"step": 30, "cause": "straggler: rank 1 (local:1, stage 1) 2.90x its expected time",
                             "switch": True, "switched": True, "acted": True, "reason": "pays",
                             "old_plan_hash": "a" * 64, "new_plan_hash": "b" * 64, "decided_unix_s": 50.0,
                             "predicted_gain_s_per_step": 0.2, "measured_gain_s_per_step": 0.18,
                             "downtime_s": 9.0, "new_stages": [{"layers": [0, 5], "gpus": ["local:0", "local:2"]},
                                                               {"layers": [5, 8], "gpus": ["local:1"]}]}]}


def test_report_prints_the_adaptations_and_a_timeline(tmp_path, capsys):
    (tmp_path / "run-report.json").write_text(json.dumps(_history_report()))
    assert main(["report", str(tmp_path / "run-report.json")]) == 0
    out = capsys.readouterr().out
    assert "switched" in out and "aaaaaaaa -> bbbbbbbb" in out and "0.180" in out and "9.0" in out
    assert "new stages: layers 0-4 on local:0,local:2; layers 5-7 on local:1" in out
    rows = [line for line in out.splitlines() if line.startswith("  plan ")]
    assert len(rows) == 2 and ">" in rows[0] and rows[0].index("#") < rows[1].index("#")


def test_report_refuses_a_file_that_is_not_a_run_report(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps([1, 2]))
    assert main(["report", str(tmp_path / "r.json")]) == 2
    assert "r.json" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--adapt-window", "2"), ("--adapt-threshold", "0"),
                                         ("--adapt-horizon", "-5")])
def test_adapt_settings_out_of_range_are_refused_by_the_parser(flag, value, capsys):
    from tangram_launch.launch.torchrun import LaunchOptions

    with pytest.raises(SystemExit) as done:
        LaunchOptions.from_argv(["--standalone", "--adapt", flag, value, "train.py"])
    assert done.value.code == 2 and flag in capsys.readouterr().err
