"""Predicted against measured, per stage: the run report a planned launch writes into its run directory.

Workers append per-step stage timings to ``RUN_DIR/timings/rank<R>.jsonl`` (``runtime_adapters.stage_timing``); the
launcher reads them (every ``--report-every`` steps and at the end), prints one table and writes
``RUN_DIR/run-report.json``:

    {"plan_hash": ..., "runtime": ..., "cluster": {"name": ..., "hash": ..., "path": the --cluster file},
     "num_microbatches": m, "steps_measured": n,
     "iteration": {"predicted_s": ..., "measured_median_s": ...,
                   "parts": {"predicted": {"pipeline_s", "sync_s", "optimizer_s"},
                             "measured": {"pipeline_s", "sync_s", "optimizer_s"}}},
     "stages": [{"stage": 0, "island": ..., "layers": [0, 3], "nodes": [...],
                 "predicted": {"forward_s": ..., "backward_s": ...,           # per micro-batch
                               "sync_s": ..., "optimizer_s": ...},            # per step
                 "measured": {"forward_s": ..., "backward_s": ..., "steps": n, # medians per micro-batch
                              "pipeline_s": ..., "sync_s": ..., "optimizer_s": ...},  # medians per step
                 "ratio": measured / predicted (forward + backward),
                 "memory": {"predicted_gib", "predicted_allocated_gib", "measured_allocated_gib",
                            "measured_reserved_gib", "ratio"},                # on GPUs only (else absent)
                 "ranks": [{"rank", "node", "local_gpu", "forward_s", "backward_s", "ratio",
                            "sync_s", "sync_ratio", "optimizer_s", "optimizer_ratio"}, ...]}],
     "step_s": [per step, the slowest rank's train_step]}

The first step of a run (shape inference, warm-up) is left out of the medians when later steps exist. ``step_s`` is
the global step time, as Megatron and DeepSpeed users read one: per step, the slowest rank's (every rank leaves the
step's last collective together; the one that started first waited longest), which is also what the example scripts
print on their step lines (:func:`tangram_launch.worker.slowest_rank_s`).

The iteration's parts say where a gap between predicted and measured iterations lies. Predicted: the plan's pipeline
(the simulated schedule) and, of the stage whose tail the plan prices longest, its exposed gradient sync (with the
loss report) and optimizer step (``predicted.stages[].sync_s`` / ``optimizer_s``). Measured, per step, the same
three parts (``runtime_adapters.stage_timing``: to its last backward's end, the optimizer step, the rest) of the
rank whose last backward ended last: the critical path, whose sync is the collectives' own time, while a rank that
finished earlier also waits there for it (that rank's own parts are in ``stages[].ranks``); medians over the steps.
A plan written before stages carried their tail has no predicted parts (null).
Memory, where the workers ran on GPUs: the plan's peak per GPU (``predicted_gib``: what the stage needs, with the
runtime's bytes outside the caching allocator, costmodel.memory.RUNTIME_OVERHEAD_BYTES), that peak without them
(``predicted_allocated_gib``), and the largest allocated and reserved peaks any rank of the stage read
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, every step counted: the optimizer's states appear in
the first); ``ratio`` = measured allocated / predicted allocated.
``tangram-launch calibrate`` folds a report into the cluster file, so the next plan uses what was measured.
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
from typing import Any, Mapping

from tangram_launch.specs.constants import GIB
from tangram_launch.specs.yamlio import dump_text_file

logger = logging.getLogger(__name__)

REPORT_NAME = "run-report.json"
MAX_TIMING_FILE_BYTES = 64 << 20  # a week of steps is a few MB; anything larger is not ours


def read_timings(run_dir: str) -> list[dict]:
    """Every complete line of every rank's timing file (a line being written when we read is skipped)."""
    folder = os.path.join(run_dir, "timings")
    lines: list[dict] = []
    if not os.path.isdir(folder):
        return lines
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not (name.startswith("rank") and name.endswith(".jsonl")) or os.path.islink(path):
            continue
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_TIMING_FILE_BYTES:
            continue
        with open(path, encoding="utf-8") as f:
            for raw in f:
                if not raw.endswith("\n"):
                    break
                try:
                    line = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(line, dict) and isinstance(line.get("step"), int):
                    lines.append(line)
    return lines


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _stage_nodes(plan: Mapping, stage: int) -> list[str]:
    return sorted({r["node"] for r in plan.get("rank_layout", []) if r.get("stage") == stage})


