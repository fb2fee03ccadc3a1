"""A hand-written plan at launch: ``tangram-launch --plan my-plan.yaml --cluster FILE --model NAME script.py``.

A hand-written plan names stages by island (:mod:`tangram_launch.planner.manual`) and has no rank layout, so it
cannot be launched as written: the launcher costs it first, exactly as ``tangram-launch plan --plan my-plan.yaml
-o plan.json`` does, and launches the full plan that gives (written, like every launch-time plan, as canonical JSON).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.launch.planning import PlanningRequest
    from tangram_launch.plan import Plan
    from tangram_launch.specs.cluster import ClusterSpec


def cost_hand_written(path: str, cluster: "ClusterSpec", request: "PlanningRequest") -> "Plan":
    """The full Plan of a hand-written one on this cluster, for the launch's model, batch, dtype and runtime: the
    same call as ``tangram-launch plan --plan``, from the same planning request."""
    from tangram_launch.islands import build_islands
    from tangram_launch.planner.manual import cost_manual_plan, load_manual_plan

    islands = build_islands(cluster, dtype=request.training.dtype)
    manual = load_manual_plan(path, num_layers=request.model.num_layers,
                              island_names=[i.name for i in islands.islands])
    return cost_manual_plan(manual, cluster, request.model, request.training, runtime=request.runtime,
                            parallelizer=request.parallelizer, islands=islands, options=request.options)
