"""Fold a run report's measurements into the cluster file, so the next plan starts from what was measured.

For each rank the report timed, ``ratio`` = measured (forward + backward) / predicted, per micro-batch. Its GPU's
compute figures are scaled by 1 / ratio: every dtype's TFLOP/s, the memory bandwidth (element-wise work), the
profiler's measured GEMM rates and GEMM-sweep points and memory bandwidth (which the cost model reads before the spec
sheet's), and any measured layer times (by ratio), so a stage on that GPU is predicted as it ran, whichever term
dominates it. A GPU the run did not time (the plan left it out) takes the median ratio of the timed GPUs of its type,
on its node if any ran there, else in the cluster: its figures came from the same profiler and miss what theirs
missed, and left as they were they would look that much faster than its timed twins, so the next plan would move
the work onto it (the straggler re-plan, whose report names only the GPUs that slowed down, turns this off). A
GPU whose ratio is within ``tolerance`` of 1 is left as it is. Each changed GPU records what was applied under
``measured.calibration`` (the factor, the report's plan hash, the stage), and a later report calibrates from there:
its predictions were made with the calibrated figures, so factors compound as they should.

Memory, where the workers ran on GPUs (the report's ``stages[].memory``): a stage whose allocated peak exceeded the
allocated bytes its plan predicted by more than ``tolerance`` has each of its GPUs' ``memory_gib`` taken as the
physical figure / that ratio, so the next plan leaves that GPU what the run showed its stages really take (a stage
that used less is left alone: one run's slack is no reason to plan past the device). The physical figure and the
ratio are kept under ``measured.memory_calibration``; a later report's ratio replaces the earlier one (predicted
bytes never depend on the capacity, so nothing compounds).

Communication is not recalibrated here: the report times compute (hooks around the stage's forward and backward),
not links. Figures are fitted to the stages the report ran: the calibrated file records each report's stage layout,
and a plan of another layout is warned about at launch (:func:`unmeasured_layout_line`).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.launch.run_report import is_index
from tangram_launch.specs.cluster import ClusterSpec, GPUSpec

DEFAULT_TOLERANCE = 0.05
_LAYER_TIME_KEYS = ("layer_forward_s", "layer_forward_backward_s")
# measured / predicted ratios a report may carry: beyond them a stage did not run the plan it was priced for (or the
# file was edited), and scaling the figures by the inverse would write nonsense into the cluster file
RATIO_RANGE = (1e-3, 1e3)


@dataclasses.dataclass(frozen=True)
class Change:
    node: str
    local_gpu: int
    stage: int | None  # None: not timed
    factor: float  # measured / predicted: > 1 ran slower than planned
    like: str | None = None  # not timed: the factor of the timed GPUs this names

    def line(self) -> str:
        way = "slower" if self.factor > 1 else "faster"
        if self.like:
            return (f"{self.node} GPU {self.local_gpu} (not timed, as {self.like}): {self.factor:.2f}x ({way}); its "
                    f"compute figures scaled by {1 / self.factor:.3f}")
        return (f"{self.node} GPU {self.local_gpu} (stage {self.stage}): ran {self.factor:.2f}x the predicted time "
                f"({way}); its compute figures scaled by {1 / self.factor:.3f}")


@dataclasses.dataclass(frozen=True)
class MemoryChange:
    node: str
    local_gpu: int
    stage: int
    factor: float  # measured / predicted allocated peak
    memory_gib: float  # what the next plan takes as the GPU's memory
    physical_gib: float

    def line(self) -> str:
        return (f"{self.node} GPU {self.local_gpu} (stage {self.stage}): its stage allocated {self.factor:.2f}x the "
                f"predicted memory; the next plan counts {self.memory_gib:.4g} of its {self.physical_gib:.4g} GiB")


def _ratio(value: Any, field: str, what: str) -> float:
    """A measured/predicted ratio read from the report: a number inside RATIO_RANGE, else a SpecError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{what} must be a number", field=field, value=value,
                        valid=f"{RATIO_RANGE[0]:g} < ratio < {RATIO_RANGE[1]:g}")
    if not RATIO_RANGE[0] < value < RATIO_RANGE[1]:
        raise SpecError(f"{what} must be a positive number a run can measure", field=field, value=value,
                        valid=f"{RATIO_RANGE[0]:g} < ratio < {RATIO_RANGE[1]:g} (figures scaled by its inverse)")
    return float(value)


def _check_index(value: Any, field: str, what: str) -> None:
    if not is_index(value):
        raise SpecError(what, field=field, value=value, valid="an integer >= 0")