def _rank_rows(plan: Mapping, mine: list[dict], predicted_s: float, predicted_tail: Mapping) -> list[dict]:
    """Per rank of a stage: where it ran and its own medians (a slow GPU among fast ones shows here); with its
    step's sync and optimizer medians, each against the stage's predicted one (``sync_ratio``, ``optimizer_ratio``;
    None where either is missing or nothing was predicted)."""
    where = {r["rank"]: r for r in plan.get("rank_layout", [])}
    rows = []
    for rank in sorted({t["rank"] for t in mine if "rank" in t}):
        lines = [t for t in mine if t.get("rank") == rank]
        fwd = _median([t["forward_s"] / t["microbatches"] for t in lines])
        bwd = _median([t["backward_s"] / t["microbatches"] for t in lines if t.get("backward_spans", 1)])
        slot = where.get(rank, {})
        row = {"rank": rank, "node": slot.get("node"), "local_gpu": slot.get("local_gpu"),
               "forward_s": fwd, "backward_s": bwd,
               "ratio": (fwd + bwd) / predicted_s if fwd is not None and bwd is not None and predicted_s > 0
               else None}
        for key in _TAIL_KEYS:
            got, pred = _median([t[key] for t in lines if _has_parts(t)]), predicted_tail.get(key)
            row[key] = got
            row[key.replace("_s", "_ratio")] = got / pred if got is not None and pred else None
        rows.append(row)
    return rows


def build_report(plan: Mapping, plan_hash: str, timings: list[dict]) -> dict:
    """The report of a plan (as a dict, the plan file's content) and its workers' timing lines."""
    stages_pred = plan["predicted"]["stages"]
    steps = sorted({t["step"] for t in timings})
    kept = [s for s in steps if s != steps[0]] if len(steps) > 1 else steps
    keep = set(kept)
    stages = []
    for i, stage in enumerate(plan["stages"]):
        memory = _stage_memory(stages_pred[i], [t for t in timings if t.get("stage") == i])
        mine = [t for t in timings if t.get("stage") == i and t["step"] in keep and t.get("microbatches")]
        fwd = _median([t["forward_s"] / t["microbatches"] for t in mine])
        bwd = _median([t["backward_s"] / t["microbatches"] for t in mine if t.get("backward_spans", 1)])
        pred_f, pred_b = float(stages_pred[i]["forward_s"]), float(stages_pred[i]["backward_s"])
        ratio = (fwd + bwd) / (pred_f + pred_b) if fwd is not None and bwd is not None and pred_f + pred_b > 0 \
            else None
        parted = [t for t in mine if _has_parts(t)]
        tail = {k: _float_or_none(stages_pred[i].get(k)) for k in _TAIL_KEYS}
        stages.append({"stage": i, "island": stage.get("island"), "layers": list(stage["layers"]),
                       "nodes": _stage_nodes(plan, i),
                       "predicted": {"forward_s": pred_f, "backward_s": pred_b, **tail},
                       "measured": {"forward_s": fwd, "backward_s": bwd, "steps": len({t["step"] for t in mine}),
                                    **{k: _median([t[k] for t in parted]) for k in _STEP_PARTS}},
                       "ratio": ratio, "ranks": _rank_rows(plan, mine, pred_f + pred_b, tail),
                       **({"memory": memory} if memory else {})})
    step_s = []
    for s in steps:
        walls = [t["step_s"] for t in timings if t["step"] == s and t.get("step_s") is not None]
        if walls:
            step_s.append(max(walls))
    steady = step_s[1:] if len(step_s) > 1 else step_s
    cluster = plan.get("cluster") or {}
    return {"plan_hash": plan_hash, "runtime": plan.get("runtime"),
            "cluster": {"name": cluster.get("name"), "hash": cluster.get("hash")},
            "num_microbatches": plan.get("num_microbatches"), "steps_measured": len(kept),
            "iteration": {"predicted_s": float(plan["predicted"]["iteration_time_s"]),
                          "measured_median_s": _median(steady),
                          "parts": {"predicted": _predicted_parts(plan), "measured": _measured_parts(timings, keep)}},
            "stages": stages, "step_s": step_s}


