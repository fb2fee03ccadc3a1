"""Cheaper ways through the micro-batch sizes, to the same plans (the c3 rows of benchmarks/bench_planner_scale.py):
the order the search visits sizes (size_search._visit_order) is a heuristic for speed, ties of its geometric mean
lowest floor first, and the plan is the same whatever the order; the spread floor (size_floors.spread_floors_s)
skips sizes the capacity floor let through, checked against brute force and the search without it."""
from __future__ import annotations

import math
import random

import pytest

import tangram_launch.planner.size_floors as size_floors
import tangram_launch.planner.size_search as size_search
from tangram_launch.capabilities import MEGATRON, TORCH
from tangram_launch.islands import build_islands
from tangram_launch.parallelizers.megatron import MegatronParallelizer
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.size_floors import size_floor, spread_floors_s
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec, load_model
from tangram_launch.specs.training import TrainingSpec

TINY = ModelSpec(name="t6", num_layers=6, hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=1024,
                 vocab_size=1000, max_seq_len=256)
TINY_TRAIN = TrainingSpec(global_batch=16, seq_len=256, dtype="fp16")
_QUERIES: list[int] = []  # the slice queries of each _plan, in order


def _cluster(nodes: list[tuple[str, int]], **node_fields) -> ClusterSpec:
    return ClusterSpec.from_dict({
        "name": "gen", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 10}},
        "nodes": [{"name": f"n{i}", "gpu": g, "count": c, **node_fields} for i, (g, c) in enumerate(nodes)]})


def test_sizes_whose_means_tie_are_visited_lowest_floor_first():
    """Means within ORDER_TIE of a run's first are one tie, ordered by floor; a mean beyond it starts a new run;
    a size without a single-island plan (inf) comes after every one with a plan, by its floor."""
    tie = size_search.ORDER_TIE
    first = [(26.0, 12.0, 4), (26.0 * (1 + tie / 2) * 12.0 / 11.9, 11.9, 2), (30.0, 11.0, 8),
             (math.inf, 12.1, 1), (math.inf, 11.5, 16)]
    assert size_search._visit_order(first) == [2, 4, 8, 16, 1]
    apart = [(26.0, 12.0, 4), (26.0 * (1 + 2 * tie) * 12.0 / 11.9, 11.9, 2)]
    assert size_search._visit_order(apart) == [4, 2]


def _plan(cluster_path: str, runtime: str, global_batch: int = 128):
    cluster = ClusterSpec.load(cluster_path)
    training = TrainingSpec(global_batch=global_batch, seq_len=2048, dtype="fp16")
    plan = search(cluster, load_model("gpt3-13b"), training, runtime=runtime,
                  islands=build_islands(cluster, dtype="fp16"),
                  options=PlannerOptions(max_workers=1, progress=False)).plan
    _QUERIES.append(plan.planner["queries"])
    return plan.predicted.iteration_time_s, plan.planner["b"], [(s.island, s.layers, s.tp, s.dp) for s in plan.stages]


@pytest.mark.slow  # full searches of a paper cluster, twice or more: the slow tier keeps the unit tier short
@pytest.mark.parametrize("runtime", ["torch", "megatron"])
def test_the_plan_does_not_depend_on_the_order_sizes_are_visited(monkeypatch, runtime, cluster_path):
    """The same plan (iteration, micro-batch size, stages) with the sizes visited (seed pass and full rounds) in the
    heuristic's order, in its reverse, and by floor alone, on the 4-island row of benchmarks/bench_planner_scale.py
    (the exact composer: island subsets and orders)."""
    path = cluster_path("c3-4-islands-20gpu")
    want = _plan(path, runtime)
    heuristic = size_search._visit_order
    orders = {"reversed": lambda first: heuristic(first)[::-1],
              "by floor": lambda first: [b for _own, _floor, b in sorted(first, key=lambda t: (t[1], t[2]))]}
    for name, order in orders.items():
        monkeypatch.setattr(size_search, "_visit_order", order)  # the seed pass's order
        monkeypatch.setattr(size_search, "_pipelined_order", lambda sizes, seeded: list(sizes))  # and the full rounds'
        assert _plan(path, runtime) == want, name


def _brute_spread_s(per_layer, gpus, L, m):
    """The least closed form and predicted-iteration floors over every integer placement of L layers on the
    islands (x_k layers on island k): the quantities spread_floors_s bounds from below."""
    ks = sorted(per_layer)
    best_lat = best_score = math.inf

    def place(i, left, xs):
        nonlocal best_lat, best_score
        if i == len(ks) - 1:
            xs = xs + [left]
            period = max(x * per_layer[k][0] / gpus[k] for k, x in zip(ks, xs))
            fill = sum(x * per_layer[k][1] for k, x in zip(ks, xs))
            best_lat = min(best_lat, (m - 1) * period + fill)
            best_score = min(best_score, max(m * period, fill))
            return
        for x in range(left + 1):
            place(i + 1, left - x, xs + [x])

    place(0, L, [])
    return best_lat, best_score


