"""Measure a live cluster and write its ClusterSpec (run the same command on every node, like torchrun).

    tangram-launch profile --standalone --nproc-per-node 8 -o cluster.yaml --quick
    tangram-launch profile --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 \\
        -o cluster.yaml [--model llama3-8b --seq-len 4096]

One profiling worker per GPU (or per CPU process where there is no GPU) measures GEMM TFLOP/s per dtype, memory
bandwidth, all-reduce bus bandwidth and point-to-point bandwidth inside each node, and bandwidth and latency between
every pair of nodes (each node talks to one peer at a time). Global rank 0 writes the ClusterSpec; that node prints
a summary table. The file appears only when every worker finished: a failed profile names the node and the rank
that stopped, and leaves no file behind. ``tangram-launch islands --cluster cluster.yaml`` and ``plan`` read it.
"""
from __future__ import annotations

import argparse
import os

from profiler import LAYER_TIMINGS
from tangram_launch.errors import SpecError
from tangram_launch.launch.profiling import (ProfileError, ProfileRequest, torchrun_actions, failure_message,
                                             profile_cluster, torchrun_argv)

__all__ = ["ProfileError", "add_arguments", "failure_message", "run", "torchrun_argv"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    tr = parser.add_argument_group("torchrun options", "as for torchrun (same names, defaults and PET_* variables)")
    for action in torchrun_actions():
        # torch's own Action objects, so names, aliases, env-variable defaults and checks stay exactly torchrun's
        tr._add_action(action)
    _add_profile_arguments(parser)


def add_help_arguments(parser: argparse.ArgumentParser) -> None:
    """For ``--help`` only: torchrun's options from the table ``tangram-launch --help`` prints, so the help comes
    without importing torch (a run still parses with torch's own actions, :func:`add_arguments`)."""
    from tangram_launch.launch.options import TORCHRUN_OPTIONS

    tr = parser.add_argument_group("torchrun options", "as for torchrun (same names, defaults and PET_* variables; "
                                                       "`tangram-launch --help-torchrun` lists them all)")
    for strings, metavar, text in TORCHRUN_OPTIONS:
        if text is None or {"--module", "--no-python", "--run-path"} & set(strings):
            continue
        if metavar is None:
            tr.add_argument(*strings, action="store_true", help=text)
        else:
            tr.add_argument(*strings, metavar=metavar, help=text)
    _add_profile_arguments(parser)


def _add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profile")
    g.add_argument("-o", "--output", default="cluster.yaml", help="ClusterSpec YAML to write (default cluster.yaml)")
    g.add_argument("--quick", action="store_true", help="a shorter budget per benchmark (seconds in all)")
    g.add_argument("--budget-s", type=float, metavar="S",
                   help="wall seconds each benchmark of a device may take: the GEMM grows, and repetitions are "
                        "added, while it allows (default 1 on CPU, 10 on GPU; with --quick 0.4 and 2)")
    g.add_argument("--name", help="cluster name written into the file")
    g.add_argument("--model", metavar="NAME|FILE",
                   help="also time each layer kind of this model, its embedding and its head (forward, backward "
                        "and activation bytes) on every device, at every shape below; the cost model interpolates "
                        "between them")
    g.add_argument("--seq-len", metavar="N[,N...]",
                   help="sequence length(s) for --model (default: the model's, capped at 512 on CPU, 4096 on GPU)")
    g.add_argument("--micro-batch", metavar="N[,N...]", help="micro-batch sizes for --model (default 1,2,4,8)")
    g.add_argument("--tp", metavar="N[,N...]",
                   help="TP shards for --model, each timed as its share of a layer on one device (default: powers "
                        "of two dividing the devices per node and the heads)")
    g.add_argument("--layer-budget-s", type=float, metavar="S",
                   help="wall seconds all --model shapes may take on a device (default 60; with --quick 15); the "
                        "shapes that do not fit are left out, largest first")
    g.add_argument("--layer-dtype", choices=("bf16", "fp16", "fp32"), help="dtype for --model (default bf16)")
    g.add_argument("--layer-timing", choices=LAYER_TIMINGS, default=None,
                   help="CPU devices only: how --model's calls are timed. interleaved (default): each call followed "
                        "by an all-to-all of the node's processes, as a pipeline stage meets its layers on a shared "
                        "host; back-to-back: blocks of calls without pause (an all-to-all after each block), as the "
                        "busiest stage of a pipeline runs: a device slowed by a CFS quota has its mean speed only "
                        "while busy for many quota periods; back-to-back also times a stage-like sequence (embedding, "
                        "layers, head) at each micro-batch size beside the sum of its parts, and the planner scales "
                        "stages priced from measured layers by that ratio")
    g.add_argument("--timeout-s", type=float, default=300.0,
                   help="process-group timeout: a silent peer fails the profile after this long (default 300)")


def _int_list(args: argparse.Namespace, flag: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers (None: empty, the profiler's default)."""
    text = getattr(args, flag.lstrip("-").replace("-", "_"))
    if text is None:
        return ()
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise SpecError("must be positive integers separated by commas", field=flag, value=text, valid="e.g. 1,2,4")
    return values


def _check(args: argparse.Namespace) -> None:
    for flag in ("--seq-len", "--micro-batch", "--tp"):
        _int_list(args, flag)
    if args.layer_budget_s is not None and not args.layer_budget_s > 0:
        raise SpecError("must be positive", field="--layer-budget-s", value=args.layer_budget_s,
                        valid="seconds, e.g. 60")
    if args.timeout_s <= 0:
        raise SpecError("must be positive", field="--timeout-s", value=args.timeout_s)
    if args.budget_s is not None and not args.budget_s > 0:
        raise SpecError("must be positive", field="--budget-s", value=args.budget_s, valid="seconds, e.g. 2")
    if args.model:
        from tangram_launch.specs.model import load_model

        from tangram_launch.launch.preflight import check_seq_len

        model = load_model(args.model)  # a bad name fails here, before any worker starts
        for seq_len in _int_list(args, "--seq-len"):
            check_seq_len(model, seq_len, field="--seq-len")  # as plan and the launcher refuse it
        kv = model.num_kv_heads or model.num_heads
        for tp in _int_list(args, "--tp"):
            if model.num_heads % tp or (kv % tp and tp % kv):
                raise SpecError(f"must divide model {model.name}'s {model.num_heads} attention heads ({kv} KV heads)",
                                field="--tp", value=tp, valid="a divisor of the heads")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise SpecError("output folder does not exist", field="--output", value=args.output)


def run(args: argparse.Namespace) -> int:
    _check(args)
    outcome = profile_cluster(ProfileRequest(
        output=args.output, torchrun_argv=tuple(torchrun_argv(args)), quick=args.quick, name=args.name,
        model=args.model, seq_len=_int_list(args, "--seq-len"), micro_batch=_int_list(args, "--micro-batch"),
        tp=_int_list(args, "--tp"), layer_budget_s=args.layer_budget_s, layer_dtype=args.layer_dtype,
        layer_timing=args.layer_timing,
        timeout_s=args.timeout_s, budget_s=args.budget_s, nnodes=str(getattr(args, "nnodes", "?")),
        rdzv_endpoint=getattr(args, "rdzv_endpoint", "") or ""))
    if outcome.written:
        _report(outcome.output)
    else:
        writer = outcome.writer
        where = f"node {writer['node']} (host {writer['host']})" if writer else "the node of global rank 0"
        print(f"profile done on this node; global rank 0 on {where} wrote the ClusterSpec to its {args.output}")
    return 0


def _report(output: str) -> None:
    from profiler.assemble import format_summary
    from tangram_launch.specs.cluster import ClusterSpec

    spec = ClusterSpec.load(output)
    print(format_summary(spec))
    print(f"\nwrote {output}")