def _stage_memory(predicted: Mapping, lines: list[dict]) -> dict | None:
    """A stage's predicted against measured peak memory per GPU (module docstring); None where no rank read any."""
    allocated = [t["memory_allocated_peak_bytes"] for t in lines
                 if isinstance(t.get("memory_allocated_peak_bytes"), (int, float))]
    reserved = [t["memory_reserved_peak_bytes"] for t in lines
                if isinstance(t.get("memory_reserved_peak_bytes"), (int, float))]
    if not allocated or predicted.get("peak_memory_gib") is None:
        return None
    from tangram_launch.costmodel.memory import RUNTIME_OVERHEAD_BYTES  # GPU reports only: the module imports light

    pred = float(predicted["peak_memory_gib"])
    pred_allocated = max(0.0, pred - RUNTIME_OVERHEAD_BYTES / GIB)
    got = max(allocated) / GIB
    return {"predicted_gib": pred, "predicted_allocated_gib": pred_allocated, "measured_allocated_gib": got,
            "measured_reserved_gib": max(reserved) / GIB if reserved else None,
            "ratio": got / pred_allocated if pred_allocated > 0 else None}


PART_NAMES = ("pipeline", "sync", "optimizer")  # the parts of a step, in order (stage_timing)
_STEP_PARTS = tuple(f"{name}_s" for name in PART_NAMES)  # their keys in a timing line and in iteration.parts
_TAIL_KEYS = ("sync_s", "optimizer_s")


def _has_parts(line: Mapping) -> bool:
    return all(isinstance(line.get(k), (int, float)) for k in _STEP_PARTS)


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _predicted_parts(plan: Mapping) -> dict | None:
    """The plan's pipeline, and the tail of the stage whose sync + optimizer it prices longest (the iteration's)."""
    pred = plan["predicted"]
    tails = [(float(s["sync_s"]) + float(s["optimizer_s"]), float(s["sync_s"]), float(s["optimizer_s"]))
             for s in pred["stages"] if s.get("sync_s") is not None and s.get("optimizer_s") is not None]
    if not tails or len(tails) != len(pred["stages"]):
        return None
    tail, sync, opt = max(tails)
    return {"pipeline_s": float(pred["iteration_time_s"]) - tail, "sync_s": sync, "optimizer_s": opt}


