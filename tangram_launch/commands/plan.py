"""Plan LLM training on a heterogeneous cluster (Tangram, paper §5) and print the plan.

    tangram-launch plan --cluster examples/clusters/c3-full-het-iii.yaml --model gpt3-13b \\
        --global-batch 64 --seq-len 2048 --dtype fp16 --runtime torch --compare --timeline plan.svg -o plan.yaml

Prints per stage: layers, island, GPUs, parallel configuration, time per micro-batch and memory against capacity;
then the iteration time, tokens/s, MFU and the planning time. ``--compare`` adds baselines under the same cost
model (the whole cluster as its slowest GPU, the best single island, a uniform layer split) and the ideal bound.
``--plan FILE`` costs a hand-written plan (stages with layers and islands) instead of searching; ``--stages-out FILE``
writes a plan's stages in that format.
Exit status 3 when no plan fits, with the reasons.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import ATTENTION_KERNEL_HELP, ATTENTION_KERNELS, DTYPES, RUNTIMES

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.plan import Plan

PRUNING_POLICIES = ("redundant", "unbalanced", "infeasible")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, help="ClusterSpec YAML (tangram-launch profile writes one)")
    parser.add_argument("--model", required=True, help="preset name, model YAML, or Hugging Face config.json")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per iteration (default 8)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: the model's, at most 2048; as launch-time planning)")
    parser.add_argument("--dtype", default=None, choices=DTYPES,
                        help="training dtype (default bf16): tf32 = fp32 storage with TF32 matmuls; fp8 = FP8 GEMMs, "
                             "bf16 elsewhere (Transformer Engine; H100, H200, B200, L40S, L4)")
    parser.add_argument("--optimizer", default=None, choices=("adam", "adamw", "sgd"), help="default adam")
    parser.add_argument("--attention-kernel", default=None, choices=ATTENTION_KERNELS,
                        help=ATTENTION_KERNEL_HELP)
    parser.add_argument("--memory-headroom", type=float, default=None, metavar="FRACTION",
                        help="fraction of each GPU's memory a plan leaves free (default 0.05: the memory model is an "
                             "estimate and the allocator needs slack)")
    parser.add_argument("--runtime", default=None, metavar="NAME",
                        help=f"runtime that will execute the plan (default torch; built in: {', '.join(RUNTIMES)}, or "
                             "one registered under the entry point group tangram_launch.runtime_adapters); the "
                             "planner only proposes what it runs")
    parser.add_argument("--schedule", default=None, choices=("auto", "1F1B", "interleaved-1F1B"),
                        help="pipeline schedule (default auto): auto interleaves (virtual stages) where the runtime "
                             "runs it and it is faster; interleaved-1F1B insists")
    parser.add_argument("--parallelizer", default=None, help="homogeneous parallelizer (default megatron; uniform, "
                                                              "or a registered plugin)")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the plan (.json: JSON, else YAML)")
    parser.add_argument("--stages-out", metavar="FILE", help="write the plan's stages as a hand-written plan "
                                                             "(--plan's YAML, every field given) to edit and cost")
    parser.add_argument("--format", choices=("table", "json", "yaml"), default="table")
    parser.add_argument("--compare", action="store_true", help="add baselines under the same cost model")
    parser.add_argument("--timeline", metavar="FILE", help="draw the schedule the plan runs, 1F1B or interleaved "
                                                           "(.svg, or .png with matplotlib)")
    parser.add_argument("--plan", metavar="FILE", dest="manual", help="cost a hand-written plan instead of searching")
    parser.add_argument("--workers", type=int, default=None, help="parallel parallelizer queries (default 2)")
    parser.add_argument("--microbatch-sequences", type=int, nargs="+", default=None, metavar="B",
                        help="sequences per micro-batch to try (default: every divisor of the global batch)")
    parser.add_argument("--no-prune", action="append", default=[], choices=PRUNING_POLICIES,
                        help="switch a pruning policy off (repeatable; for ablations)")
    parser.add_argument("--balance-tolerance", type=float, default=None,
                        help="unbalanced-pair pruning tolerance (default 1.0: up to 2x the compute share)")
    parser.add_argument("--gpu-counts", default=None, choices=("tiling", "all"),
                        help="GPU counts a slice may use (default tiling: powers of two within a node and whole "
                             "nodes; all: every count whose stages fit in a node or are whole nodes, slower)")


def run(args: argparse.Namespace) -> int:
    from tangram_launch.specs.limits import check_cli_args

    check_cli_args(args)  # bad numbers and output paths: exit 2 before any work
    from tangram_launch.islands import build_islands
    from tangram_launch.launch.planning import planning_request
    from tangram_launch.planner.plan_search import search
    from tangram_launch.planner.report import format_compare_table, format_plan_table  # here: --help stays fast
    from tangram_launch.specs.cluster import ClusterSpec

    if args.workers is not None and args.workers < 1:
        raise SpecError("must be >= 1", field="--workers", value=args.workers)
    if args.timeline:
        from tangram_launch.draw import check_picture_path

        check_picture_path(args.timeline, "--timeline")  # before planning, not after it
    cluster = ClusterSpec.load(args.cluster)
    req = planning_request(args, cluster=cluster)  # one set of defaults with launch-time planning
    model, training, opts = req.model, req.training, req.options
    iset = build_islands(cluster, dtype=training.dtype)
    result = None
    baselines = []
    if args.manual:
        from tangram_launch.planner.manual import cost_manual_plan, load_manual_plan

        manual = load_manual_plan(args.manual, num_layers=model.num_layers,
                                  island_names=[i.name for i in iset.islands])
        plan = cost_manual_plan(manual, cluster, model, training, runtime=req.runtime,
                                parallelizer=req.parallelizer, islands=iset, options=opts)
        if args.compare:
            result = search(cluster, model, training, runtime=req.runtime, parallelizer=req.parallelizer,
                            islands=iset, options=opts)
    else:
        result = search(cluster, model, training, runtime=req.runtime, parallelizer=req.parallelizer,
                        islands=iset, options=opts)
        plan = result.plan
    if args.compare and result is not None:
        from tangram_launch.planner.baselines import compare

        baselines = compare(result.unsplit or result, cluster, options=opts)  # baselines over the islands as built
        rows = [b.to_dict(plan.predicted.iteration_time_s) for b in baselines]
        if args.manual:
            rows.insert(0, {"name": "tangram", "description": "Tangram's plan",
                            "iteration_time_s": result.plan.predicted.iteration_time_s,
                            "speedup_of_tangram": None, "reason": None})
        import dataclasses

        plan = dataclasses.replace(plan, planner={**dict(plan.planner), "compare": rows})
    written = _write_files(args, plan)
    if args.format in ("json", "yaml"):
        print(plan.to_json() if args.format == "json" else plan.to_yaml(), end="\n" if args.format == "json" else "")
        for line in written:  # stdout is the plan: where the files went goes to stderr
            print(line, file=sys.stderr)
    else:
        print(format_plan_table(plan, cluster_name=cluster.name, num_islands=len(iset.islands),
                                manual=bool(args.manual)))
        if args.compare:
            print()
            print(format_compare_table(plan, baselines, tangram=result.plan if args.manual and result else None))
        if written:
            print()
        for line in written:
            print(line)
    sys.stdout.flush()
    return 0


def _write_files(args: argparse.Namespace, plan: "Plan") -> list[str]:
    """The files the options ask for (the plan, its stages as a hand-written plan, the timeline), and a line per file
    saying where it went."""
    lines = []
    if args.output:
        plan.dump(args.output)
        lines.append(f"plan written to {os.path.abspath(args.output)}")
    if args.stages_out:
        from tangram_launch.planner.manual import written_yaml
        from tangram_launch.specs.yamlio import dump_text_file

        dump_text_file(written_yaml(plan), args.stages_out)
        lines.append(f"stages written to {os.path.abspath(args.stages_out)}")
    if args.timeline:
        from tangram_launch.draw import draw_timeline

        lines.append(f"timeline drawn to {draw_timeline(plan, args.timeline, field='--timeline')}")
    return lines
