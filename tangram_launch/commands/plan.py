"""Plan LLM training on a heterogeneous cluster (Tangram, paper §5) and print the plan.

    tangram-launch plan --cluster examples/clusters/c3-full-het-iii.yaml --model gpt3-13b \\
        --global-batch 64 --seq-len 2048 --dtype fp16 --runtime torch --compare --timeline plan.svg -o plan.yaml

Prints per stage: layers, island, GPUs, parallel configuration, time per micro-batch and memory against capacity;
then the iteration time, tokens/s, MFU and the planning time. ``--compare`` adds baselines under the same cost
model (the whole cluster as its slowest GPU, the best single island, a uniform layer split) and the ideal bound.
``--plan FILE`` costs a hand-written plan (stages with layers and islands) instead of searching.
Exit status 3 when no plan fits, with the reasons.
"""
from __future__ import annotations

import argparse
import sys

from tangram_launch.errors import SpecError

PRUNING_POLICIES = ("redundant", "unbalanced", "infeasible")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, help="ClusterSpec YAML (tangram-launch profile writes one)")
    parser.add_argument("--model", required=True, help="preset name, model YAML, or Hugging Face config.json")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per iteration (default 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    parser.add_argument("--runtime", default="torch", choices=("torch", "deepspeed", "megatron"),
                        help="runtime that will execute the plan; the planner only proposes what it runs")
    parser.add_argument("--parallelizer", default="megatron", help="homogeneous parallelizer (megatron, uniform, "
                                                                    "or a registered plugin)")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the plan (.json: JSON, else YAML)")
    parser.add_argument("--format", choices=("table", "json", "yaml"), default="table")
    parser.add_argument("--compare", action="store_true", help="add baselines under the same cost model")
    parser.add_argument("--timeline", metavar="FILE", help="draw the predicted 1F1B schedule (.svg, or .png with "
                                                           "matplotlib)")
    parser.add_argument("--plan", metavar="FILE", dest="manual", help="cost a hand-written plan instead of searching")
    parser.add_argument("--workers", type=int, default=None, help="parallel parallelizer queries (default 2)")
    parser.add_argument("--microbatch-sequences", type=int, nargs="+", default=None, metavar="B",
                        help="sequences per micro-batch to try (default: up to 4 divisors of the global batch)")
    parser.add_argument("--no-prune", action="append", default=[], choices=PRUNING_POLICIES,
                        help="switch a pruning policy off (repeatable; for ablations)")
    parser.add_argument("--balance-tolerance", type=float, default=None,
                        help="unbalanced-pair pruning tolerance (default 1.0: up to 2x the compute share)")


def _training(args: argparse.Namespace, model):
    from tangram_launch.specs.training import TrainingSpec

    kw = {"dtype": args.dtype, "optimizer": args.optimizer,
          "seq_len": args.seq_len if args.seq_len is not None else model.max_seq_len}
    if args.global_batch is not None:
        kw["global_batch"] = args.global_batch
    return TrainingSpec(**kw)


def run(args: argparse.Namespace) -> int:
    from tangram_launch.islands import build_islands
    from tangram_launch.planner.api import PlannerOptions, search
    from tangram_launch.planner.slices import DEFAULT_BALANCE_TOLERANCE, PruningPolicy
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model

    if args.workers is not None and args.workers < 1:
        raise SpecError("must be >= 1", field="--workers", value=args.workers)
    cluster = ClusterSpec.load(args.cluster)
    model = load_model(args.model)
    training = _training(args, model)
    iset = build_islands(cluster, dtype=training.dtype)
    pruning = PruningPolicy(redundant="redundant" not in args.no_prune, unbalanced="unbalanced" not in args.no_prune,
                            infeasible="infeasible" not in args.no_prune,
                            balance_tolerance=(DEFAULT_BALANCE_TOLERANCE if args.balance_tolerance is None
                                               else args.balance_tolerance))
    opts = PlannerOptions(pruning=pruning, max_workers=args.workers,
                          microbatch_sequences=tuple(args.microbatch_sequences) if args.microbatch_sequences else None)
    result = None
    baselines = []
    if args.manual:
        from tangram_launch.planner.manual import cost_manual_plan, load_manual_plan

        manual = load_manual_plan(args.manual, num_layers=model.num_layers,
                                  island_names=[i.name for i in iset.islands])
        plan = cost_manual_plan(manual, cluster, model, training, runtime=args.runtime,
                                parallelizer=args.parallelizer, islands=iset, options=opts)
        if args.compare:
            result = search(cluster, model, training, runtime=args.runtime, parallelizer=args.parallelizer,
                            islands=iset, options=opts)
    else:
        result = search(cluster, model, training, runtime=args.runtime, parallelizer=args.parallelizer,
                        islands=iset, options=opts)
        plan = result.plan
    if args.compare and result is not None:
        from tangram_launch.planner.baselines import compare

        baselines = compare(result, cluster)
        rows = [b.to_dict(plan.predicted.iteration_time_s) for b in baselines]
        if args.manual:
            rows.insert(0, {"name": "tangram", "description": "Tangram's plan",
                            "iteration_time_s": result.plan.predicted.iteration_time_s,
                            "speedup_of_tangram": None, "reason": None})
        import dataclasses

        plan = dataclasses.replace(plan, planner={**dict(plan.planner), "compare": rows})
    if args.output:
        plan.dump(args.output)
    if args.timeline:
        from tangram_launch.draw import draw_timeline

        draw_timeline(plan, args.timeline)
    if args.format == "json":
        print(plan.to_json())
    elif args.format == "yaml":
        print(plan.to_yaml(), end="")
    else:
        print(format_plan_table(plan, cluster_name=cluster.name, num_islands=len(iset.islands),
                                manual=bool(args.manual)))
        if args.compare:
            print()
            print(format_compare_table(plan, baselines, tangram=result.plan if args.manual and result else None))
        if args.output:
            print(f"\nplan written to {args.output}")
        if args.timeline:
            print(f"timeline drawn to {args.timeline}")
    sys.stdout.flush()
    return 0


# --- tables ----------------------------------------------------------------------------------------------------

def _grid(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [v.rjust(w) if c in right else v.ljust(w) for c, (v, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def format_plan_table(plan, *, cluster_name: str = "", num_islands: int | None = None, manual: bool = False) -> str:
    tr = plan.training
    st0 = plan.stages
    b = st0[0].micro_batch_size * st0[0].dp
    where = cluster_name or plan.cluster.get("name")
    head = (f"{'manual plan' if manual else 'plan'} for {plan.model.get('name')} on {where}"
            f" ({plan.world_size} of {sum(n['num_gpus'] for n in plan.cluster.get('nodes', []))} GPUs"
            + (f", {num_islands} islands" if num_islands is not None else "") + ")"
            f", runtime {plan.runtime}, parallelizer {plan.planner.get('parallelizer', '?')}")
    lines = [head,
             f"global batch {tr['global_batch']} x {tr['seq_len']} tokens, {tr['dtype']}; {plan.num_microbatches} "
             f"micro-batches of {b} sequences, {plan.schedule}", ""]
    rows = [["stage", "layers", "island", "GPUs", "tp", "dp", "cp", "ep", "zero", "recompute", "mbs", "time/mb",
             "memory GiB (of)"]]
    for s, p in zip(plan.stages, plan.predicted.stages):
        nodes = sorted({n for n, _ in s.gpus})
        rows.append([str(s.index), f"{s.layers[0]}-{s.layers[1] - 1}", s.island,
                     f"{s.num_gpus}" + (f" ({','.join(nodes)})" if len(nodes) <= 2 else f" ({len(nodes)} nodes)"),
                     str(s.tp), str(s.dp), str(s.cp), str(s.ep), str(s.zero_stage), s.recompute,
                     str(s.micro_batch_size), _ms(p.time_s),
                     f"{p.peak_memory_gib:.1f} ({p.capacity_gib:.0f})"])
    lines += _grid(rows, right={4, 5, 6, 7, 8, 10, 11})
    if plan.islands_dropped:
        lines += ["", "islands left out:"]
        lines += [f"  {d['reason']}" for d in plan.islands_dropped]
    idle = plan.planner.get("gpus_idle") or {}
    if idle.get("islands"):
        lines += ["", f"GPUs idle: {idle['total']}"]
        lines += [f"  {d['reason']}" for d in idle["islands"].values()]
    pr = plan.predicted
    bd = pr.breakdown
    lines += ["",
              f"iteration {pr.iteration_time_s:.3f} s   tokens/s {pr.tokens_per_s:,.0f}   MFU {pr.mfu * 100:.1f} % "
              f"(model FLOPs, causal attention, over the peak of the GPUs used)"]
    if bd:
        lines.append(f"  = (m-1) x period {bd.get('steady_s', 0):.3f} s + fill/drain {bd.get('fill_s', 0):.3f} s "
                     f"(incl. inter-island p2p {bd.get('p2p_s', 0):.3f} s) "
                     f"+ DP sync/optimizer {bd.get('tail_s', 0):.3f} s")
    pl = plan.planner
    if "planning_time_s" in pl:
        pruned = pl.get("pruned", {})
        lines.append(f"planning {pl['planning_time_s']:.2f} s: {pl.get('pairs')} slice/island pairs, "
                     f"{pl.get('queries')} queries (pruned: " + ", ".join(f"{k} {v}" for k, v in pruned.items())
                     + f"), micro-batch sizes tried {pl.get('microbatch_sequences_tried')}")
    return "\n".join(lines)


def format_compare_table(plan, baselines, *, tangram=None) -> str:
    t = plan.predicted.iteration_time_s
    rows = [["plan", "iteration", "tokens/s", "MFU", "speed-up of this plan"]]
    tokens = plan.training["global_batch"] * plan.training["seq_len"]
    rows.append(["this plan" if tangram is not None else "tangram", f"{t:.3f} s", f"{tokens / t:,.0f}",
                 f"{plan.predicted.mfu * 100:.1f} %", "-"])
    if tangram is not None:
        tt = tangram.predicted.iteration_time_s
        rows.append(["tangram (searched)", f"{tt:.3f} s", f"{tokens / tt:,.0f}", f"{tangram.predicted.mfu * 100:.1f} %",
                     f"{tt / t:.2f}x"])
    notes = []
    for bl in baselines:
        bt = bl.time_s
        if bt is None:
            rows.append([bl.name, "infeasible", "-", "-", "-"])
            notes.append(f"  {bl.name}: {bl.reason}")
            continue
        mfu = f"{bl.plan.predicted.mfu * 100:.1f} %" if bl.plan is not None else "100 %"  # the ideal bound
        rows.append([bl.name, f"{bt:.3f} s", f"{tokens / bt:,.0f}", mfu, f"{bt / t:.2f}x"])
        notes.append(f"  {bl.name}: {bl.description}")
    return "\n".join(["comparison under the same cost model:"] + _grid(rows, right={1, 2, 3, 4}) + notes)