def _measured_parts(timings: list[dict], keep: set) -> dict | None:
    """Per kept step, the parts of the rank whose pipeline ended last (the critical path); medians over the steps
    (None: no rank marked its optimizer step)."""
    rows: dict[str, list[float]] = {k: [] for k in _STEP_PARTS}
    for step in sorted(keep):
        parted = [t for t in timings if t["step"] == step and _has_parts(t)]
        if parted:
            critical = max(parted, key=lambda t: t["pipeline_s"])
            for k in _STEP_PARTS:
                rows[k].append(critical[k])
    if not rows["pipeline_s"]:
        return None
    return {k: _median(v) for k, v in rows.items()}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def format_report(report: Mapping) -> str:
    """One table: per stage, predicted and measured forward and backward per micro-batch, and their ratio."""
    rows = [("stage", "island", "layers", "fwd pred ms", "fwd meas ms", "bwd pred ms", "bwd meas ms", "meas/pred")]
    for s in report["stages"]:
        a, b = s["layers"]
        rows.append((str(s["stage"]), str(s["island"]), f"{a}-{b - 1}", _ms(s["predicted"]["forward_s"]),
                     _ms(s["measured"]["forward_s"]), _ms(s["predicted"]["backward_s"]),
                     _ms(s["measured"]["backward_s"]), "-" if s["ratio"] is None else f"{s['ratio']:.2f}"))
    it = report["iteration"]
    rows.append(("iteration", "", "", _ms(it["predicted_s"]), _ms(it["measured_median_s"]), "", "",
                 f"{it['measured_median_s'] / it['predicted_s']:.2f}"
                 if it["measured_median_s"] and it["predicted_s"] > 0 else "-"))
    n = report["steps_measured"]
    head = f"predicted vs measured ({n} step{'s' if n != 1 else ''} measured, per micro-batch, medians):"
    return "\n".join([head] + _aligned(rows) + _parts_lines(it) + _memory_lines(report["stages"]))


READING_TOLERANCE = 0.10  # a stage within 10 % of its prediction reads as priced right


def reading(report: Mapping, path: str, *, tolerance: float = READING_TOLERANCE) -> str | None:
    """One line after the table that says what its ratios mean, or None where every stage ran within ``tolerance``
    of its prediction. Stages all off in one direction and by about as much (within ``tolerance`` of each other) ran on
    devices of another speed than the plan priced (profiled at another clock or load, or a catalog figure): the plan's
    balance holds. Otherwise the stages named are mispriced against the others, and the next plan can rebalance.
    Either way ``calibrate`` folds the run in."""
    ratios = {s["stage"]: s["ratio"] for s in report["stages"] if s.get("ratio")}
    off = {k: r for k, r in ratios.items() if abs(r - 1.0) > tolerance}
    if not off:
        return None
    fold = f"`tangram-launch calibrate {path}` folds the measured times into the cluster file"
    # all off and within a factor 1 + tolerance of each other: all on one side of 1 (across it they differ by more)
    if len(ratios) > 1 and len(off) == len(ratios) and max(ratios.values()) / min(ratios.values()) <= 1.0 + tolerance:
        mid = statistics.median(ratios.values())
        return (f"every stage ran about {abs(mid - 1.0):.0%} {'slower' if mid > 1.0 else 'faster'} than priced, "
                f"all alike: the devices' speed differs from the plan's figure for them (profiled at another clock "
                f"or load, or a catalog figure), the balance holds; {fold}")
    named = ", ".join(f"stage {k} {abs(r - 1.0):.0%} {'slower' if r > 1.0 else 'faster'}"
                      for k, r in sorted(off.items()))
    rebalance = f", and the next plan rebalances around {'them' if len(off) > 1 else 'it'}" if len(ratios) > 1 else ""
    return f"{named} than priced: {fold}{rebalance}"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _memory_lines(stages: list) -> list[str]:
    """Peak memory per GPU by stage, where the workers read the CUDA allocator's peaks (GPUs only)."""
    with_memory = [s for s in stages if s.get("memory")]
    if not with_memory:
        return []
    rows = [("memory GiB", "pred allocated", "meas allocated", "meas reserved", "meas/pred")]
    for s in with_memory:
        m = s["memory"]
        rows.append((f"stage {s['stage']}", _gib(m["predicted_allocated_gib"]), _gib(m["measured_allocated_gib"]),
                     _gib(m["measured_reserved_gib"]), "-" if m["ratio"] is None else f"{m['ratio']:.2f}"))
    return _aligned(rows)


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def iteration_parts(iteration: Mapping) -> dict[str, tuple[float | None, float | None]]:
    """Part name -> (predicted, measured) seconds per step, of a report's ``iteration``; empty where no rank marked
    its optimizer step (a predicted part is None for a plan written before stages carried their tail)."""
    parts = iteration.get("parts") or {}
    pred, meas = parts.get("predicted") or {}, parts.get("measured") or {}
    if not meas:
        return {}
    return {name: (pred.get(key), meas.get(key)) for name, key in zip(PART_NAMES, _STEP_PARTS)}


