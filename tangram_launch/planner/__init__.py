"""The Tangram planner (paper §5): slices and pruning (slices.py), parallel queries (query_pool.py), the composition
DP (compose.py, checked by reference.py), the Plan (build.py), baselines and manual plans. Entry point:
``tangram_launch.planner.api.make_plan``."""
from tangram_launch.planner.api import PlannerOptions, make_plan, search

__all__ = ["PlannerOptions", "make_plan", "search"]
