"""Planning at cluster scale (issue 12): one row per cluster and runtime, CPU seconds including worker processes.

    python benchmarks/bench_planner_scale.py                       # every row, 600 s per row at most
    python benchmarks/bench_planner_scale.py --only opt350m-128gpu --timeout 60
    python benchmarks/bench_planner_scale.py --workers 1           # queries in the planning process
    python benchmarks/bench_planner_scale.py --against /tmp/old --rounds 2 --only opt350m-128gpu
                                           # new / old CPU seconds against another checkout, runs alternating

Each row runs in its own process (so its peak memory is its own): it builds the islands (timed apart: islands.py is
not the planner), then plans with the megatron parallelizer and reports the planning CPU seconds of the process and
its worker processes, the peak resident memory (the larger of the process's and its largest worker's), the
predicted iteration time and the GPUs the plan uses. A row is stopped after ``--timeout`` CPU seconds (RLIMIT_CPU;
with ``--workers 1`` that is all of its planning) and says so.

``--against TREE``: each row runs this tree's and TREE's planner (TREE's own copy of this script, which puts TREE
first on the path) in turn, ``--rounds`` times, alternating which goes first, and reports the medians of their
planning CPU seconds and the ratio: on a machine shared with other jobs only such alternating runs compare.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from bench_planner_common import cluster_path, run_child

# (cluster file, model, global batch, seq len, dtype, target CPU seconds): issue 12's table
CASES = (
    ("c3-full-het-iii", "gpt3-13b", 128, 2048, "fp16", 1.0),
    ("c3-4-islands-20gpu", "gpt3-13b", 128, 2048, "fp16", 1.0),
    ("opt350m-128gpu", "opt-350m", 1024, 2048, "fp32", 1.0),
    ("opt350m-320gpu", "opt-350m", 1024, 2048, "fp32", 3.0),
    ("opt350m-512gpu", "opt-350m", 1024, 2048, "fp32", 3.0),
    ("llama3-405b-256gpu", "llama3-405b", 1024, 8192, "bf16", 5.0),
    ("llama3-405b-4096gpu", "llama3-405b", 1024, 8192, "bf16", 30.0),
)
RUNTIMES = ("torch", "deepspeed", "megatron")


def _cpu_s(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def one(cluster_name: str, model_name: str, global_batch: int, seq_len: int, dtype: str, runtime: str,
        workers: int | None) -> dict:
    from tangram_launch.errors import InfeasibleError
    from tangram_launch.islands import build_islands
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    cluster = ClusterSpec.load(cluster_path(cluster_name))
    model = load_model(model_name)
    training = TrainingSpec(global_batch=global_batch, seq_len=seq_len, dtype=dtype)
    c0 = _cpu_s(resource.RUSAGE_SELF)
    islands = build_islands(cluster, dtype=dtype)
    islands_s = _cpu_s(resource.RUSAGE_SELF) - c0
    c0 = _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = {"gpus": cluster.num_gpus, "islands": len(islands.islands), "islands_cpu_s": islands_s}
    try:
        r = search(cluster, model, training, runtime=runtime, islands=islands,
                   options=PlannerOptions(max_workers=workers, progress=False))
        plan = r.plan
        out.update(predicted_s=plan.predicted.iteration_time_s, gpus_used=sum(s.num_gpus for s in plan.stages),
                   b=plan.planner["b"], stages=len(plan.stages))
    except InfeasibleError as exc:
        out.update(infeasible=str(exc))
    out["cpu_s"] = _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN) - c0
    out["wall_s"] = time.perf_counter() - t0
    peak_kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                   resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    out["peak_mib"] = peak_kib / 1024.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="cluster names to run (default: all)")
    ap.add_argument("--runtimes", nargs="*", default=list(RUNTIMES))
    ap.add_argument("--timeout", type=float, default=600.0, help="CPU seconds per row (its process is stopped then)")
    ap.add_argument("--workers", type=int, default=None, help="query worker processes (default: the planner's)")
    ap.add_argument("--against", help="another checkout's root: alternate its runs with this tree's per row")
    ap.add_argument("--rounds", type=int, default=2, help="with --against: runs of each tree per row")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        c, m, g, s, d, rt = json.loads(args.child)
        limit = int(args.timeout)  # CPU seconds: a busy machine does not cut a row short
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))
        print(json.dumps(one(c, m, g, s, d, rt, args.workers)))
        return
    if args.against:
        compare(args)
        return
    print("| cluster | model | runtime | GPUs | islands | planning CPU s (target) | peak MiB | islands CPU s "
          "| predicted iteration s | GPUs used | b |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c, m, g, s, d, target in CASES:
        if args.only and c not in args.only:
            continue
        for rt in args.runtimes:
            child = [__file__, "--child", json.dumps([c, m, g, s, d, rt]), "--timeout", str(args.timeout)]
            if args.workers is not None:
                child += ["--workers", str(args.workers)]
            r = run_child(child, 20 * args.timeout)
            if "error" in r:
                print(f"| {c} | {m} | {rt} | | | stopped after {args.timeout:g} CPU-s: {r['error']} (target "
                      f"{target:g}) | | | | | |")
            else:
                pred = f"{r['predicted_s']:.3f}" if "predicted_s" in r else f"infeasible: {r['infeasible'][:60]}"
                print(f"| {c} | {m} | {rt} | {r['gpus']} | {r['islands']} | {r['cpu_s']:.2f} ({target:g}) | "
                      f"{r['peak_mib']:.0f} | {r['islands_cpu_s']:.2f} | {pred} | {r.get('gpus_used', '')} | "
                      f"{r.get('b', '')} |")
            sys.stdout.flush()


def _child_args(script: str, case: list, args: argparse.Namespace) -> list[str]:
    child = [script, "--child", json.dumps(case), "--timeout", str(args.timeout)]
    return child + (["--workers", str(args.workers)] if args.workers is not None else [])


def compare(args: argparse.Namespace) -> None:
    """--against: per row, this tree's and the other's planning CPU seconds, alternating, and their medians."""
    trees = {"new": __file__, "old": os.path.join(os.path.abspath(args.against), "benchmarks",
                                                   os.path.basename(__file__))}
    print("| cluster | runtime | old CPU s | new CPU s | new / old | old predicted s (b) | new predicted s (b) |")
    print("|---|---|---|---|---|---|---|")
    for c, m, g, s, d, _target in CASES:
        if args.only and c not in args.only:
            continue
        for rt in args.runtimes:
            cpu: dict[str, list[float]] = {"old": [], "new": []}
            plan: dict[str, str] = {}
            for r in range(args.rounds):
                for who in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    out = run_child(_child_args(trees[who], [c, m, g, s, d, rt], args), 20 * args.timeout)
                    if "error" in out:
                        plan[who] = f"error: {out['error']}"
                        continue
                    cpu[who].append(out["cpu_s"])
                    plan[who] = (f"{out['predicted_s']:.3f} ({out['b']})" if "predicted_s" in out
                                 else "infeasible")
            old, new = (statistics.median(cpu[w]) if cpu[w] else float("nan") for w in ("old", "new"))
            print(f"| {c} | {rt} | {old:.2f} | {new:.2f} | {new / old:.2f} | {plan.get('old', '')} | "
                  f"{plan.get('new', '')} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
