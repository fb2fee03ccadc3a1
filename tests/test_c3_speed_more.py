"""The order in which the search visits micro-batch sizes (size_search._visit_order) is a heuristic for speed: ties
of its geometric mean go lowest floor first, and the plan is the same whatever the order."""
from __future__ import annotations

import math

import pytest

import tangram_launch.planner.size_search as size_search
from tangram_launch.islands import build_islands
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec


def test_sizes_whose_means_tie_are_visited_lowest_floor_first():
    """Means within ORDER_TIE of a run's first are one tie, ordered by floor; a mean beyond it starts a new run;
    a size without a single-island plan (inf) comes after every one with a plan, by its floor."""
    tie = size_search.ORDER_TIE
    first = [(26.0, 12.0, 4), (26.0 * (1 + tie / 2) * 12.0 / 11.9, 11.9, 2), (30.0, 11.0, 8),
             (math.inf, 12.1, 1), (math.inf, 11.5, 16)]
    assert size_search._visit_order(first) == [2, 4, 8, 16, 1]
    apart = [(26.0, 12.0, 4), (26.0 * (1 + 2 * tie) * 12.0 / 11.9, 11.9, 2)]
    assert size_search._visit_order(apart) == [4, 2]


def _plan(cluster_path: str, runtime: str):
    cluster = ClusterSpec.load(cluster_path)
    training = TrainingSpec(global_batch=128, seq_len=2048, dtype="fp16")
    plan = search(cluster, load_model("gpt3-13b"), training, runtime=runtime,
                  islands=build_islands(cluster, dtype="fp16"),
                  options=PlannerOptions(max_workers=1, progress=False)).plan
    return plan.predicted.iteration_time_s, plan.planner["b"], [(s.island, s.layers, s.tp, s.dp) for s in plan.stages]


@pytest.mark.parametrize("runtime", ["torch", "megatron"])
def test_the_plan_does_not_depend_on_the_order_sizes_are_visited(monkeypatch, runtime, cluster_path):
    """The same plan (iteration, micro-batch size, stages) with the sizes visited in the heuristic's order, in
    its reverse, and by floor alone, on the 4-island row of benchmarks/bench_planner_scale.py (the exact
    composer: island subsets and orders)."""
    path = cluster_path("c3-4-islands-20gpu")
    want = _plan(path, runtime)
    heuristic = size_search._visit_order
    orders = {"reversed": lambda first: heuristic(first)[::-1],
              "by floor": lambda first: [b for _own, _floor, b in sorted(first, key=lambda t: (t[1], t[2]))]}
    for name, order in orders.items():
        monkeypatch.setattr(size_search, "_visit_order", order)
        assert _plan(path, runtime) == want, name
