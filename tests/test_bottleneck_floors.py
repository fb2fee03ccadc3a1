"""Bottleneck floors: memory forces recompute on the stages in front of a pipeline (1F1B keeps min(stages behind +
1, m) micro-batches in flight on a stage), so a slice of x layers on an island cannot have a faster slowest stage
than the recompute it needs there allows (MegatronParallelizer.bottleneck_floors, slice_floors.layers_held and
least_bottlenecks_s). Spread over the islands (pair_floors.spread_bottlenecks_s) they raise the size floor's period
and the pair floors' (planner/bounds.py, "bottleneck floors"). Each is checked against brute force: every slice plan
an unbounded query finds, every placement of layers over islands, every pipeline holding a pair; and shown to bite.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_planner_pair_floors import _instance

from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH
from tangram_launch.costmodel.slice_plan import SliceQuery, capacity_bytes, numbers_fit
from tangram_launch.islands import build_islands
from tangram_launch.parallelizers.megatron import MegatronParallelizer
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.pair_floors import PairFloors, spread_behind_s, spread_bottlenecks_s
from tangram_launch.planner.query_pool import answer
from tangram_launch.planner.size_floors import size_floor
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

GPUS = ("a100-80gb", "v100-32gb", "v100-16gb", "t4")


def _model(hidden: int, layers: int = 8) -> ModelSpec:
    """Layers wide enough that a few of them, with some micro-batches in flight, fill a 16 GB GPU."""
    return ModelSpec(name=f"w{hidden}", num_layers=layers, hidden_size=hidden, num_heads=hidden // 128,
                     num_kv_heads=hidden // 128, ffn_hidden_size=4 * hidden, vocab_size=32000, max_seq_len=2048)


def _cluster(nodes: list[tuple[str, int]]) -> ClusterSpec:
    return ClusterSpec.from_dict({
        "name": "gen", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 10}},
        "nodes": [{"name": f"n{i}", "gpu": g, "count": c} for i, (g, c) in enumerate(nodes)]})


def _check_under_every_plan(par, q: SliceQuery, floors: dict, cap: float) -> int:
    """Assert that floors[D][x] lies under the slowest stage of every slice plan of x layers (at the start, the end
    and in the middle of the model) that an unbounded query finds fitting with D stages behind it; the number of
    (x, D) whose floor is finite and above the least GPU-seconds floor spread over the island's GPUs."""
    L, m = q.model.num_layers, q.num_microbatches
    for x in range(1, L + 1):
        for a in sorted({0, L - x, min(1, L - x)}):
            sq = dataclasses.replace(q, layers=(a, a + x), pipelined=(a, a + x) != (0, L))
            for plan in answer(par, sq).plans:
                n = plan.numbers()
                for d in (0, 1):
                    if numbers_fit(n, d, m, cap):
                        assert floors[d][x] <= max(n.time_s) * (1 + 1e-12), (x, a, d)
    least_gs = min(gs for gs, _ts in par.compute_floors(q).values())
    return sum(math.inf > floors[d][x] > x * least_gs / q.island.num_gpus * (1 + 1e-9)
               for d in (0, 1) for x in range(1, L + 1))


@pytest.mark.unit
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpu=st.sampled_from(GPUS), per_node=st.sampled_from([1, 2, 4]), nodes=st.integers(1, 2),
       b=st.sampled_from([1, 2, 4, 8]), hidden=st.sampled_from([1024, 2048, 4096]),
       runtime=st.sampled_from([MEGATRON, TORCH, DEEPSPEED]))
def test_bottleneck_floors_lie_under_every_slice_plan_that_fits(gpu, per_node, nodes, b, hidden, runtime):
    """On generated islands, models and micro-batch sizes: every plan of every slice length, fitting with none or
    one stage behind it, has its slowest stage at or above the floor for that length and that many behind."""
    model, training = _model(hidden, 6), TrainingSpec(global_batch=16, seq_len=2048, dtype="fp16")
    (island,) = build_islands(_cluster([(gpu, per_node)] * nodes), dtype="fp16").islands
    par = MegatronParallelizer()
    q = SliceQuery(model=model, training=training, layers=(0, 6), island=island, microbatch_sequences=b,
                   capabilities=runtime, max_stages=runtime.max_stages)
    _check_under_every_plan(par, q, par.bottleneck_floors(q), capacity_bytes(island, training))


@pytest.mark.unit
def test_bottleneck_floors_charge_the_recompute_memory_forces():
    """Not trivially loose: 16 GB V100s with wide layers and several micro-batches in flight need recompute, and
    the floors say so (above the least GPU-seconds floor over the island's GPUs, for most lengths), still under
    every plan."""
    model, training = _model(4096), TrainingSpec(global_batch=16, seq_len=2048, dtype="fp16")
    (island,) = build_islands(_cluster([("v100-16gb", 4)]), dtype="fp16").islands
    par = MegatronParallelizer()
    q = SliceQuery(model=model, training=training, layers=(0, 8), island=island, microbatch_sequences=8,
                   capabilities=MEGATRON, max_stages=MEGATRON.max_stages)
    floors = par.bottleneck_floors(q)
    assert _check_under_every_plan(par, q, floors, capacity_bytes(island, training)) >= 8
    assert all(floors[1][x] >= floors[0][x] for x in range(9))  # more in flight: no less
    assert floors[1][8] > floors[0][8]


