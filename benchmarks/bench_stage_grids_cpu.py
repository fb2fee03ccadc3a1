"""Per-stage grids on an emulated heterogeneous CPU host: two throttled workers and one fast worker, measured.

    sudo python benchmarks/bench_stage_grids_cpu.py [--quota 0.33] [--steps 8] [--warmup-steps 2] [--rounds 1]
        [--model examples/models/bench-cpu.yaml] [--global-batch 16] [--micro-batch 2] [--seq-len 256] [--keep DIR]

Three CPU processes are the "devices": local ranks 0 and 1 each in a cgroup-v1 ``cpu`` group with ``--quota`` of a
core (both pinned to the second CPU: 2 x quota of it), local rank 2 unthrottled on the first CPU. The helpers of
``benchmarks/bench_hetero_cpu.py`` make the groups, pin and measure the host's other load.

1. Profile for real, twice (``tangram-launch profile --nproc-per-node 3 --model M --layer-dtype fp32``, each
   worker moved into its group and pinned as soon as it appears, seconds before it measures): at ``--micro-batch``
   and at half of it, since a stage with dp = 2 runs half a micro-batch per replica; the layer times of the second
   profile join the first's, so the cost model reads measured layer times for every stage.
2. Plan twice with the torch runtime: Tangram's search (stages may have their own TP/DP sizes) and the same search
   restricted to one TP and one DP size (the one-grid plan the runtime needed before per-stage grids).
3. Train both with examples/train_gpt.py (per-stage grids run on runtime_adapters/schedule.py), each rank in its
   device's group, and print measured and predicted iteration times.

Needs root and a writable cgroup-v1 ``cpu`` controller; without it the benchmark says why and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_hetero_cpu as base  # noqa: E402  (the cgroup, pinning and load helpers)

REPO = base.REPO
SLOW_RANKS = (0, 1)  # local ranks of the throttled devices; local rank 2 is the fast one


def _place(pid: int, group: str, core: int | None) -> None:
    with open(os.path.join(group, "cgroup.procs"), "w") as f:
        f.write(str(pid))  # moves every thread of the process
    if core is not None:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {core})


def profile(args, micro_batch: int, groups: dict[int, str], cores: dict[int, int] | None, out: str) -> None:
    """The profile command with each worker moved into its group (and pinned) as soon as it appears."""
    cmd = [sys.executable, "-m", "tangram_launch.cli", "profile", "--standalone", "--nproc-per-node", "3",
           "--model", args.model, "--seq-len", str(args.seq_len), "--micro-batch", str(micro_batch),
           "--layer-dtype", "fp32", "--timeout-s", "300", "-o", out]
    proc = subprocess.Popen(cmd, cwd=REPO, env=base._env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    placed: set[int] = set()

    def poll(done: threading.Event) -> None:
        while not done.is_set() and len(placed) < 3:
            for pid in base._descendants(proc.pid):
                rank = base._local_rank(pid)
                if rank is not None and rank < 3 and pid not in placed:
                    try:
                        _place(pid, groups[rank], cores[rank] if cores else None)
                        placed.add(pid)
                    except OSError:
                        continue
            done.wait(0.02)
    base.wait_watched(proc, poll, args.timeout_s, "profile")


def merge_layer_times(into: str, other: str) -> None:
    """Add ``other``'s measured layer times (another micro-batch) to ``into``'s devices, same node and order."""
    import yaml

    with open(into) as f:
        a = yaml.safe_load(f)
    with open(other) as f:
        b = yaml.safe_load(f)
    for na, nb in zip(a["nodes"], b["nodes"]):
        for ga, gb in zip(na["gpus"], nb["gpus"]):
            for key in ("layer_forward_s", "layer_forward_backward_s"):
                ga["measured"].setdefault(key, {}).update(gb["measured"].get(key) or {})
    with open(into, "w") as f:
        yaml.safe_dump(a, f, sort_keys=False)


def plans(args, cluster_path: str):
    from tangram_launch.capabilities import TORCH
    from tangram_launch.planner import PlannerOptions, make_plan
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    cluster = ClusterSpec.load(cluster_path)
    model = load_model(args.model)
    training = TrainingSpec(global_batch=args.global_batch, seq_len=args.seq_len, dtype="fp32", optimizer="adamw",
                            grad_dtype="fp32")
    opts = PlannerOptions(microbatch_sequences=(args.micro_batch,), max_workers=1, progress=False, schedule="1F1B")
    caps = dataclasses.replace(TORCH, tensor_parallel=args.tp, max_zero_stage=args.max_zero,
                               max_zero_stage_with_pp=args.max_zero)
    grids = make_plan(cluster, model, training, runtime=caps, options=opts)
    one = make_plan(cluster, model, training, options=opts,
                    runtime=dataclasses.replace(caps, uniform_tp=True, uniform_dp=True))
    return grids, one


def train(args, plan, groups: dict[int, str], cores: dict[int, int] | None, workdir: str, name: str) -> dict:
    return base.run_plan_workers(args, plan, workdir, name,
                                 lambda entry: base._join(groups[entry.local_gpu],
                                                          cores[entry.local_gpu] if cores else None))


def describe(plan) -> str:
    return " + ".join(f"{s.layers[1] - s.layers[0]}L@{s.island}(tp{s.tp},dp{s.dp},mbs{s.micro_batch_size})"
                      for s in plan.stages)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quota", type=float, default=0.33, help="CPU share of each slow device, of one core")
    p.add_argument("--period-us", type=int, default=100_000)
    p.add_argument("--model", default=base.DEFAULT_MODEL)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch (even: dp=2 halves it)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="alternate the two runs this many times")
    p.add_argument("--no-tp", dest="tp", action="store_false",
                   help="plan without tensor parallelism (on throttled CPU workers every TP all-reduce waits for "
                        "both workers' CFS periods)")
    p.add_argument("--max-zero", type=int, default=3, choices=range(4),
                   help="highest ZeRO stage the planner may use (0: gradients by one all-reduce)")
    p.add_argument("--cluster", help="reuse a profile made by this benchmark (both micro-batch sizes)")
    p.add_argument("--keep", metavar="DIR")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.micro_batch % 2 or args.global_batch % args.micro_batch or args.steps <= args.warmup_steps:
        p.error("--micro-batch must be even and divide --global-batch; --steps must exceed --warmup-steps")
    made = []
    for _ in SLOW_RANKS:
        g, why = base.make_groups(args.quota, args.period_us, 262144)
        if g is None:
            for x in made:
                x.remove()
            print(f"bench_stage_grids_cpu: skipped: {why}", file=sys.stderr)
            return 0
        made.append(g)
    groups = {0: made[0].slow, 1: made[1].slow, 2: made[0].bench}
    avail = sorted(os.sched_getaffinity(0))
    cores = {0: avail[1], 1: avail[1], 2: avail[0]} if len(avail) >= 2 else None
    workdir = args.keep or tempfile.mkdtemp(prefix="tangram-bench-grids-")
    os.makedirs(workdir, exist_ok=True)
    figures: dict = {"quota": args.quota, "load_avg": {"start": base.load_avg()}}
    try:
        cluster_path = args.cluster
        if cluster_path is None:
            cluster_path = os.path.join(workdir, "cluster.yaml")
            half = os.path.join(workdir, "cluster-half.yaml")
            t0 = time.perf_counter()
            profile(args, args.micro_batch, groups, cores, cluster_path)
            profile(args, args.micro_batch // 2, groups, cores, half)
            merge_layer_times(cluster_path, half)
            figures["profile_s"] = round(time.perf_counter() - t0, 1)
        grids, one = plans(args, cluster_path)
        runs: dict[str, list[dict]] = {"per-stage grids": [], "one grid": []}
        for r in range(args.rounds):
            for name, plan in (("per-stage grids", grids), ("one grid", one)):
                runs[name].append(train(args, plan, groups, cores, workdir, name.replace(" ", "-")))
                figures["load_avg"][f"after_{name}_{r}"] = base.load_avg()
    except Exception as exc:  # noqa: BLE001 (a benchmark: say what failed, clean up, exit 1)
        print(f"bench_stage_grids_cpu: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        for g in made:
            for problem in g.remove():
                print(f"bench_stage_grids_cpu: {problem}", file=sys.stderr)
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for name, plan in (("per-stage grids", grids), ("one grid", one)):
        measured = statistics.median(x["median_after_warmup_s"] for x in runs[name])
        pred = plan.predicted.iteration_time_s
        figures[name] = {"plan": describe(plan), "measured_s": measured, "predicted_s": pred,
                         "error": pred / measured - 1.0,
                         "other_load_cores": [round(x["other_load_cores"], 2) for x in runs[name]],
                         "loss": [runs[name][-1]["losses"][0], runs[name][-1]["losses"][-1]]}
        print(f"{name:15s} {describe(plan)}\n{'':15s} measured {measured * 1e3:8.1f} ms/iter  predicted "
              f"{pred * 1e3:8.1f} ms  predicted/measured {pred / measured - 1:+.1%}  (other load "
              + ", ".join(f"{x:.2f}" for x in figures[name]["other_load_cores"]) + " cores)")
    g, o = figures["per-stage grids"], figures["one grid"]
    print(f"one grid / per-stage grids: measured {o['measured_s'] / g['measured_s']:.2f}x, predicted "
          f"{o['predicted_s'] / g['predicted_s']:.2f}x; load average {figures['load_avg']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(figures, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
