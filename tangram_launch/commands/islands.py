"""Print a cluster's GPU islands (paper §4) and, for GPUs split apart, the constraint that separated them.
Node lists print as ranges (``h100-[0-63]``); past 40 island pairs the reasons are counted by constraint.

    tangram-launch islands --cluster examples/clusters/c3-full-het-iii.yaml [--format table|json] [--draw FILE]
"""
from __future__ import annotations

import argparse
import json
import sys

from tangram_launch.islands import IslandTolerances, build_islands, format_islands_table
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.constants import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, help="ClusterSpec YAML file")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES,
                        help="dtype whose throughput defines compute similarity (falls back to fp16/fp32)")
    parser.add_argument("--eps-compute", type=float, default=IslandTolerances.compute)
    parser.add_argument("--eps-memory", type=float, default=IslandTolerances.memory)
    parser.add_argument("--eps-interconnect", type=float, default=IslandTolerances.interconnect)
    parser.add_argument("--eps-network", type=float, default=IslandTolerances.network,
                        help="inter-node tolerance: links leaving an island and its own links' spread (3), (4)")
    parser.add_argument("--draw", metavar="FILE", help="draw nodes grouped into islands with their links (.svg/.png)")


def run(args: argparse.Namespace) -> int:
    from tangram_launch.specs.limits import check_cli_args

    check_cli_args(args)  # bad numbers and output paths: exit 2 before any work
    if args.draw:
        from tangram_launch.draw import check_picture_path

        check_picture_path(args.draw, "--draw")  # a bad name fails before any work
    cluster = ClusterSpec.load(args.cluster)
    tol = IslandTolerances(args.eps_compute, args.eps_memory, args.eps_interconnect, args.eps_network)
    iset = build_islands(cluster, tol, dtype=args.dtype)
    if args.format == "json":
        print(json.dumps(iset.to_dict(args.dtype), indent=2))
    else:
        print(format_islands_table(iset, args.dtype))
    if args.draw:
        from tangram_launch.draw import draw_islands

        where = draw_islands(cluster, iset, args.draw, field="--draw")
        # with --format json stdout is the data: the note goes to stderr
        print(f"islands picture written to {where}", file=sys.stdout if args.format == "table" else sys.stderr)
    return 0