def _check_mapping(value: Any, field: str, valid: str) -> None:
    if not isinstance(value, Mapping):
        raise SpecError("expected a mapping", field=field, value=type(value).__name__, valid=valid)


def _stage_rows(report: Mapping) -> list[tuple[int, str, Mapping, list[tuple[str, str, int, Mapping]]]]:
    """Each stage of the report as (its index, its field path, the stage, its ranks as (field path, node, local
    GPU, row)), every one of those checked: a row whose node or GPU is unreadable is refused by name, never skipped
    (a skipped rank would leave its GPU to take its twins' ratio)."""
    stages = report.get("stages") if isinstance(report, Mapping) else None
    if not isinstance(stages, list):
        raise SpecError("not a run report: expected a list of stages", field="stages", value=type(stages).__name__,
                        valid="run-report.json written by a planned launch")
    out = []
    for k, stage in enumerate(stages):
        where = f"stages[{k}]"
        _check_mapping(stage, where, "a stage's entry")
        index = stage.get("stage")
        _check_index(index, f"{where}.stage", "expected the stage's index")
        ranks = stage.get("ranks") or []
        if not isinstance(ranks, list):
            raise SpecError("expected a list of ranks", field=f"{where}.ranks", value=type(ranks).__name__,
                            valid="one entry per rank of the stage")
        rows = []
        for j, row in enumerate(ranks):
            rwhere = f"{where}.ranks[{j}]"
            _check_mapping(row, rwhere, "a rank's entry")
            node, gpu = row.get("node"), row.get("local_gpu")
            if node is None:
                continue  # a rank the run did not place on a named node: nothing to calibrate
            if not isinstance(node, str) or not node:
                raise SpecError("expected the rank's node name", field=f"{rwhere}.node", value=node,
                                valid="a node name of the cluster file")
            _check_index(gpu, f"{rwhere}.local_gpu", "expected the rank's GPU index on its node")
            rows.append((rwhere, node, gpu, row))
        out.append((index, where, stage, rows))
    return out


def memory_factors(report: Mapping) -> dict[tuple[str, int], tuple[int, float]]:
    """(node, local GPU) -> (stage, measured / predicted allocated peak) for every GPU of a stage whose workers read
    the CUDA allocator's peaks (none on CPU runs)."""
    out: dict[tuple[str, int], tuple[int, float]] = {}
    for index, where, stage, rows in _stage_rows(report):
        memory = stage.get("memory") or {}
        _check_mapping(memory, f"{where}.memory", "the stage's memory figures")
        if memory.get("ratio") is None:
            continue
        ratio = _ratio(memory["ratio"], f"{where}.memory.ratio", "a stage's measured/predicted memory ratio")
        for _, node, gpu, _ in rows:
            out[(node, gpu)] = (index, ratio)
    return out


def _memory_calibrated(gpu: GPUSpec, factor: float, stage: int, plan_hash: str) -> GPUSpec:
    physical = gpu.physical_memory_gib
    measured = {**gpu.measured, "memory_calibration": {"factor": _sig(factor), "memory_gib": physical,
                                                       "plan_hash": plan_hash, "stage": stage,
                                                       "source": "run-report.json"}}
    return dataclasses.replace(gpu, memory_gib=_sig(physical / factor), measured=measured)


def rank_factors(report: Mapping) -> dict[tuple[str, int], tuple[int, float]]:
    """(node, local GPU) -> (stage, measured / predicted), from each rank's own medians."""
    out: dict[tuple[str, int], tuple[int, float]] = {}
    for index, _, _, rows in _stage_rows(report):
        for rwhere, node, gpu, row in rows:
            if row.get("ratio") is None:
                continue  # a rank that timed nothing
            out[(node, gpu)] = (index, _ratio(row["ratio"], f"{rwhere}.ratio", "a rank's measured/predicted ratio"))
    return out


def _sig(value: float) -> float:
    """Four significant digits: what a measurement supports, and a cluster file a person can read."""
    return float(f"{value:.4g}")