def _parts_lines(iteration: Mapping) -> list[str]:
    """The iteration in parts (ms per step), where the workers marked them: what a gap in the iteration is made of."""
    parts = iteration_parts(iteration)
    if not parts:
        return []
    rows = [("iteration ms", *parts, "total"),
            ("predicted", *[_ms(pred) for pred, _ in parts.values()], _ms(iteration["predicted_s"])),
            ("measured", *[_ms(meas) for _, meas in parts.values()], _ms(iteration["measured_median_s"]))]
    return _aligned(rows)


def report_file(path: str, *, history: bool = False) -> str:
    """The run report a command was given: the file itself, or in a run directory (``--run-dir``) its
    run-report.json, else (``history``: a run still going) its adapt/history.json; a SpecError when it holds none."""
    if not os.path.isdir(path):
        return path
    from tangram_launch.errors import SpecError

    names = (REPORT_NAME,) + ((os.path.join("adapt", "history.json"),) if history else ())
    for name in names:
        if os.path.isfile(os.path.join(path, name)):
            return os.path.join(path, name)
    raise SpecError(f"a directory without {' or '.join(names)}", field="RUN_REPORT", value=path,
                    valid=f"a run's {REPORT_NAME}, or the --run-dir of a planned launch (it writes {REPORT_NAME} "
                          "when the run ends)")


def report_problem(report: Any) -> str | None:
    """Why ``report`` is not a run report as this module writes it (None: it is one). A plan file has stages too,
    without measurements: say so rather than fail on a missing key later."""
    if not isinstance(report, Mapping):
        return "not a JSON object"
    stages = report.get("stages")
    if stages is None and isinstance(report.get("adaptations"), list):
        return None  # the adaptive launcher's history of a run that timed nothing yet
    if not isinstance(report.get("plan_hash"), str) or not isinstance(stages, list):
        return "no plan_hash and stages" + (" (a plan file? give its run's run-report.json)"
                                            if "rank_layout" in report else "")
    for i, stage in enumerate(stages):
        if not isinstance(stage, Mapping) or not isinstance(stage.get("measured"), Mapping) or "stage" not in stage:
            return f"stages[{i}] has no measurements"
    return _field_problem(report)


