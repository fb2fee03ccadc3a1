"""Fold a run report's measurements into the cluster file, so the next plan starts from what was measured.

For each rank the report timed, ``ratio`` = measured (forward + backward) / predicted, per micro-batch. Its GPU's
compute figures are scaled by 1 / ratio: every dtype's TFLOP/s, the memory bandwidth (element-wise work), and any
measured layer times (by ratio), so a stage on that GPU is predicted as it ran, whichever term dominates it. A GPU
whose ratio is within ``tolerance`` of 1 is left as it is. Each changed GPU records what was applied under
``measured.calibration`` (the factor, the report's plan hash, the stage), and a later report calibrates from there:
its predictions were made with the calibrated figures, so factors compound as they should.

Communication is not recalibrated here: the report times compute (hooks around the stage's forward and backward),
not links.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from tangram_launch.errors import SpecError
from tangram_launch.specs.cluster import ClusterSpec, GPUSpec

DEFAULT_TOLERANCE = 0.05
_LAYER_TIME_KEYS = ("layer_forward_s", "layer_forward_backward_s")


@dataclasses.dataclass(frozen=True)
class Change:
    node: str
    local_gpu: int
    stage: int
    factor: float  # measured / predicted: > 1 ran slower than planned

    def line(self) -> str:
        way = "slower" if self.factor > 1 else "faster"
        return (f"{self.node} GPU {self.local_gpu} (stage {self.stage}): ran {self.factor:.2f}x the predicted time "
                f"({way}); its compute figures scaled by {1 / self.factor:.3f}")


def rank_factors(report: Mapping) -> dict[tuple[str, int], tuple[int, float]]:
    """(node, local GPU) -> (stage, measured / predicted), from each rank's own medians."""
    try:
        stages = report["stages"]
        out: dict[tuple[str, int], tuple[int, float]] = {}
        for stage in stages:
            for row in stage.get("ranks") or []:
                if row.get("ratio") is None or row.get("node") is None:
                    continue
                ratio = float(row["ratio"])
                if not ratio > 0 or ratio == float("inf"):
                    raise SpecError("a rank's measured/predicted ratio must be a positive number",
                                    field=f"stages[{stage['stage']}].ranks.ratio", value=row["ratio"])
                out[(str(row["node"]), int(row["local_gpu"]))] = (int(stage["stage"]), ratio)
        return out
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"not a run report ({exc.__class__.__name__}: {exc})", field="stages") from None


def _sig(value: float) -> float:
    """Four significant digits: what a measurement supports, and a cluster file a person can read."""
    return float(f"{value:.4g}")


def _scaled(gpu: GPUSpec, factor: float, stage: int, plan_hash: str) -> GPUSpec:
    tflops = {k: (None if v is None else _sig(v / factor)) for k, v in gpu.tflops.items()}
    measured: dict[str, Any] = dict(gpu.measured)
    for key in _LAYER_TIME_KEYS:
        if isinstance(measured.get(key), Mapping):
            measured[key] = {k: _sig(v * factor) for k, v in measured[key].items()}
    before = measured.get("calibration") or {}
    measured["calibration"] = {"factor": _sig(factor * float(before.get("factor", 1.0))), "plan_hash": plan_hash,
                               "stage": stage, "source": "run-report.json"}
    changes: dict[str, Any] = {"tflops": tflops, "measured": measured}
    for name in (f.name for f in dataclasses.fields(gpu)):
        if name.startswith("memory_bandwidth"):  # the element-wise terms run at this rate
            changes[name] = _sig(getattr(gpu, name) / factor)
    return dataclasses.replace(gpu, **changes)


def calibrate(cluster: ClusterSpec, report: Mapping, *,
              tolerance: float = DEFAULT_TOLERANCE) -> tuple[ClusterSpec, list[Change]]:
    """The cluster with every timed GPU's figures scaled by what the report measured, and what changed."""
    factors = rank_factors(report)
    if not factors:
        raise SpecError("the report has no per-rank measurements to calibrate from (did the run time its stages? "
                        "a planned launch writes them)", field="stages[].ranks")
    names = set(cluster.node_names)
    missing = sorted({node for node, _ in factors} - names)
    if missing:
        raise SpecError("the report's nodes are not in this cluster file (calibrate the file the plan was made "
                        "from)", field="stages[].ranks.node", value=", ".join(missing),
                        valid=", ".join(cluster.node_names))
    changes: list[Change] = []
    nodes = []
    plan_hash = str(report.get("plan_hash", ""))
    for node in cluster.nodes:
        gpus = list(node.gpus)
        for i, gpu in enumerate(gpus):
            stage, factor = factors.get((node.name, i), (None, 1.0))
            if stage is None or abs(factor - 1.0) <= tolerance:
                continue
            gpus[i] = _scaled(gpu, factor, stage, plan_hash)
            changes.append(Change(node.name, i, stage, factor))
        nodes.append(dataclasses.replace(node, gpus=tuple(gpus)))
    return dataclasses.replace(cluster, nodes=tuple(nodes)), changes
