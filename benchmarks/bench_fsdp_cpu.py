"""The README's main job under each ZeRO stage: what FSDP2's measured overhead does to the prediction.

    python benchmarks/bench_fsdp_cpu.py [--runs 2] [--steps 8] [--without fsdp|collectives] [--json FILE]

The torch runtime runs ZeRO 1-3 as FSDP2 units. One profile of 2 CPU processes (``tangram-launch profile --model
tiny``, which times the FSDP2 probe of profiler/fsdp_unit.py), then for ZeRO 0, 1 and 3 the hand-written plan
``{layers: [0, 4], island: cpu, dp: 2, zero_stage: Z}`` at global batch 8 x 64 tokens, in bf16:

- costed from the profile without its FSDP2 figures (``tangram-launch plan --plan``): the model before them
  (``--without collectives``: without the reduce-scatter's and all-gather's own bus bandwidths instead, so every
  collective is priced at the all-reduce's);
- launched from the whole profile (``tangram-launch --cluster ... --plan ... examples/train_gpt.py``), whose run
  report gives the prediction with them and the measurement.

Prints per ZeRO stage and run the stage (forward + backward per micro-batch), the optimizer step and the iteration:
predicted without, predicted with, measured, and measured / predicted for both. Output (abridged):

    profile: FSDP2 fsdp_unit_forward_us {'fp32': 1555.0, 'bf16': 1717.0}, fsdp_unit_backward_us {...}, ...
    zero 3 run 2  stage      pred w/o  18.75  with  34.11  meas  45.87 ms  meas/pred w/o  2.45  with  1.34
                  optimizer  pred w/o   1.84  with  11.04  meas  11.59 ms  meas/pred w/o  6.30  with  1.05
                  iteration  pred w/o  21.28  with  45.85  meas  65.18 ms  meas/pred w/o  3.06  with  1.42
    median meas/pred over runs (without / with the FSDP2 figures):
      zero 3: stage 2.30 / 1.27, optimizer 6.30 / 1.05, iteration 2.90 / 1.35
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tangram_launch.costmodel.efficiency import FSDP_KEYS  # noqa: E402

LEFT_OUT = {"fsdp": FSDP_KEYS, "collectives": ("reduce_scatter_busbw_gbps", "all_gather_busbw_gbps")}

JOB = ["--model", "tiny", "--global-batch", "8", "--seq-len", "64", "--dtype", "bf16"]


def _cli(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "tangram_launch.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} ... failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done


def _without(profile: Path, out: Path, keys: tuple[str, ...]) -> None:
    spec = yaml.safe_load(profile.read_text())
    for node in spec["nodes"]:
        for gpu in node["gpus"]:
            for key in keys:
                gpu.get("measured", {}).pop(key, None)
    out.write_text(yaml.safe_dump(spec, sort_keys=False))


def _figures(stage: dict, iteration_s: float) -> dict:
    return {"stage": stage["forward_s"] + stage["backward_s"], "optimizer": stage.get("optimizer_s", 0.0),
            "iteration": iteration_s}


def _one(zero: int, work: Path, env: dict, steps: int) -> dict:
    plan = work / f"zero{zero}.yaml"
    plan.write_text(yaml.safe_dump({"stages": [{"layers": [0, 4], "island": "cpu", "dp": 2, "zero_stage": zero,
                                                "recompute": "none", "micro_batch_size": 4}]}))
    _cli(["plan", "--cluster", str(work / "without.yaml"), *JOB, "--plan", str(plan), "--format", "json",
          "-o", str(work / f"without-{zero}.json")], env, work)
    old = json.loads((work / f"without-{zero}.json").read_text())["predicted"]
    runs = work / "tangram-runs"
    seen = set(runs.glob("*")) if runs.exists() else set()
    _cli(["--standalone", "--nproc-per-node", "2", "--cluster", str(work / "profile.yaml"), *JOB, "--plan",
          str(plan), str(REPO / "examples" / "train_gpt.py"), "--steps", str(steps)], env, work)
    report = json.loads((sorted(set(runs.glob("*")) - seen)[-1] / "run-report.json").read_text())
    stage, it = report["stages"][0], report["iteration"]
    measured = {"stage": stage["measured"]["forward_s"] + stage["measured"]["backward_s"],
                "optimizer": stage["measured"].get("optimizer_s", float("nan")), "iteration": it["measured_median_s"]}
    new = _figures(stage["predicted"], it["predicted_s"])
    return {"without": _figures(old["stages"][0], old["iteration_time_s"]), "with": new, "measured": measured}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="launches per ZeRO stage (default 2)")
    ap.add_argument("--steps", type=int, default=8, help="training steps per launch (default 8)")
    ap.add_argument("--json", default="", help="also write every figure to this JSON file")
    ap.add_argument("--without", choices=sorted(LEFT_OUT), default="fsdp",
                    help="which profile figures the 'without' prediction leaves out (default fsdp)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fsdp-") as tmp:
        work = Path(tmp)
        (work / "home").mkdir()
        env = {**os.environ, "HOME": str(work / "home"), "OMP_NUM_THREADS": "1"}
        for key in ("TANGRAM_CACHE_DIR", "XDG_CACHE_HOME"):
            env.pop(key, None)
        _cli(["profile", "--standalone", "--nproc-per-node", "2", "--model", "tiny", "--seq-len", "64",
              "-o", str(work / "profile.yaml")], env, work)
        gpu = yaml.safe_load((work / "profile.yaml").read_text())["nodes"][0]["gpus"][0]["measured"]
        print("profile: FSDP2 " + ", ".join(f"{k} {gpu.get(k)}" for k in FSDP_KEYS)
              + f"; optimizer_tensor_us {gpu.get('optimizer_tensor_us')}; bus bandwidth GB/s all-reduce "
              f"{gpu.get('allreduce_busbw_gbps')}, reduce-scatter {gpu.get('reduce_scatter_busbw_gbps')}, "
              f"all-gather {gpu.get('all_gather_busbw_gbps')}", flush=True)
        _without(work / "profile.yaml", work / "without.yaml", LEFT_OUT[args.without])
        rows = []
        for run in range(1, args.runs + 1):
            for zero in (0, 1, 3):
                r = _one(zero, work, env, args.steps)
                rows.append({"zero": zero, "run": run, **r})
                for i, part in enumerate(("stage", "optimizer", "iteration")):
                    w, n, m = r["without"][part] * 1e3, r["with"][part] * 1e3, r["measured"][part] * 1e3
                    head = f"zero {zero} run {run}" if i == 0 else ""
                    print(f"{head:<13} {part:<10} pred w/o {w:6.2f}  with {n:6.2f}  meas {m:6.2f} ms  "
                          f"meas/pred w/o {m / w:5.2f}  with {m / n:5.2f}", flush=True)
    print(f"median meas/pred over runs (without / with the {args.without} figures):")
    for zero in (0, 1, 3):
        mine = [r for r in rows if r["zero"] == zero]
        parts = []
        for part in ("stage", "optimizer", "iteration"):
            w = statistics.median(r["measured"][part] / r["without"][part] for r in mine)
            n = statistics.median(r["measured"][part] / r["with"][part] for r in mine)
            parts.append(f"{part} {w:.2f} / {n:.2f}")
        print(f"  zero {zero}: " + ", ".join(parts))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