def _is_number(value: Any, *, optional: bool = False) -> bool:
    if value is None:
        return optional
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _field_problem(report: Mapping) -> str | None:
    """The first field the predicted-vs-measured table reads that is not what this module writes, as 'field is
    value, where a planned launch writes ...'; None when every one is (an edited or truncated report is refused by
    name, not by a traceback)."""
    num, obj = "a number or null", "a mapping"
    checks: list[tuple[str, Any, bool, str]] = []  # (field, value, whether it is as written, what it should be)

    def numbers(where: str, values: Mapping, keys: tuple[str, ...]) -> None:
        checks.extend((f"{where}.{key}", values.get(key), _is_number(values.get(key), optional=True), num)
                      for key in keys)

    for i, s in enumerate(report["stages"]):
        index, layers, pred, memory = s.get("stage"), s.get("layers"), s.get("predicted"), s.get("memory")
        checks += [(f"stages[{i}].stage", index, is_index(index), "an integer >= 0"),
                   (f"stages[{i}].layers", layers, isinstance(layers, list) and len(layers) == 2
                    and all(is_index(x) for x in layers), "[first, stop) layer indices"),
                   (f"stages[{i}].ratio", s.get("ratio"), _is_number(s.get("ratio"), optional=True), num),
                   (f"stages[{i}].predicted", pred, isinstance(pred, Mapping), obj),
                   (f"stages[{i}].memory", memory, memory is None or isinstance(memory, Mapping), "a mapping or null")]
        numbers(f"stages[{i}].predicted", pred if isinstance(pred, Mapping) else {}, ("forward_s", "backward_s"))
        numbers(f"stages[{i}].measured", s["measured"], ("forward_s", "backward_s"))
        if isinstance(memory, Mapping):
            numbers(f"stages[{i}].memory", memory, ("predicted_allocated_gib", "measured_allocated_gib",
                                                    "measured_reserved_gib", "ratio"))
    it = report.get("iteration")
    checks.append(("iteration", it, isinstance(it, Mapping), obj))
    if isinstance(it, Mapping):
        numbers("iteration", it, ("predicted_s", "measured_median_s"))
        parts = it.get("parts") or {}
        checks.append(("iteration.parts", parts, isinstance(parts, Mapping), obj))
        for side in ("predicted", "measured") if isinstance(parts, Mapping) else ():
            values = parts.get(side) or {}
            checks.append((f"iteration.parts.{side}", values, isinstance(values, Mapping), obj))
            if isinstance(values, Mapping):
                numbers(f"iteration.parts.{side}", values, _STEP_PARTS)
    n = report.get("steps_measured")
    checks.append(("steps_measured", n, is_index(n), "an integer >= 0"))
    for field, value, ok, valid in checks:
        if not ok:
            return f"{field} is {value!r}, where a planned launch writes {valid}"
    return None


def is_index(value: Any) -> bool:
    """An integer >= 0 (not a bool): a stage, layer or GPU index as a launch writes it."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_report(run_dir: str, report: Mapping) -> str:
    path = os.path.join(run_dir, REPORT_NAME)
    dump_text_file(json.dumps(report, indent=1) + "\n", path)
    return path


def finish(run_dir: str, plan: Mapping, plan_hash: str, *, out: Any, cluster_path: str | None = None) -> str | None:
    """At the end of a planned launch: the table on ``out`` and the report file; None when no worker timed.
    ``cluster_path``: the cluster file the plan was made from (``--cluster``), which ``calibrate`` then finds."""
    timings = read_timings(run_dir)
    if not timings:
        return None
    report = build_report(plan, plan_hash, timings)
    if cluster_path:
        report["cluster"]["path"] = os.path.abspath(cluster_path)
    path = write_report(run_dir, report)
    note = reading(report, path)
    out.write(format_report(report) + (f"\n{note}" if note else "") + f"\nrun report: {path}\n")
    out.flush()
    return path


class ReportEvery(threading.Thread):
    """Prints the table whenever every stage has passed another ``every`` steps (``--report-every N``)."""

    def __init__(self, run_dir: str, plan: Mapping, plan_hash: str, every: int, out: Any, poll_s: float = 2.0):
        super().__init__(name="tangram-report-every", daemon=True)
        self.run_dir, self.plan, self.plan_hash, self.every, self.out = run_dir, plan, plan_hash, every, out
        self.poll_s = poll_s
        self._stop_event = threading.Event()
        self._printed = 0

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            try:
                self.poll()
            except (OSError, KeyError, ValueError, TypeError) as exc:  # a report is never worth a failed run
                logger.debug("run report: %s", exc)

    def poll(self) -> None:
        timings = read_timings(self.run_dir)
        per_stage: dict[int, int] = {}
        for t in timings:
            per_stage[t["stage"]] = max(per_stage.get(t["stage"], 0), t["step"])
        if len(per_stage) < len(self.plan["stages"]):
            return
        done = min(per_stage.values()) // self.every
        if done > self._printed:
            self._printed = done
            self.out.write(format_report(build_report(self.plan, self.plan_hash, timings)) + "\n")
            self.out.flush()

    def stop(self) -> None:
        self._stop_event.set()
