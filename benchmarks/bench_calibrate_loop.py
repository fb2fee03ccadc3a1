"""The README's main job, `calibrate`, and the job again: how far the prediction moves towards the measurement.

    python benchmarks/bench_calibrate_loop.py [--rounds 3] [--steps 5]

Each round starts from an empty ``HOME`` (no cached profile) in a temporary directory and runs, as a user would:

    tangram-launch --standalone --nproc-per-node 2 --profile --model tiny --global-batch 8 --seq-len 64 \\
        examples/train_gpt.py --steps 5
    tangram-launch calibrate tangram-runs/<run>/run-report.json
    (the same launch again: it reuses the calibrated cached profile)

and prints, for each of the two launches, the plan's stages (layers, micro-batch size) and the run report's
measured / predicted per stage, for the iteration, and for the iteration's parts (pipeline, sync, optimizer step;
``iteration.parts`` of the report). Output:

    round 1: first  stages 0-3 mbs 4   meas/pred stages 1.05  iteration 1.35 (pipeline 1.19 sync 1.89 optimizer 1.28)
             second stages 0-3 mbs 4   meas/pred stages 0.91  iteration 1.15 (pipeline 0.96 sync 2.17 optimizer 1.25)
    ...
    median |log meas/pred| over stages: first 0.05 (1.1x), second 0.04 (1.04x)
    median meas/pred of the iteration's parts (both launches): pipeline 1.08, sync 1.90, optimizer 1.25
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tangram_launch.launch.run_report import PART_NAMES, iteration_parts  # noqa: E402


def _launch(home: Path, cwd: Path, steps: int) -> dict:
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"}
    for key in ("TANGRAM_CACHE_DIR", "XDG_CACHE_HOME"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2", "--profile",
           "--model", "tiny", "--global-batch", "8", "--seq-len", "64", str(REPO / "examples" / "train_gpt.py"),
           "--steps", str(steps)]
    before = set((cwd / "tangram-runs").glob("*")) if (cwd / "tangram-runs").exists() else set()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"launch failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    run = sorted(set((cwd / "tangram-runs").glob("*")) - before)[-1]
    report = json.loads((run / "run-report.json").read_text())
    plan_path = [line.split("plan written to ", 1)[1].split(" ", 1)[0] for line in done.stderr.splitlines()
                 if "plan written to " in line][0]
    return {"report": report, "report_path": str(run / "run-report.json"), "env": env,
            "plan": json.loads(Path(plan_path).read_text())}


def _describe(run: dict) -> str:
    stages = " | ".join(f"{s['layers'][0]}-{s['layers'][1] - 1} mbs {s.get('micro_batch_size', '?')}"
                        for s in run["plan"]["stages"])
    ratios = " ".join(f"{s['ratio']:.2f}" for s in run["report"]["stages"] if s.get("ratio"))
    it = run["report"]["iteration"]
    iteration = it["measured_median_s"] / it["predicted_s"] if it.get("measured_median_s") else float("nan")
    parts = " ".join(f"{k} {v:.2f}" for k, v in _part_ratios(run).items())
    return f"stages {stages}   meas/pred stages {ratios}  iteration {iteration:.2f} ({parts})"


def _part_ratios(run: dict) -> dict[str, float]:
    """Measured / predicted of each part of the iteration (the report's ``iteration.parts``)."""
    return {name: meas / pred for name, (pred, meas) in iteration_parts(run["report"]["iteration"]).items()
            if meas is not None and pred}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    logs: dict[str, list[float]] = {"first": [], "second": []}
    part_ratios: dict[str, list[float]] = {k: [] for k in PART_NAMES}
    for r in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory(prefix="tangram-calibrate-loop-") as tmp:
            home, cwd = Path(tmp) / "home", Path(tmp) / "work"
            home.mkdir()
            cwd.mkdir()
            first = _launch(home, cwd, args.steps)
            cal = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "calibrate", first["report_path"]],
                                 cwd=cwd, env=first["env"], capture_output=True, text=True, timeout=300)
            if cal.returncode != 0:
                raise SystemExit(f"calibrate failed (exit {cal.returncode}):\n{cal.stderr[-3000:]}")
            second = _launch(home, cwd, args.steps)
        for name, run in (("first", first), ("second", second)):
            logs[name] += [abs(math.log(s["ratio"])) for s in run["report"]["stages"] if s.get("ratio")]
            for k, v in _part_ratios(run).items():
                part_ratios[k].append(v)
        print(f"round {r}: first  {_describe(first)}", flush=True)
        print(f"         second {_describe(second)}", flush=True)
    med = {k: statistics.median(v) for k, v in logs.items()}
    print(f"median |log meas/pred| over stages: first {med['first']:.2f} ({math.exp(med['first']):.1f}x), "
          f"second {med['second']:.2f} ({math.exp(med['second']):.2f}x)")
    print("median meas/pred of the iteration's parts (both launches): "
          + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in part_ratios.items() if v))


if __name__ == "__main__":
    main()
