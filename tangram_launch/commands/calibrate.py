"""Fold a run's measured stage times into the cluster file, so the next plan uses them.

    tangram-launch calibrate RUN_DIR[/run-report.json] [--cluster cluster.yaml] [-o calibrated.yaml]

Every GPU the run timed, whose stage ran more than ``--tolerance`` away from its prediction, gets its compute
figures scaled by predicted / measured (a GPU the plan left out: as its timed twins). On GPUs, a stage that allocated
more than ``--tolerance`` beyond its predicted memory has its GPUs' memory taken as physical / that ratio for the next
plan. The report names the cluster its plan was made from (the figures' hash, and the file of a ``--cluster``
launch); without ``--cluster`` calibrate takes that file, or finds the profile in the launcher's cache (a
``--profile`` launch). A file whose figures are not the ones the run planned from is refused: its ratios were
measured against other predictions (and a second calibration from the same report would apply them twice). Without
``-o`` a file given as ``--cluster`` or the cached profile is rewritten, its previous content kept beside it as
``FILE.before-calibration-<UTC time>``; a cached profile is sealed again, so the next ``--profile`` launch on this
machine plans from the calibrated figures instead of measuring over them. A ``--cluster`` file the report names gets
its calibrated copy beside it (``.calibrated.yaml``), the file as written (its comments) untouched. The calibrated
file records the run it came from and its stage layout (``profile.calibrations``): a later plan of another layout is
warned about at launch, its prediction unmeasured.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import time
from typing import Mapping

from tangram_launch.errors import SpecError
from tangram_launch.launch.calibration import DEFAULT_TOLERANCE, calibrate, with_calibration_record
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.limits import check_output_path, parse_json, read_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", metavar="RUN_REPORT",
                        help="run-report.json written by a planned launch, or the launch's --run-dir")
    parser.add_argument("--cluster", help="the cluster file the run's plan was made from (default: the one the "
                                          "report names: the --cluster file, or the cached --profile)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the calibrated cluster here (default: rewrite "
                                                                 "--cluster or the cached profile, keeping the old "
                                                                 "file beside it; a --cluster file the report names: "
                                                                 "FILE.calibrated.yaml beside it)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                        help=f"leave GPUs within this relative error alone (default {DEFAULT_TOLERANCE})")


def _planned_hash(report: Mapping) -> str | None:
    cluster = report.get("cluster")
    value = cluster.get("hash") if isinstance(cluster, Mapping) else None
    return value if isinstance(value, str) and value else None


def _calibrated_from(cluster: ClusterSpec, plan_hash: str) -> bool:
    return any((gpu.measured.get(key) or {}).get("plan_hash") == plan_hash
               for _, gpu in cluster.iter_gpus() for key in ("calibration", "memory_calibration"))


def _named_cluster_file(report: Mapping) -> str | None:
    """The ``--cluster`` file the run was launched with, as its report names it (None: a --profile launch)."""
    cluster = report.get("cluster")
    path = cluster.get("path") if isinstance(cluster, Mapping) else None
    if not isinstance(path, str) or not path:
        return None
    if not os.path.isfile(path):
        raise SpecError("the cluster file the run was launched with is gone", field="--cluster", value=path,
                        valid="the cluster file the run's plan was made from")
    return path


def _cached_profile_for(report: Mapping) -> str:
    """The cached profile (as ``--profile`` wrote it) whose figures the report's plan was made from, or the one
    already calibrated from this report (which ``_check_planned_from`` then refuses, saying so)."""
    from tangram_launch.launch.planning import cache_dir

    planned = _planned_hash(report)
    profiles = os.path.join(cache_dir(), "profiles")
    if planned is None:
        raise SpecError("the run report does not name the cluster its plan was made from (a report written before "
                        "reports named it)", field="--cluster", valid="the cluster file the run's plan was made from")
    specs = []
    for path in sorted(glob.glob(os.path.join(profiles, "*.yaml"))):
        try:
            specs.append((path, ClusterSpec.load(path)))
        except SpecError:
            continue
    for match in (lambda c: c.content_hash() == planned,
                  lambda c: _calibrated_from(c, str(report.get("plan_hash", "")))):
        for path, spec in specs:
            if match(spec):
                return path
    raise SpecError(f"no cached profile in {profiles} has the figures the run planned from (cluster hash "
                    f"{planned}); a run planned from --cluster FILE calibrates that file", field="--cluster",
                    valid="the cluster file the run's plan was made from")


def _check_planned_from(cluster: ClusterSpec, path: str, report: Mapping, field: str) -> None:
    """Refuse a cluster file whose figures are not the ones the report's predictions were made with."""
    planned = _planned_hash(report)
    if planned is None or cluster.content_hash() == planned:
        return
    if _calibrated_from(cluster, str(report.get("plan_hash", ""))):
        raise SpecError("was already calibrated from this run report; calibrating it again would apply the same "
                        "ratios twice", field=field, value=path,
                        valid="a new run's report (plan and run again with the calibrated file)")
    named = report.get("cluster") or {}
    expected = named.get("path") or f"cluster '{named.get('name')}'"
    raise SpecError(f"its figures (hash {cluster.content_hash()}) are not the ones the run's plan was made from "
                    f"(hash {planned}): the report's ratios were measured against that file's predictions",
                    field=field, value=path, valid=f"the cluster file the run's plan was made from ({expected})")


