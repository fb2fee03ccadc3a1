"""Start-up overhead of tangram-launch against plain torchrun (DESIGN.md: "Launch overhead against torchrun").

Wall time from starting the launcher to its exit, for a payload that does nothing, 2 ranks, one node:

    /work/venv/bin/python benchmarks/bench_launch_overhead.py            # 5 interleaved repetitions each
    /work/venv/bin/python benchmarks/bench_launch_overhead.py --reps 9 --payload torch

Variants: ``torchrun`` (python -m torch.distributed.run), ``tangram`` (python -m tangram_launch.launch, no
Tangram option: torchrun's code path plus our parser and failure summary), ``tangram+plan`` (the same with
``--plan`` of a cached plan file: plan read and checked, copy written, workers started through
tangram_launch.launch.boot).  Repetitions are interleaved (A B C A B C ...) so load drift on a shared machine hits all
variants alike; medians, minima and ratios against torchrun are printed (on a busy machine the minimum is the
steadier figure).  A second table isolates the per-worker cost of tangram_launch.launch.boot: ``python -u -m
tangram_launch.launch.boot ... -- payload.py`` against ``python -u payload.py``, with a worker's torchrun environment.  ``--payload torch`` makes the script import
torch, as every real training script does (boot's own cost is then measured against a realistic start).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PAYLOADS = {"empty": "", "torch": "import torch\n"}


def _plan(nproc: int) -> dict:
    """A cached 1-node plan with a remapped layout (rank r on local GPU nproc-1-r)."""
    return {"rank_layout": [{"rank": r, "node": "bench", "local_gpu": nproc - 1 - r, "stage": r}
                            for r in range(nproc)]}


def _time_once(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return elapsed


def _boot_variants(script: str, plan: str, nproc: int) -> tuple[dict[str, list[str]], dict[str, str]]:
    """One worker started directly and through boot (single agent: no store check, as on one node)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tangram_launch.worker import sha256_bytes

    with open(plan, "rb") as f:
        digest = sha256_bytes(f.read())
    worker_env = {"RANK": "0", "ROLE_RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(nproc),
                  "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0"}
    boot = [sys.executable, "-u", "-m", "tangram_launch.launch.boot", "--plan-file", plan, "--plan-hash", digest,
            "--node", "bench", "--agent-id", "bench:0", "--", script]
    return {"python": [sys.executable, "-u", script], "boot": boot}, worker_env


def _report(title: str, times: dict[str, list[float]], base_name: str) -> None:
    base_med, base_min = statistics.median(times[base_name]), min(times[base_name])
    print(title)
    print(f"{'variant':<14} {'median_s':>9} {'min_s':>7} {'max_s':>7} {'ratio_med':>9} {'ratio_min':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<14} {med:9.3f} {min(ts):7.3f} {max(ts):7.3f} {med / base_med:9.3f} {min(ts) / base_min:9.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--payload", choices=sorted(PAYLOADS), default="empty")
    args = parser.parse_args()

    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        script = os.path.join(tmp, "payload.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(PAYLOADS[args.payload])
        plan = os.path.join(tmp, "plan.json")
        with open(plan, "w", encoding="utf-8") as f:
            json.dump(_plan(args.nproc), f)
        common = ["--standalone", "--nproc-per-node", str(args.nproc)]
        variants = {
            "torchrun": [sys.executable, "-m", "torch.distributed.run", *common, script],
            "tangram": [sys.executable, "-m", "tangram_launch.launch", *common, script],
            "tangram+plan": [sys.executable, "-m", "tangram_launch.launch", *common, "--plan", plan, script],
        }
        for cmd in variants.values():  # warm the page cache (first torch import reads ~1 GB of files)
            _time_once(cmd, env)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.reps):
            for name, cmd in variants.items():
                times[name].append(_time_once(cmd, env))
        workers, worker_env = _boot_variants(script, plan, args.nproc)
        boot_times: dict[str, list[float]] = {name: [] for name in workers}
        for _ in range(args.reps):
            for name, cmd in workers.items():
                boot_times[name].append(_time_once(cmd, {**env, **worker_env}))

    _report(f"launch wall time, {args.nproc} ranks, payload={args.payload}, {args.reps} interleaved repetitions",
            times, "torchrun")
    _report("one worker's start-up, direct vs through tangram_launch.launch.boot", boot_times, "python")


if __name__ == "__main__":
    main()
