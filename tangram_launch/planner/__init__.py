"""The Tangram planner (paper §5): slices and pruning (slices.py), parallel queries (query_pool.py), the composition
DP (compose.py, checked by reference.py), the Plan (build.py), baselines and manual plans. Entry point:
``tangram_launch.planner.make_plan`` (plan_search.py)."""
from tangram_launch.planner.options import PlannerOptions
from tangram_launch.planner.plan_search import make_plan, search

__all__ = ["PlannerOptions", "make_plan", "search"]
