"""The cost of lifting the GPU-count restriction: planning with ``--gpu-counts all`` against the default (tiling).

    python benchmarks/bench_gpu_counts.py                                 # the three small rows, torch and megatron
    python benchmarks/bench_gpu_counts.py --only c3-4-islands-20gpu --runtimes torch --rounds 1

By default the megatron parallelizer offers a slice powers of two within a node and whole nodes, so its stages tile
the island's nodes; ``gpu_counts="all"`` offers every GPU count whose stages can be placed
(parallelizers/megatron.py: stages_placeable). Per row (bench_planner_scale.py's small clusters), each option is
planned in its own process, ``--rounds`` times, alternating which goes first (on a shared machine only alternating
runs compare); the table gives the median planning CPU seconds (the process and its workers) of each, their ratio,
and the predicted iteration time of each plan (the lifted space holds the default's; tests/test_gpu_counts.py checks
its plan is no slower on generated clusters).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys

from bench_planner_common import cluster_path, run_child
from bench_planner_scale import CASES, _cpu_s

SMALL = ("c3-full-het-iii", "c3-4-islands-20gpu", "opt350m-128gpu")


def one(case: list, gpu_counts: str) -> dict:
    """Plan one row under one option: planning CPU seconds and the predicted iteration time."""
    from tangram_launch.errors import InfeasibleError
    from tangram_launch.islands import build_islands
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    cluster_name, model_name, global_batch, seq_len, dtype, runtime = case
    cluster = ClusterSpec.load(cluster_path(cluster_name))
    training = TrainingSpec(global_batch=global_batch, seq_len=seq_len, dtype=dtype)
    islands = build_islands(cluster, dtype=dtype)  # not the planner: outside the timed part
    c0 = _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN)
    out: dict = {}
    try:
        plan = search(cluster, load_model(model_name), training, runtime=runtime, islands=islands,
                      options=PlannerOptions(progress=False, gpu_counts=gpu_counts)).plan
        out.update(predicted_s=plan.predicted.iteration_time_s, b=plan.planner["b"],
                   gpus=[s.num_gpus for s in plan.stages])
    except InfeasibleError as exc:
        out["infeasible"] = str(exc)
    out["cpu_s"] = _cpu_s(resource.RUSAGE_SELF) + _cpu_s(resource.RUSAGE_CHILDREN) - c0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="cluster names to run (default: the three small rows)")
    ap.add_argument("--runtimes", nargs="*", default=["torch", "megatron"])
    ap.add_argument("--rounds", type=int, default=2, help="runs of each option per row")
    ap.add_argument("--timeout", type=float, default=600.0, help="CPU seconds per run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        case, gpu_counts = json.loads(args.child)
        limit = int(args.timeout)
        resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 5))
        print(json.dumps(one(case, gpu_counts)))
        return
    print("| cluster | runtime | default CPU s | lifted CPU s | lifted / default | default plan s | lifted plan s |")
    print("|---|---|---|---|---|---|---|")
    for c, m, g, s, d, _target in CASES:
        if c not in (args.only or SMALL):
            continue
        for rt in args.runtimes:
            (base, base_plan), (lifted, lifted_plan) = map(_cell, _alternating([c, m, g, s, d, rt], args))
            print(f"| {c} | {rt} | {base:.2f} | {lifted:.2f} | {lifted / base:.2f} | {base_plan} | {lifted_plan} |")
            sys.stdout.flush()


def _alternating(case: list, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The default's and the lifted option's runs of one row, alternating which goes first."""
    runs: dict[str, list[dict]] = {"tiling": [], "all": []}
    for r in range(args.rounds):
        for option in ("tiling", "all")[::1 if r % 2 == 0 else -1]:
            runs[option].append(run_child([__file__, "--child", json.dumps([case, option]), "--timeout",
                                           str(args.timeout)], 20 * args.timeout))
    return runs["tiling"], runs["all"]


def _cell(runs: list[dict]) -> tuple[float, str]:
    """(median planning CPU seconds, the plan: predicted iteration, micro-batch size, GPUs per stage)."""
    done = [r for r in runs if "error" not in r]
    if not done:
        return float("nan"), f"error: {runs[-1]['error']}"
    last = done[-1]
    plan = (f"{last['predicted_s']:.3f} (b {last['b']}, GPUs {'+'.join(map(str, last['gpus']))})"
            if "predicted_s" in last else "infeasible")
    return statistics.median(r["cpu_s"] for r in done), plan

if __name__ == "__main__":
    main()
