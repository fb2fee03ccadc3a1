"""collector.no_collections: the cyclic garbage collector is off for a search only, and a search makes no
reference cycles, so it loses no memory to that."""
from __future__ import annotations

import gc

import pytest

from tangram_launch.planner.gc_pause import no_collections


def _search(runtime: str = "torch"):
    from tangram_launch.islands import build_islands
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec
    cluster = ClusterSpec.from_dict({
        "name": "three", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 10}},
        "nodes": [{"name": "a", "gpu": "a100-80gb", "count": 2}, {"name": "b", "gpu": "v100-32gb", "count": 2},
                  {"name": "c", "gpu": "t4", "count": 2}]})
    training = TrainingSpec(global_batch=8, seq_len=64, dtype="fp16")
    return search(cluster, load_model("tiny"), training, runtime=runtime, islands=build_islands(cluster, dtype="fp16"),
                  options=PlannerOptions(max_workers=1, progress=False))


def test_the_collector_is_off_inside_and_as_it_was_after_even_on_error():
    was_on = gc.isenabled()
    try:
        gc.enable()
        with no_collections():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(RuntimeError):
            with no_collections():
                raise RuntimeError("planning failed")
        assert gc.isenabled()
        gc.disable()  # a caller that turned it off keeps it off
        with no_collections():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        (gc.enable if was_on else gc.disable)()


def test_search_turns_the_collector_back_on_with_what_it_kept_in_the_oldest_generation():
    assert gc.isenabled()
    assert _search().plan.stages
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 1000  # not tens of thousands of young objects for the next collection to scan


def test_a_callers_frozen_objects_stay_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with no_collections():
            kept = [[i] for i in range(10_000)]
        # not unfrozen (that would read 0) and the block's objects not frozen with them (that would add 10,000);
        # a frozen object another thread frees meanwhile leaves the permanent generation, so not exactly equal
        assert frozen // 2 <= gc.get_freeze_count() <= frozen and kept
    finally:
        gc.unfreeze()


# the quick tier keeps one runtime: each full gc pass over the planner's heap takes seconds
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["torch", pytest.param("deepspeed", marks=pytest.mark.slow),
                                     pytest.param("megatron", marks=pytest.mark.slow)])
def test_a_search_leaves_no_cyclic_garbage(runtime):
    # what no_collections relies on: every object a search drops is freed by its reference count
    was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        result = _search(runtime)
        unreachable = gc.collect()
    finally:
        (gc.enable if was_on else gc.disable)()
    assert result.plan.stages
    assert unreachable == 0
