"""``tangram-launch --adapt`` on three gloo ranks: one is throttled mid-run, the launcher re-plans and the run
continues exactly (distributed tier).

The emulation is benchmarks/bench_adapt_cpu.py's: device 1's worker moved into a cgroup-v1 ``cpu`` group with a
third of a core (without a writable cgroup, stopped and continued for the same duty cycle), the launch in a group
whose cpu.shares keep the host's other work from slowing the devices as much.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_adapt_cpu as bench  # noqa: E402

STEPS, WINDOW, THROTTLE_AFTER_STEP, GLOBAL_BATCH = 70, 10, 14, 6
# a 2-core test machine shared with other jobs: steps of one rank vary by tens of per cent for seconds at a time, so
# the test flags a straggler at 30 % (the default 15 % is for hosts that are not shared)
THRESHOLD = 0.3


def _args() -> argparse.Namespace:
    return argparse.Namespace(model=str(REPO / "examples" / "models" / "bench-cpu.yaml"), global_batch=GLOBAL_BATCH,
                              seq_len=32, save_every=10)


def _latched(run_dir: str, step: int):
    """True from the moment the run's timings reach ``step`` (and ever after: a restarted worker too)."""
    seen = []

    def due() -> bool:
        if not seen:
            from tangram_launch.launch.run_report import read_timings

            if any(t["step"] >= step for t in read_timings(run_dir)):
                seen.append(True)
        return bool(seen)
    return due


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(bench.base._env(), TANGRAM_CACHE_DIR=str(tmp_path / "cache"))


@pytest.mark.distributed
def test_a_throttled_rank_is_replanned_away_and_the_run_continues_exactly(tmp_path):
    (tmp_path / "cpu-3.yaml").write_text(bench.CPU3)
    cluster = ["--cluster", str(tmp_path / "cpu-3.yaml")]
    ref = bench.launcher_argv(_args(), str(tmp_path), "ref", plan_args=cluster, nproc=3, steps=STEPS, extra=[],
                              script_extra=("--out", str(tmp_path / "ref.json")))
    ref = bench.run_launch(ref, window_s=SUBPROCESS_TIMEOUT_S, throttle_at_s=None, quota=1.0, env=_env(tmp_path))
    assert ref.returncode == 0, "".join(ref.output[-60:])

    adapt = bench.launcher_argv(_args(), str(tmp_path), "adapt", plan_args=cluster, nproc=3, steps=STEPS,
                                extra=["--adapt", "--adapt-window", str(WINDOW), "--adapt-threshold", str(THRESHOLD),
                                       "--adapt-horizon", "500"],
                                script_extra=("--out", str(tmp_path / "adapt.json")))
    adapt = bench.run_launch(adapt, window_s=SUBPROCESS_TIMEOUT_S, throttle_at_s=None, quota=0.33,
                             env=_env(tmp_path), throttle_due=_latched(adapt.run_dir, THROTTLE_AFTER_STEP))
    log = "".join(adapt.output[-80:])
    assert adapt.returncode == 0, log
    assert adapt.throttled_at_s is not None, log

    # every step once, in order: nothing lost, nothing trained twice
    printed = [int(m.group(1)) for m in (bench.STEP_LINE.match(x.strip()) for x in adapt.output) if m]
    assert printed == list(range(1, STEPS + 1)), log

    report = json.loads(Path(adapt.run_dir, "run-report.json").read_text())
    switched = [a for a in report["adaptations"] if a["switched"]]
    assert switched, log
    first = switched[0]
    assert "(local:1," in first["cause"], report["adaptations"]  # the throttled device, named
    assert THROTTLE_AFTER_STEP <= first["step"] <= THROTTLE_AFTER_STEP + 2 * WINDOW + 2, report["adaptations"]
    # measured, not judged here: its size is a speed figure (bench_adapt_cpu.py reports it), and on a shared host a
    # few noisy steps after the switch can outweigh it
    assert first["downtime_s"] is not None and first["measured_gain_s_per_step"] is not None, first
    assert len(report["segments"]) == len(switched) + 1

    # the plan the throttle switched to, as the report records it: device 1 left out or given fewer layers than under
    # the plan it started with, the reference run's (not fewer than each fast device: the last stage's GPU also runs
    # the head and the loss); a later switch answers a noise window at this threshold, whatever it measured then
    before = json.loads(Path(tmp_path, "ckpt-ref", f"step_{STEPS}", "plan.json").read_text())
    width = {gpu: st["layers"][1] - st["layers"][0] for st in first["new_stages"] for gpu in st["gpus"]}
    width_before = {f"{g['node']}:{g['local_gpu']}": st["layers"][1] - st["layers"][0]
                    for st in before["stages"] for g in st["gpus"]}
    assert "local:1" not in width or width["local:1"] < width_before["local:1"], (first, before["stages"])
    final = json.loads(Path(tmp_path, "ckpt-adapt", f"step_{STEPS}", "plan.json").read_text())
    if len(switched) == 1:  # and the run's last checkpoint is under that plan
        assert [st["layers"] for st in final["stages"]] == [st["layers"] for st in first["new_stages"]]

    # the losses after the switch are the uninterrupted run's on the same samples: the first one as tightly as a
    # resume under another layout is (tests/test_resume.py); later ones drift by float reassociation only (another
    # split into micro-batches and stages sums in another order, and AdamW carries it on)
    a, r = (json.loads(Path(tmp_path, f"{n}.json").read_text()) for n in ("adapt", "ref"))
    start = a["steps"][0]
    assert start == first["at_step"] + 1 or len(switched) > 1
    assert a["steps"] == list(range(start, STEPS + 1))
    if start == first["at_step"] + 1:  # the last segment is the first switch's: it resumed the reference's weights
        assert a["losses"][0] == pytest.approx(r["losses"][start - 1], rel=1e-5, abs=1e-6)
    # after a later switch (a noise window at this threshold), the weights it resumed had drifted since the first
    assert a["losses"] == pytest.approx(r["losses"][start - 1:], rel=3e-4)
    assert a["consumed_samples"] == r["consumed_samples"] == STEPS * GLOBAL_BATCH
    # and before it, as printed (4 decimals)
    ref_printed = {int(m.group(1)): float(m.group(2)) for m in (bench.STEP_LINE.match(x.strip()) for x in ref.output)
                   if m}
    assert all(abs(adapt.steps[s][1] - ref_printed[s]) <= 1e-4 for s in range(1, start)), log
