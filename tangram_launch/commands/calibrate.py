"""Fold a run's measured stage times into the cluster file, so the next plan uses them.

    tangram-launch calibrate RUN_DIR/run-report.json --cluster cluster.yaml [-o calibrated.yaml]

Every GPU the run timed, whose stage ran more than ``--tolerance`` away from its prediction, gets its compute
figures scaled by predicted / measured. Without ``-o`` the cluster file is rewritten, and its previous content kept
beside it as ``FILE.before-calibration-<UTC time>``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

from tangram_launch.launch.calibration import DEFAULT_TOLERANCE, calibrate
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.limits import check_output_path, parse_json, read_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", metavar="RUN_REPORT", help="run-report.json written by a planned launch")
    parser.add_argument("--cluster", required=True, help="the cluster file the run's plan was made from")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the calibrated cluster here (default: "
                                                                 "rewrite --cluster, keeping the old file beside it)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"leave GPUs within this relative error alone (default {DEFAULT_TOLERANCE})")


def run(args: argparse.Namespace) -> int:
    check_output_path(args.output, option="--output")
    report = parse_json(read_text(args.report, what="run report"), source=args.report)
    cluster = ClusterSpec.load(args.cluster)
    calibrated, changes = calibrate(cluster, report, tolerance=args.tolerance)
    if not changes:
        print(f"every timed GPU ran within {args.tolerance:.0%} of its prediction: {args.cluster} is unchanged")
        return 0
    for change in changes:
        print(change.line())
    out = args.output or args.cluster
    if out == args.cluster:
        kept = f"{args.cluster}.before-calibration-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        shutil.copy2(args.cluster, kept)
        print(f"kept the previous cluster file as {kept}")
    tmp = f"{out}.tmp.{os.getpid()}"
    calibrated.dump(tmp)
    os.replace(tmp, out)
    print(f"calibrated cluster written to {out}; plan again with --cluster {out}")
    return 0