def _measured_rates_scaled(measured: Mapping[str, Any], factor: float) -> dict[str, Any]:
    """The profiler's figures, which the cost model prefers to the spec sheet's, scaled alike: GEMM TFLOP/s per
    dtype, each GEMM-sweep point's TFLOP/s, the memory bandwidth (rates / factor) and layer times (x factor)."""
    out = dict(measured)
    for key in _LAYER_TIME_KEYS:
        if isinstance(out.get(key), Mapping):
            out[key] = {k: _sig(v * factor) for k, v in out[key].items()}
    if isinstance(out.get("gemm_tflops"), Mapping):
        out["gemm_tflops"] = {k: (_sig(v / factor) if _is_rate(v) else v) for k, v in out["gemm_tflops"].items()}
    if isinstance(out.get("gemm_sweep_tflops"), Mapping):
        out["gemm_sweep_tflops"] = {dtype: _sweep_scaled(rows, factor)
                                    for dtype, rows in out["gemm_sweep_tflops"].items()}
    if _is_rate(out.get("memory_bandwidth_GBps")):
        out["memory_bandwidth_GBps"] = _sig(out["memory_bandwidth_GBps"] / factor)
    return out


def _sweep_scaled(rows: Any, factor: float) -> Any:
    """GEMM-sweep rows ``[M, N, K, TFLOP/s]`` with the rate divided by ``factor`` (anything else as it is)."""
    if not isinstance(rows, list):
        return rows
    return [[*row[:-1], _sig(row[-1] / factor)] if isinstance(row, (list, tuple)) and row and _is_rate(row[-1])
            else row for row in rows]