def run(args: argparse.Namespace) -> int:
    check_output_path(args.output, option="--output")
    if not 0.0 <= args.tolerance < 1.0:
        raise SpecError("is a fraction of the predicted time", field="--tolerance", value=args.tolerance,
                        valid="0 <= t < 1 (0.05 = 5 %)")
    from tangram_launch.launch.run_report import report_file, report_problem

    args.report = report_file(args.report)
    report = parse_json(read_text(args.report, what="run report"), source=args.report)

    problem = report_problem(report)
    if problem:
        raise SpecError(f"not a run report: {problem}", field="RUN_REPORT", value=args.report,
                        valid="run-report.json written by a planned launch")
    path = args.cluster or _named_cluster_file(report) or _cached_profile_for(report)
    field = "--cluster" if args.cluster else "cluster (the one the run report names)"
    cluster = ClusterSpec.load(path)
    _check_planned_from(cluster, path, report, field)
    from tangram_launch.launch.profile_cache import reseal_calibrated, sealed_key

    key = sealed_key(path, cluster.fingerprint)  # a cached profile exactly as sealed: seal it again below
    calibrated, changes = calibrate(cluster, report, tolerance=args.tolerance)
    if not changes:
        print(f"every timed GPU ran within {args.tolerance:.0%} of its prediction (and no stage took more memory "
              f"than that beyond it): {path} is unchanged")
        return 0
    for change in changes:
        print(change.line())
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    calibrated = with_calibration_record(calibrated, report, at=at)  # the layout it ran: a new one is unmeasured
    # a user's own cluster file the report named (not given here, not a cached profile): its calibrated copy goes
    # beside it, the file as written (comments and all) stays; --cluster FILE asks for FILE itself to be rewritten
    beside = None if args.cluster or key is not None else f"{os.path.splitext(path)[0]}.calibrated.yaml"
    out = args.output or beside or path
    if out == path:
        kept = f"{path}.before-calibration-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        shutil.copy2(path, kept)
        print(f"kept the previous cluster file as {kept}")
    tmp = f"{out}.tmp.{os.getpid()}"
    calibrated.dump(tmp)
    os.replace(tmp, out)
    if out == path and key is not None:
        reseal_calibrated(path, key, calibrated.fingerprint, str(report.get("plan_hash", "")), at)
        print(f"calibrated the cached profile {out}: the next launch with --profile on this machine plans from it")
    else:
        print(f"calibrated cluster written to {out}; plan again with --cluster {out}")
    return 0
