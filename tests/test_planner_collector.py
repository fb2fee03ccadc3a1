"""collector.fewer_collections: the planner's garbage-collector thresholds are raised for the search only."""
from __future__ import annotations

import gc

import pytest

from tangram_launch.planner.collector import PLANNING_THRESHOLDS, fewer_collections


def test_thresholds_are_raised_inside_and_restored_after_even_on_error():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with fewer_collections():
            assert gc.get_threshold() == PLANNING_THRESHOLDS
        assert gc.get_threshold() == (700, 10, 10)
        with pytest.raises(RuntimeError):
            with fewer_collections():
                raise RuntimeError("planning failed")
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(10**6, 5, 500)  # never lowered: a caller that wants fewer still gets fewer
        with fewer_collections():
            assert gc.get_threshold() == (10**6, PLANNING_THRESHOLDS[1], 500)
    finally:
        gc.set_threshold(*before)


def test_search_leaves_the_thresholds_as_it_found_them():
    from tangram_launch.islands import build_islands
    from tangram_launch.planner.api import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec
    cluster = ClusterSpec.from_dict({
        "name": "two", "network": {"default": {"bandwidth_gbps": 12.5, "latency_us": 10}},
        "nodes": [{"name": "a", "gpu": "a100-80gb", "count": 2}, {"name": "b", "gpu": "v100-32gb", "count": 2}]})
    training = TrainingSpec(global_batch=8, seq_len=64, dtype="fp16")
    before = gc.get_threshold()
    result = search(cluster, load_model("tiny"), training, islands=build_islands(cluster, dtype="fp16"),
                    options=PlannerOptions(max_workers=1, progress=False))
    assert result.plan.stages
    assert gc.get_threshold() == before