def _is_rate(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _scaled(gpu: GPUSpec, factor: float, stage: int | None, plan_hash: str) -> GPUSpec:
    tflops = {k: (None if v is None else _sig(v / factor)) for k, v in gpu.tflops.items()}
    measured = _measured_rates_scaled(gpu.measured, factor)
    before = measured.get("calibration") or {}
    measured["calibration"] = {"factor": _sig(factor * float(before.get("factor", 1.0))), "plan_hash": plan_hash,
                               "stage": stage, "source": "run-report.json"}
    changes: dict[str, Any] = {"tflops": tflops, "measured": measured}
    for name in (f.name for f in dataclasses.fields(gpu)):
        if name.startswith("memory_bandwidth"):  # the element-wise terms run at this rate
            changes[name] = _sig(getattr(gpu, name) / factor)
    return dataclasses.replace(gpu, **changes)


def calibrate(cluster: ClusterSpec, report: Mapping, *, tolerance: float = DEFAULT_TOLERANCE,
              untimed_as_twins: bool = True) -> tuple[ClusterSpec, list[Change | MemoryChange]]:
    """The cluster with every timed GPU's figures scaled by what the report measured (compute; on GPUs, memory
    where a stage took more than predicted), and what changed.

    ``untimed_as_twins=False`` leaves the GPUs the report does not name as they are (a straggler re-plan's report
    names only the GPUs that slowed down)."""
    factors = rank_factors(report)
    memory = memory_factors(report)
    if not factors:
        raise SpecError("the report has no per-rank measurements to calibrate from (did the run time its stages? "
                        "a planned launch writes them)", field="stages[].ranks")
    names = set(cluster.node_names)
    missing = sorted({node for node, _ in (*factors, *memory)} - names)
    if missing:
        raise SpecError("the report's nodes are not in this cluster file (calibrate the file the plan was made "
                        "from)", field="stages[].ranks.node", value=", ".join(missing),
                        valid=", ".join(cluster.node_names))
    sizes = {node.name: len(node.gpus) for node in cluster.nodes}
    for node, gpu in sorted({*factors, *memory}):
        if gpu >= sizes[node]:
            raise SpecError(f"the report times a GPU that node {node} of this cluster file does not have (calibrate "
                            "the file the plan was made from)", field="stages[].ranks.local_gpu", value=gpu,
                            valid=f"0..{sizes[node] - 1}")
    changes: list[Change | MemoryChange] = []
    nodes = []
    plan_hash = str(report.get("plan_hash", ""))
    for node in cluster.nodes:
        gpus = list(node.gpus)
        for i, gpu in enumerate(gpus):
            stage_m, ratio_m = memory.get((node.name, i), (0, 1.0))
            if ratio_m > 1.0 + tolerance:
                gpu = gpus[i] = _memory_calibrated(gpu, ratio_m, stage_m, plan_hash)
                changes.append(MemoryChange(node.name, i, stage_m, ratio_m, gpu.memory_gib, gpu.physical_memory_gib))
            if (node.name, i) in factors:
                (stage, factor), like = factors[(node.name, i)], None
            elif untimed_as_twins:
                stage, (factor, like) = None, _as_timed_twins(cluster, node.name, gpu.type, factors)
            else:
                continue
            if (stage is None and like is None) or abs(factor - 1.0) <= tolerance:
                continue
            gpus[i] = _scaled(gpu, factor, stage, plan_hash)
            changes.append(Change(node.name, i, stage, factor, like))
        nodes.append(dataclasses.replace(node, gpus=tuple(gpus)))
    return dataclasses.replace(cluster, nodes=tuple(nodes)), changes


def _as_timed_twins(cluster: ClusterSpec, node: str, gpu_type: str,
                    factors: Mapping[tuple[str, int], tuple[int, float]]) -> tuple[float, str | None]:
    """(median factor, what it came from) of the timed GPUs of ``gpu_type``: on ``node`` if any ran there, else
    anywhere in the cluster; (1.0, None) when none of that type was timed."""
    kinds = {(n.name, i): g.type for n in cluster.nodes for i, g in enumerate(n.gpus)}
    twins = [(n, f) for (n, i), (_, f) in factors.items() if kinds.get((n, i)) == gpu_type]
    here = [f for n, f in twins if n == node]
    chosen, where = (here, f"the timed {gpu_type} devices on {node}") if here else \
        ([f for _, f in twins], f"the timed {gpu_type} devices")
    if not chosen:
        return 1.0, None
    return statistics.median(chosen), where


# --- the layouts a cluster's figures were calibrated from -------------------------------------------------------------
# Calibration fits each GPU's figures to the stage it ran in. A later plan may put the GPUs into another layout (two
# CPUs that were two stages become one data-parallel stage; a stage takes other layers), whose prediction no run
# report has measured: the launcher says so, once, at planning time (:func:`unmeasured_layout_line`).

CALIBRATIONS_KEY = "calibrations"  # under the cluster file's ``profile:``: [{plan_hash, at, layout}], oldest first


def report_layout(report: Mapping) -> list[dict]:
    """The stage layout a run report measured: per stage, its layers [start, stop) and its GPUs [node, local GPU]
    (those whose ranks the report timed)."""
    return [{"layers": [int(v) for v in stage["layers"]],
             "gpus": sorted([str(r["node"]), int(r["local_gpu"])] for r in stage.get("ranks") or []
                            if r.get("node") is not None and r.get("local_gpu") is not None)}
            for stage in report.get("stages") or []]


def plan_layout(plan: Mapping) -> list[dict]:
    """A plan's stage layout (a plan file's content), in :func:`report_layout`'s form."""
    gpus: dict[int, list] = {}
    for r in plan.get("rank_layout") or []:
        gpus.setdefault(int(r["stage"]), []).append([str(r["node"]), int(r["local_gpu"])])
    return [{"layers": [int(v) for v in stage["layers"]], "gpus": sorted(gpus.get(i, []))}
            for i, stage in enumerate(plan.get("stages") or [])]


def with_calibration_record(cluster: ClusterSpec, report: Mapping, *, at: str) -> ClusterSpec:
    """The cluster with the report's run (plan hash, time, layout) appended to ``profile.calibrations``."""
    entry = {"plan_hash": str(report.get("plan_hash", "")), "at": at, "layout": report_layout(report)}
    profile = dict(cluster.profile)
    profile[CALIBRATIONS_KEY] = [*calibration_records(cluster), entry]
    return dataclasses.replace(cluster, profile=profile)


def calibration_records(cluster: ClusterSpec) -> list[Mapping]:
    """What :func:`with_calibration_record` recorded (none in a file calibrated before records kept the layout)."""
    found = cluster.profile.get(CALIBRATIONS_KEY)
    return [c for c in found if isinstance(c, Mapping)] if isinstance(found, list) else []


def _layout_key(layout: Any) -> tuple | None:
    try:
        return tuple((tuple(int(v) for v in s["layers"]), tuple(sorted((str(n), int(g)) for n, g in s["gpus"])))
                     for s in layout)
    except (KeyError, TypeError, ValueError):
        return None


def unmeasured_layout_line(cluster: ClusterSpec, plan: Mapping) -> str | None:
    """One warning line when ``cluster``'s figures were calibrated from run reports and ``plan``'s stage layout
    (layers and GPUs per stage) is none of theirs; None otherwise (not calibrated, or calibrated before records
    kept the layout, or a layout a report measured)."""
    records = calibration_records(cluster)
    known = {_layout_key(c.get("layout")) for c in records} - {None}
    if not known or _layout_key(plan_layout(plan)) in known:
        return None
    return (f"this plan's stage layout (layers, GPUs per stage) is none of the {len(records)} "
            "run(s) these calibrated figures came from: its prediction is unmeasured; after this run, "
            "`tangram-launch calibrate RUN_DIR/run-report.json` again measures it")
