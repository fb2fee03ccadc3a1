"""What the exact micro-batch search costs per row of bench_planner_scale.py: this tree's planning CPU seconds
against another checkout's (a tree that searched fewer micro-batch sizes), and this tree's on the other's sizes
only, so that a row's change splits into the extra sizes' cost and the rest.

    cd benchmarks && python bench_exact_search_cost.py --against /tmp/old --rounds 2 --only c3-4-islands-20gpu
    cd benchmarks && python bench_exact_search_cost.py --against /tmp/old --runtimes megatron

Per row: the other tree's search once (its plan names the sizes it tried, planner.microbatch_sequences_tried; not
counted), then ``--rounds`` runs each of the other tree, this tree (every divisor of the global batch) and this tree
on the other's sizes (PlannerOptions.microbatch_sequences), alternating the order; medians of the planning CPU
seconds (query workers included, as bench_planner_scale.py counts them) and each one's slice queries.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys

from bench_planner_common import run_child
from bench_planner_scale import CASES, RUNTIMES

WHO = ("old", "new", "new_on_old_sizes")


def _cpu_s() -> float:
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def child(tree: str, case: list, sizes: list[int] | None) -> dict:
    """Plan one row with ``tree``'s planner first on the path (on ``sizes`` only, where given)."""
    sys.path.insert(0, tree)
    from tangram_launch.islands import build_islands
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    name, model_name, global_batch, seq_len, dtype, runtime = case
    cluster = ClusterSpec.load(os.path.join(tree, "examples", "clusters", f"{name}.yaml"))
    training = TrainingSpec(global_batch=global_batch, seq_len=seq_len, dtype=dtype)
    islands = build_islands(cluster, dtype=dtype)
    model = load_model(model_name)
    opts = PlannerOptions(progress=False, microbatch_sequences=tuple(sizes) if sizes else None)
    c0 = _cpu_s()
    plan = search(cluster, model, training, runtime=runtime, islands=islands, options=opts).plan
    return {"cpu_s": _cpu_s() - c0, "queries": plan.planner["queries"],
            "tried": sorted(set(plan.planner["microbatch_sequences_tried"])),
            "plan": f"{plan.predicted.iteration_time_s:.3f} ({plan.planner['b']})"}


def row(case: list, args: argparse.Namespace) -> str:
    """One table row: the other tree once for its sizes, then the three alternating; medians."""
    trees = {"old": os.path.abspath(args.against), "new": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}

    def run(who: str, sizes: list[int] | None) -> dict:
        tree = trees["old" if who == "old" else "new"]
        return run_child([__file__, "--child", json.dumps([tree, case, sizes])], 20 * args.timeout)

    first = run("old", None)
    if "error" in first:
        return f"| {case[0]} | {case[5]} | error: {first['error']} |"
    sizes = first["tried"]
    out: dict[str, list[dict]] = {w: [] for w in WHO}  # (the first run names the sizes; a warm-up, not counted)
    for r in range(args.rounds):
        for who in (WHO if r % 2 else WHO[::-1]):
            out[who].append(run(who, sizes if who == "new_on_old_sizes" else None))
    if any("error" in o for runs in out.values() for o in runs):
        return f"| {case[0]} | {case[5]} | error in a run |"
    cpu = {w: statistics.median(o["cpu_s"] for o in out[w]) for w in WHO}
    new = out["new"][-1]
    return (f"| {case[0]} | {case[5]} | {cpu['old']:.2f} | {cpu['new']:.2f} | {cpu['new_on_old_sizes']:.2f} | "
            f"{cpu['new'] / cpu['old']:.2f} | {cpu['new_on_old_sizes'] / cpu['old']:.2f} | "
            f"{cpu['new'] / cpu['new_on_old_sizes']:.2f} | {len(sizes)} -> {len(new['tried'])} | "
            f"{out['old'][-1]['queries']} / {new['queries']} / {out['new_on_old_sizes'][-1]['queries']} | "
            f"{first['plan']} | {new['plan']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", help="the other checkout's root (required unless --child)")
    ap.add_argument("--only", nargs="*", help="cluster names to run (default: all)")
    ap.add_argument("--runtimes", nargs="*", default=list(RUNTIMES))
    ap.add_argument("--rounds", type=int, default=2, help="runs of each of the three per row")
    ap.add_argument("--timeout", type=float, default=600.0, help="CPU seconds per run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        tree, case, sizes = json.loads(args.child)
        resource.setrlimit(resource.RLIMIT_CPU, (int(args.timeout), int(args.timeout) + 5))
        print(json.dumps(child(tree, case, sizes)))
        return
    if not args.against:
        ap.error("--against is required")
    print("| cluster | runtime | old CPU s | new CPU s | new on old's sizes CPU s | new / old "
          "| new on old's sizes / old | extra sizes (new / new on old's sizes) | sizes old -> new "
          "| queries old / new / new on old's sizes | old plan s (b) | new plan s (b) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    chosen = [[*case[:5], rt] for case in CASES if not args.only or case[0] in args.only for rt in args.runtimes]
    for case in chosen:
        print(row(case, args), flush=True)


if __name__ == "__main__":
    main()