def test_spread_floors_lie_under_every_placement_of_the_layers_and_above_the_capacity_floor():
    """spread_floors_s is at most the least closed form and score over every placement of the layers on the
    islands (brute force, seeded random instances), and with few micro-batches often above the capacity floor
    (all GPUs busy, every layer at its fastest island's seconds) that size_floor had alone."""
    rng = random.Random(4100)
    tighter = 0
    for _ in range(300):
        K, L, m = rng.randint(1, 4), rng.randint(1, 9), rng.choice([1, 2, 3, 4, 8, 16, 64])
        per_layer = {k: (rng.uniform(0.05, 4.0), rng.uniform(0.01, 1.0)) for k in range(K)}
        gpus = {k: rng.choice([1, 2, 4, 8]) for k in range(K)}
        lat, score = spread_floors_s(per_layer, gpus, L, m)
        brute_lat, brute_score = _brute_spread_s(per_layer, gpus, L, m)
        assert 0.0 < lat <= brute_lat and 0.0 < score <= brute_score
        period = L / sum(g / per_layer[k][0] for k, g in gpus.items())
        fill = L * min(t for _gs, t in per_layer.values())
        tighter += lat > ((m - 1) * period + fill) * (1 + 1e-6) or score > max(m * period, fill) * (1 + 1e-6)
    assert tighter > 50
    assert spread_floors_s({0: (0.0, 0.1), 1: (1.0, 0.2)}, {0: 4, 1: 4}, 8, 4) == (0.0, 0.0)  # no period floor


@pytest.mark.parametrize("runtime", [TORCH, MEGATRON], ids=lambda c: c.name)
def test_a_size_floor_with_the_spread_lies_under_the_best_plan_at_that_size(runtime):
    """The size floor raised by spread_floors_s (SizeFloor.spread_s) is under the closed form and the predicted
    iteration of the full search's plan at each size (no branch and bound), on three islands of two GPU types. Their
    hosts dispatch an operator in 10 ns (a measured figure, host_op_us): at TINY's shapes the catalog's 6 us would
    put every layer on the host's floor (costmodel/host_floor.py), the same on every GPU type, and the spread floor
    reads how the islands' speeds differ."""
    cl = _cluster([("a100-80gb", 4), ("v100-32gb", 4), ("t4", 4)], measured={"host_op_us": 0.01})
    islands = build_islands(cl, dtype="fp16").islands
    par = MegatronParallelizer()
    raised = 0
    for b in (1, 4, 16):
        floor = size_floor(b, model=TINY, training=TINY_TRAIN, islands=islands, caps=runtime, par=par)
        r = search(cl, TINY, TINY_TRAIN, runtime=runtime, parallelizer=par,
                   options=PlannerOptions(max_workers=1, microbatch_sequences=(b,), branch_and_bound=False))
        assert 0 < floor.spread_s[0] <= r.composition.latency_s * (1 + 1e-12)
        assert 0 < floor.spread_s[1] <= r.plan.predicted.iteration_time_s * (1 + 1e-12)
        raised += floor.spread_s[0] > floor.latency_s
    assert raised


@pytest.mark.slow  # full searches of a paper cluster, twice or more: the slow tier keeps the unit tier short
@pytest.mark.parametrize("runtime", ["torch", "megatron"])
def test_the_spread_floor_skips_sizes_without_moving_the_plan(monkeypatch, runtime, cluster_path):
    """On the 4-island row's cluster the search with the spread floor (which skips micro-batch sizes the capacity
    floor let through) returns the plan of the search without it, with fewer slice queries. Both without the
    bottleneck floors (MegatronParallelizer.bottleneck_floors), which skip what the spread floor does. At a batch of
    256 sequences: at the row's 128 it skips none since the tied embeddings' sync is priced across the islands'
    network."""
    path = cluster_path("c3-4-islands-20gpu")
    monkeypatch.setattr(MegatronParallelizer, "bottleneck_floors", lambda self, q, *a: {})
    want, queries = _plan(path, runtime, 256), _QUERIES[-1]
    monkeypatch.setattr(size_floors, "spread_floors_s", lambda *a: (0.0, 0.0))
    assert _plan(path, runtime, 256) == want
    assert queries < _QUERIES[-1]