def _brute_spread(tables: list[list[float]], n: int) -> float:
    """The least slowest stage of any placement of n layers, x_o on island o (0 included), sum n."""
    best = math.inf
    for xs in itertools.product(range(n + 1), repeat=len(tables)):
        if sum(xs) == n:
            best = min(best, max((t[x] for t, x in zip(tables, xs)), default=0.0))
    return best


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32))
def test_spread_bottlenecks_lie_under_every_placement_and_meet_it_where_tables_rise(seed):
    rng = random.Random(seed)
    L, K = rng.randint(1, 6), rng.randint(1, 4)
    tables = [[0.0] + [rng.choice([math.inf, rng.uniform(0.0, 3.0)]) for _ in range(L)] for _ in range(K)]
    spread = spread_bottlenecks_s(tables, L)
    for n in range(L + 1):
        assert spread[n] <= _brute_spread(tables, n)
    rising = [[0.0, *itertools.accumulate(t[1:], max)] for t in tables]  # nondecreasing: the floor is exact
    spread = spread_bottlenecks_s(rising, L)
    assert spread == [_brute_spread(rising, n) for n in range(L + 1)]


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32))
def test_spread_with_a_stage_behind_every_island_but_the_last_lies_under_every_placement(seed):
    """spread_behind_s: per island tables with none and one stage behind; a placement whose last island (holding
    a layer) reads its D = 0 table and every other island its D = 1 table is never beaten."""
    rng = random.Random(seed)
    L, K = rng.randint(1, 5), rng.randint(1, 4)
    tables = [{d: [0.0] + [rng.choice([math.inf, rng.uniform(0.0, 3.0)]) for _ in range(L)] for d in (0, 1)}
              for _ in range(K)]
    spread = spread_behind_s(tables, L)
    for n in range(1, L + 1):
        for xs in itertools.product(range(n + 1), repeat=K):
            if sum(xs) != n:
                continue
            for last in (o for o in range(K) if xs[o]):
                worst = max(t[0 if o == last else 1][x] for o, (t, x) in enumerate(zip(tables, xs)))
                assert spread[n] <= worst


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_pair_floors_with_bottleneck_floors_are_under_every_pipeline_holding_the_pair(seed):
    """test_planner_pair_floors' generated pipelines, with per island bottleneck tables that hold for this
    pipeline only where they must (a slice of x layers with D stages behind it: its slowest stage is at or above
    the table's entry for x and every D up to that many) and are anything elsewhere, larger included: the pair
    floors with them stay under the pipeline's closed form and predicted iteration."""
    floors, gpus, kinds, m, slices, closed, predicted, (_, _, slowest, counts) = _instance(seed)
    rng = random.Random(seed + 2)
    L = len(kinds)
    top = max(slowest)
    tables = {k: {d: [0.0] + [rng.choice([math.inf, rng.uniform(0.0, 3.0 * top)]) for _ in range(L)]
                  for d in (0, 1)} for k in floors}
    for i, ((k, a, z), slow) in enumerate(zip(slices, slowest)):
        behind = sum(counts[i + 1:])
        for d in (0, 1):
            if d <= behind:
                tables[k][d][z - a] = slow * rng.choice([1.0, rng.uniform(0.5, 1.0)])
    pf = PairFloors(kinds, floors, gpus, m, bottlenecks=tables)
    for k, a, z in slices:
        lat, score = pf.floor(k, a, z)
        assert lat <= closed * (1 + 1e-12)
        assert score <= predicted * (1 + 1e-12)


@pytest.mark.unit
def test_a_size_floor_with_bottleneck_floors_lies_under_the_best_plan_at_that_size():
    """Two islands of 16 GB GPUs and wide layers: the size floor, whose period the bottleneck floors raise at the
    larger sizes, lies under the closed form and the predicted iteration of the full search's plan at each size."""
    cl = _cluster([("v100-16gb", 4), ("t4", 2)])
    model, training = _model(2048), TrainingSpec(global_batch=16, seq_len=2048, dtype="fp16")
    islands = build_islands(cl, dtype="fp16").islands
    raised = 0
    for b in (1, 4, 8):
        par = MegatronParallelizer()
        floor = size_floor(b, model=model, training=training, islands=islands, caps=MEGATRON, par=par)
        r = search(cl, model, training, runtime=MEGATRON, parallelizer=par,
                   options=PlannerOptions(max_workers=1, microbatch_sequences=(b,), branch_and_bound=False))
        assert floor.latency_s <= r.composition.latency_s * (1 + 1e-12)
        assert floor.score_s <= r.plan.predicted.iteration_time_s * (1 + 1e-12)
        par.bottleneck_floors = lambda q, *a: {}
        raised += floor.latency_s > size_floor(b, model=model, training=training, islands=islands, caps=MEGATRON,
                                               par=par).latency_s
    assert raised


@pytest.mark.slow  # two full searches of a paper cluster
def test_the_bottleneck_floors_skip_queries_and_sizes_without_moving_the_plan(monkeypatch, cluster_path):
    """On the 4-island row of benchmarks/bench_planner_scale.py (megatron): the plan of the search without the
    bottleneck floors, with fewer slice queries and more micro-batch sizes skipped."""
    cluster = ClusterSpec.load(cluster_path("c3-4-islands-20gpu"))
    training = TrainingSpec(global_batch=128, seq_len=2048, dtype="fp16")

    def plan():
        from tangram_launch.specs.model import load_model
        p = search(cluster, load_model("gpt3-13b"), training, runtime=MEGATRON,
                   islands=build_islands(cluster, dtype="fp16"),
                   options=PlannerOptions(max_workers=1, progress=False)).plan
        return (p.predicted.iteration_time_s, p.planner["b"], [(s.island, s.layers, s.tp, s.dp) for s in p.stages],
                p.planner["queries"], p.planner["microbatch_sizes_skipped"])

    *with_plan, queries, skipped = plan()
    monkeypatch.setattr(MegatronParallelizer, "bottleneck_floors", lambda self, q, *a: {})
    *without_plan, queries_without, skipped_without = plan()
    assert with_plan == without_plan
    assert queries < queries_without and skipped > skipped_without
