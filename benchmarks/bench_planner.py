"""Planning time: GPT-3 13B on the paper's clusters, and a scaling sweep (1-8 islands, 16-4,096 GPUs, 32-126 layers).

    python benchmarks/bench_planner.py                 # both parts (the sweep takes several minutes)
    python benchmarks/bench_planner.py --part headline # GPT-3 13B on c3-full-het-iii and c3-4-islands-20gpu
    python benchmarks/bench_planner.py --part sweep [--quick]

Headline: the real (megatron) parallelizer, fp16, global batch 128 x 2048 tokens, 2 worker processes (the paper:
12 min for GPT-3 13B on 20 GPUs in 4 islands with Aceso). Sweep: the synthetic parallelizer (per-layer time from
each GPU type's peak), so the figures are the planner's own cost -- pruning, option building, composition -- and
the query count says how many parallelizer calls a real run would add (planning s = queries + compose + the
rest: pruning, Plan building). Each sweep point runs in its own process; peak memory is that process's maximum
resident set. Building the islands (islands.py) is timed apart.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from bench_planner_common import cluster_path, describe_plan, peak_rss_mib, run_child, synthetic_cluster, \
    synthetic_parallelizer


def headline(workers: int) -> None:
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    model = load_model("gpt3-13b")
    training = TrainingSpec(global_batch=128, seq_len=2048, dtype="fp16")
    print("## Planning time, GPT-3 13B (megatron parallelizer, fp16, 128 x 2048 tokens, "
          f"{workers} workers, runtime torch)\n")
    print("| cluster | islands | GPUs | planning s | queries s | compose s | pairs | queries "
          "| pruned (inc/inf/unb/red) | iteration s | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("c3-full-het-iii", "c3-4-islands-20gpu"):
        cluster = ClusterSpec.load(cluster_path(name))
        t0 = time.perf_counter()
        r = search(cluster, model, training, runtime="torch", parallelizer="megatron",
                   options=PlannerOptions(max_workers=workers))
        wall = time.perf_counter() - t0
        st, pr = r.stats, r.stats["pruned"]
        print(f"| {name} | {len(r.islands.islands)} | {cluster.num_gpus} | {wall:.1f} | {st['query_time_s']:.1f} | "
              f"{st['compose_time_s']:.1f} | {st['pairs']} | {st['queries']} | {pr['incompatible']}/"
              f"{pr['infeasible']}/{pr['unbalanced']}/{pr['redundant']} | "
              f"{r.plan.predicted.iteration_time_s:.2f} | {describe_plan(r.plan)} |")
        sys.stdout.flush()


SWEEP_FULL = (
    # (islands, GPUs, model): islands at 256 GPUs, GPUs at 4 islands, layers at 4 islands / 256 GPUs, the corner
    [(k, 256, "llama3-70b") for k in (1, 2, 3, 4, 6, 8)]
    + [(4, g, "llama3-70b") for g in (16, 64, 1024, 4096)]
    + [(4, 256, m) for m in ("llama3-8b", "gpt3-13b", "llama3-405b")]
    + [(8, 4096, "llama3-405b")]
)
SWEEP_QUICK = [(1, 64, "llama3-8b"), (2, 64, "llama3-8b"), (4, 64, "llama3-8b"), (4, 256, "llama3-70b")]


def point(k: int, gpus: int, model_name: str) -> dict:
    """One sweep point in this process: plan, and report time, memory and counts as one JSON line."""
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    from tangram_launch.islands import build_islands

    model = load_model(model_name)
    cluster = synthetic_cluster(k, gpus)
    training = TrainingSpec(global_batch=512, seq_len=4096, dtype="fp16")
    par = synthetic_parallelizer(model)
    t0 = time.perf_counter()
    iset = build_islands(cluster, dtype=training.dtype)  # islands.py's cost, reported apart from the planner's
    t1 = time.perf_counter()
    r = search(cluster, model, training, runtime="torch", parallelizer=par, islands=iset,
               options=PlannerOptions(max_workers=1))
    return {"islands": k, "gpus": cluster.num_gpus, "model": model_name, "layers": model.num_layers,
            "atom_layers": r.stats["atom_layers"], "wall_s": time.perf_counter() - t1, "islands_s": t1 - t0,
            "query_s": r.stats["query_time_s"], "compose_s": r.stats["compose_time_s"], "queries": r.stats["queries"],
            "pairs": r.stats["pairs"], "options": r.stats["compose"]["options"],
            "dp_runs": r.stats["compose"]["dp_runs"],
            "peak_mib": peak_rss_mib(), "stages": r.plan.num_stages, "islands_used": len(r.plan.islands_used),
            "iteration_s": r.plan.predicted.iteration_time_s}


def sweep(points, timeout_s: float) -> None:
    print("\n## Scaling sweep (synthetic parallelizer, 1 process, 512 x 4096 tokens, fp16)\n")
    print("| islands | GPUs | model (layers, atom) | planning s | queries s | compose s | queries | options "
          "| DP runs | peak MiB | stages / islands used | build_islands s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k, g, m in points:
        res = run_child([__file__, "--point", str(k), str(g), m], timeout_s)
        if "error" in res:
            print(f"| {k} | {g} | {m} | {res['error']} | | | | | | | | |")
        else:
            print(f"| {k} | {res['gpus']} | {m} ({res['layers']}, {res['atom_layers']}) | {res['wall_s']:.1f} | "
                  f"{res['query_s']:.1f} | {res['compose_s']:.1f} | {res['queries']} | {res['options']} | "
                  f"{res['dp_runs']} | {res['peak_mib']:.0f} | {res['stages']} / {res['islands_used']} | "
                  f"{res['islands_s']:.1f} |")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("all", "headline", "sweep"), default="all")
    ap.add_argument("--quick", action="store_true", help="a short sweep")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per sweep point")
    ap.add_argument("--point", nargs=3, metavar=("ISLANDS", "GPUS", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(int(args.point[0]), int(args.point[1]), args.point[2])))
        return
    if args.part in ("all", "headline"):
        headline(args.workers)
    if args.part in ("all", "sweep"):
        sweep(SWEEP_QUICK if args.quick else SWEEP_FULL, args.timeout)


if __name__ == "__main__":
    main()
