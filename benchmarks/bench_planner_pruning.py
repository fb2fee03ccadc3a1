"""Pruning ablation (paper Fig. 12): planning time and resulting plan with the pruning policies on and off.

    python benchmarks/bench_planner_pruning.py [--cluster c3-4-islands-20gpu] [--model gpt3-13b] [--workers 2]

GPT-3 13B on the 4-island, 20-GPU cluster with the megatron parallelizer, fp16, 128 x 2048 tokens. All eight on/off
combinations of the three policies: first cumulatively as the paper does (none -> +redundant -> +unbalanced ->
+infeasible), then the other four. The plan must not get worse: every row's iteration time is compared with the
no-pruning plan.
"""
from __future__ import annotations

import argparse
import sys
import time

from bench_planner_common import cluster_path, describe_plan


def policy_rows() -> list[tuple[str, tuple[bool, bool, bool]]]:
    """(label, (redundant, unbalanced, infeasible)) for every one of the 2^3 combinations, each once."""
    return [
        ("no pruning", (False, False, False)),
        ("+ redundant", (True, False, False)),
        ("+ unbalanced", (True, True, False)),
        ("+ infeasible (all)", (True, True, True)),
        ("all but redundant", (False, True, True)),
        ("all but unbalanced", (True, False, True)),
        ("unbalanced only", (False, True, False)),
        ("infeasible only", (False, False, True)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="c3-4-islands-20gpu")
    ap.add_argument("--model", default="gpt3-13b")
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.planner.slices import PruningPolicy
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    cluster = ClusterSpec.load(cluster_path(args.cluster))
    model = load_model(args.model)
    training = TrainingSpec(global_batch=args.global_batch, seq_len=min(2048, model.max_seq_len), dtype="fp16")
    rows = [(label, PruningPolicy(*flags)) for label, flags in policy_rows()]
    print(f"## Pruning ablation: {model.name} on {args.cluster} ({cluster.num_gpus} GPUs), megatron parallelizer, "
          f"fp16, {training.global_batch} x {training.seq_len} tokens, {args.workers} workers\n")
    print("| policies | planning s | speed-up | queries s | compose s | queries | options | iteration s | "
          "vs no pruning | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base_time = base_iter = None
    for label, policy in rows:
        t0 = time.perf_counter()
        r = search(cluster, model, training, runtime="torch", parallelizer="megatron",
                   options=PlannerOptions(pruning=policy, max_workers=args.workers))
        wall = time.perf_counter() - t0
        it = r.plan.predicted.iteration_time_s
        if base_time is None:
            base_time, base_iter = wall, it
        same = "same" if abs(it - base_iter) <= 1e-9 * base_iter else (
            "better" if it < base_iter else f"WORSE (+{(it / base_iter - 1) * 100:.2f} %)")
        print(f"| {label} | {wall:.1f} | {base_time / wall:.1f}x | {r.stats['query_time_s']:.1f} | "
              f"{r.stats['compose_time_s']:.1f} | {r.stats['queries']} | {r.stats['compose']['options']} | "
              f"{it:.3f} | {same} | {describe_plan(r.plan)} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
