"""The run's adaptation history: its segments (one per plan) and every decision, into ``run-report.json``.

Kept in ``RUN_DIR/adapt/history.json`` while the run goes (``tangram-launch report`` reads either file) and merged
into the final ``run-report.json`` as::

    "segments":    [{"index", "plan_hash", "plan_path", "nproc", "start_step", "started_unix_s",
                     "first_step_unix_s", "ended_unix_s", "steps", "step_s_median"}, ...]
    "adaptations": [{"step" (absolute), "cause", "switch", "acted", "reason", "old_plan_hash", "new_plan_hash",
                     "current_step_s", "predicted_step_s", "predicted_gain_s_per_step", "horizon_steps",
                     "predicted_gain_s", "switch_cost_s", "decided_unix_s", "at_step", "downtime_s",
                     "measured_step_s", "measured_gain_s_per_step", "factors",
                     "new_stages" (a switch's: [{"layers": [first, end), "gpus": ["node:local", ...]}, ...])}, ...]
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping

from tangram_launch.launch.adapt.handshake import adapt_dir
from tangram_launch.specs.yamlio import dump_text_file

logger = logging.getLogger(__name__)

HISTORY_NAME = "history.json"


def _short(plan_hash: str | None) -> str:
    return (plan_hash or "?")[:8]


def adaptation_line(entry: Mapping[str, Any]) -> str:
    """The one log line of an adaptation: cause, plans, predicted then measured gain, downtime."""
    head = "adapt" if entry.get("acted") else "adapt (not acting: no --adapt)"
    verdict = "switched" if entry.get("switched") else ("would switch" if entry.get("switch") else "kept the plan")
    gain = f"predicted gain {entry['predicted_gain_s_per_step']:.3f} s/step"
    if entry.get("measured_gain_s_per_step") is not None:
        gain += f", measured {entry['measured_gain_s_per_step']:.3f} s/step"
    down = f"; downtime {entry['downtime_s']:.1f} s" if entry.get("downtime_s") is not None else ""
    return (f"{head}: step {entry['step']}: {entry['cause']}; plan {_short(entry['old_plan_hash'])} -> "
            f"{_short(entry['new_plan_hash'])}: {verdict} ({entry['reason']}); {gain}{down}")


class History:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.segments: list[dict[str, Any]] = []
        self.adaptations: list[dict[str, Any]] = []

    def to_dict(self) -> dict[str, Any]:
        return {"segments": self.segments, "adaptations": self.adaptations}

    def save(self) -> None:
        path = os.path.join(adapt_dir(self.run_dir), HISTORY_NAME)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        dump_text_file(json.dumps(self.to_dict(), indent=1), path)

    def merge_into_report(self) -> str:
        """Add the history to ``run-report.json`` (written by the last segment; created when it wrote none)."""
        from tangram_launch.launch.run_report import REPORT_NAME, write_report

        report: dict[str, Any] = {}
        try:
            with open(os.path.join(self.run_dir, REPORT_NAME), encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError):
            pass
        report.update(self.to_dict())
        return write_report(self.run_dir, report)
