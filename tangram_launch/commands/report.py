"""A run's history: predicted against measured, every adaptation, and a timeline of its plans.

    tangram-launch report RUN_DIR[/run-report.json]

Reads the report a planned launch writes (``RUN_DIR/adapt/history.json`` while the run still goes works too; given
the directory, the report, else the history) and prints the last plan's predicted-vs-measured table, one row per
adaptation (cause, old and new plan, predicted and measured gain, downtime; a switch's new stages) and a small
timeline: one row per plan, start-up ``-``, training ``#``, a switch ``>``, a switch a launch without ``--adapt``
would have made ``?``, a decision that kept the plan ``|``.
"""
from __future__ import annotations

import argparse
from typing import Any, Mapping, Sequence

from tangram_launch.errors import SpecError
from tangram_launch.specs.limits import parse_json, read_text

TIMELINE_COLUMNS = 60


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", metavar="RUN_REPORT",
                        help="run-report.json (or adapt/history.json) of a run, or the run's --run-dir")
    parser.add_argument("--width", type=int, default=TIMELINE_COLUMNS, help="timeline columns (default 60)")


def _s(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def history_table(adaptations: Sequence[Mapping[str, Any]]) -> list[str]:
    if not adaptations:
        return ["no adaptation: no stage ran slower than expected for a whole window"]
    rows = [("step", "decision", "plan", "pred gain s/step", "meas gain s/step", "downtime s", "cause")]
    for a in adaptations:
        decision = "switched" if a.get("switched") else ("would switch" if a.get("switch") else "kept")
        rows.append((str(a.get("step")), decision, f"{str(a.get('old_plan_hash'))[:8]} -> "
                     f"{str(a.get('new_plan_hash'))[:8]}", _s(a.get("predicted_gain_s_per_step")),
                     _s(a.get("measured_gain_s_per_step")), _s(a.get("downtime_s"), 1), str(a.get("cause"))))
    lines = [f"adaptations ({len(adaptations)}):"] + _table(rows)
    for a in adaptations:
        lines.append(f"  step {a.get('step')}: {a.get('reason')}")
        if a.get("new_stages"):  # a switch's layout: layers [first, end) per stage and the GPUs that run it
            lines.append("    new stages: " + "; ".join(
                f"layers {st['layers'][0]}-{st['layers'][1] - 1} on {','.join(st.get('gpus') or ()) or '?'}"
                for st in a["new_stages"] if len(st.get("layers") or ()) == 2))
    return lines


def timeline(segments: Sequence[Mapping[str, Any]], adaptations: Sequence[Mapping[str, Any]],
             width: int = TIMELINE_COLUMNS) -> list[str]:
    """One row per segment over the run's wall clock."""
    if not segments:
        return []
    t0 = min(s["started_unix_s"] for s in segments)
    t1 = max(s.get("ended_unix_s") or s.get("first_step_unix_s") or s["started_unix_s"] for s in segments)
    span = max(t1 - t0, 1e-9)

    def col(t: float) -> int:
        return min(width - 1, max(0, int((t - t0) / span * width)))

    lines = [f"timeline: {span:.0f} s, one column = {span / width:.1f} s "
             "(- start-up, # training, > switch, ? would switch (no --adapt), | kept the plan)"]
    for seg in segments:
        row = [" "] * width
        start = col(seg["started_unix_s"])
        first = col(seg.get("first_step_unix_s") or seg.get("ended_unix_s") or seg["started_unix_s"])
        end = col(seg.get("ended_unix_s") or t1)
        for i in range(start, first):
            row[i] = "-"
        for i in range(first, end + 1):
            row[i] = "#"
        for a in adaptations:
            at = a.get("decided_unix_s")
            if a.get("old_plan_hash") == seg["plan_hash"] and at is not None and start <= col(at) <= end:
                row[col(at)] = ">" if a.get("switched") else ("?" if a.get("switch") else "|")
        lines.append(f"  plan {seg['plan_hash'][:8]} |{''.join(row)}|")
    return lines


def format_history(report: Mapping[str, Any], width: int = TIMELINE_COLUMNS) -> str:
    lines: list[str] = []
    if report.get("stages"):
        from tangram_launch.launch.run_report import format_report

        lines += [f"last plan {str(report.get('plan_hash'))[:8]}: " + format_report(report), ""]
    lines += history_table(report.get("adaptations") or [])
    picture = timeline(report.get("segments") or [], report.get("adaptations") or [], width)
    if picture:
        lines += [""] + picture
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not 10 <= args.width <= 400:
        raise SpecError("timeline width must be 10..400 columns", field="--width", value=args.width, valid="10..400")
    from tangram_launch.launch.run_report import report_file, report_problem

    args.report = report_file(args.report, history=True)
    report = parse_json(read_text(args.report, what="run report"), source=args.report)

    problem = report_problem(report)
    if problem:
        raise SpecError(f"not a run report: {problem}", source=args.report, field="RUN_REPORT", value=args.report,
                        valid="run-report.json written by a planned launch")
    try:
        text = format_history(report, args.width)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SpecError(f"not a run report ({type(exc).__name__}: {exc})", source=args.report,
                        field="adaptations") from None
    print(text)
    return 0
