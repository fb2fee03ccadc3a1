"""Plan quality on the paper's scenarios: Tangram's predicted iteration time against the --compare baselines
(same cost model) and the ideal bound (all FLOPs over the sum of peak FLOP/s). Prints a Markdown table.

    python benchmarks/bench_planner_quality.py [--workers 2] [--only c3]

Scenarios (paper §6, /work/shared/PAPER-SCENARIOS.md): C1 (T4 + V100-16GB, 4:4 and 8:8) with GShard MoE 2.4B /
7.1B / 10B, and each homogeneous half alone; C2 (H100 + A100) with Mixtral-8x7B and Qwen3-30B-A3B, full and half
depth; C3 (i)-(iii) with GPT-3 13B. The paper does not state global batches; assumed here: 1,024 x 1,024 tokens for
GShard MoE (Alpa's MoE suite's max_global_batch_size), 256 x 4,096 for C2, 128 x 2,048 for GPT-3 13B (close to the
paper's reported iteration times). Dtype: fp16 where T4/V100 take part (no bf16), bf16 on C2. Runtime: megatron for
MoE models (expert parallelism; one grid for all stages), torch for dense ones (per-stage TP).
"""
from __future__ import annotations

import argparse
import sys
import time

from bench_planner_common import cluster_path

GSHARD = ("gshard-moe-2.4b", "gshard-moe-7.1b", "gshard-moe-10b")
SCENARIOS = (
    [("C1 4:4", "c1-compute-het-4x4", m, 1024, 1024, "fp16", "megatron") for m in GSHARD]
    + [("C1 8:8", "c1-compute-het", m, 1024, 1024, "fp16", "megatron") for m in GSHARD]
    + [("C1 T4 half", "c1-t4-only", "gshard-moe-2.4b", 1024, 1024, "fp16", "megatron"),
       ("C1 V100 half", "c1-v100-only", "gshard-moe-2.4b", 1024, 1024, "fp16", "megatron")]
    + [("C2", "c2-modern-het", m, 256, 4096, "bf16", "megatron")
       for m in ("mixtral-8x7b-16l", "mixtral-8x7b", "qwen3-30b-a3b-24l", "qwen3-30b-a3b")]
    + [(f"C3 ({v})", f"c3-full-het-{v}", "gpt3-13b", 128, 2048, "fp16", "torch") for v in ("i", "ii", "iii")]
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default="", help="run scenarios whose label or cluster contains this text")
    args = ap.parse_args()

    from tangram_launch.errors import InfeasibleError
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.planner.baselines import compare
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    print("| scenario | model | GPUs | runtime | Tangram s | islands used | homogeneous s (x) | best island s (x) "
          "| uniform split s (x) | ideal s | ideal / Tangram | planning s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, cname, mname, batch, seq, dtype, runtime in SCENARIOS:
        if args.only and args.only not in label and args.only not in cname:
            continue
        cluster = ClusterSpec.load(cluster_path(cname))
        model = load_model(mname)
        training = TrainingSpec(global_batch=batch, seq_len=seq, dtype=dtype)
        t0 = time.perf_counter()
        try:
            r = search(cluster, model, training, runtime=runtime, parallelizer="megatron",
                       options=PlannerOptions(max_workers=args.workers))
        except InfeasibleError as exc:
            print(f"| {label} | {mname} | {cluster.num_gpus} | {runtime} | infeasible: {exc.reasons[0][:80]} "
                  f"| | | | | | | |")
            continue
        planning = time.perf_counter() - t0
        t = r.plan.predicted.iteration_time_s
        cells = {}
        for bl in compare(r.unsplit or r, cluster):  # baselines over the islands as built
            bt = bl.time_s
            cells[bl.name] = "infeasible" if bt is None else (f"{bt:.2f}" if bl.name == "ideal"
                                                                else f"{bt:.2f} ({bt / t:.2f}x)")
            if bl.name == "ideal":
                ideal = bt
        used = ", ".join(r.plan.islands_used)
        dropped = [d["island"] for d in r.plan.islands_dropped]
        if dropped:
            used += " (left out: " + ", ".join(dropped) + ")"
        print(f"| {label} | {mname} | {cluster.num_gpus} | {runtime} | {t:.2f} | {used} | {cells['homogeneous']} | "
              f"{cells['best-island']} | {cells['uniform-split']} | {ideal:.2f} | {ideal / t * 100:.0f} % | "
              f"{planning:.1f} |")
        sys.stdout.flush()
    print("\n(x) = baseline time / Tangram time under the same cost model; ideal = all training FLOPs (causal "
          "attention, no recompute) / sum of every GPU's peak FLOP/s.")


if __name__ == "__main__":
    main()
