"""Branch and bound in the planner (issue 12): queries carry the best latency found so far, the megatron
parallelizer skips what cannot beat it, and micro-batch sizes whose floor cannot beat it are skipped. Each cut must
be exact: the bounded search finds a plan as fast as the full search, and every floor is below what it bounds."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.slice_floors import time_floors
from tangram_launch.costmodel.slice_plan import latency_floor_s, score_floor_s
from tangram_launch.islands import build_islands
from tangram_launch.parallelizers.base import GIB
from tangram_launch.parallelizers.megatron import MegatronParallelizer
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.size_floors import size_floor
from tangram_launch.planner.query_pool import answer
from tangram_launch.planner.synthetic import SyntheticParallelizer
from tangram_launch.parallelizers.base import SliceQuery
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

TINY = ModelSpec(name="t6", num_layers=6, hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=1024,
                 vocab_size=1000, max_seq_len=256)
TRAIN = TrainingSpec(global_batch=16, seq_len=256, dtype="fp16")
GPUS = ("a100-80gb", "v100-32gb", "v100-16gb", "t4")


def make_cluster(nodes: list[tuple[str, int]]) -> ClusterSpec:
    return ClusterSpec.from_dict({
        "name": "gen", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 10}},
        "nodes": [{"name": f"n{i}", "gpu": g, "count": c} for i, (g, c) in enumerate(nodes)]})


def bounded_and_full(cluster, model, training, runtime, parallelizer):
    on = search(cluster, model, training, runtime=runtime, parallelizer=parallelizer,
                options=PlannerOptions(max_workers=1))
    off = search(cluster, model, training, runtime=runtime, parallelizer=parallelizer,
                 options=PlannerOptions(max_workers=1, branch_and_bound=False))
    return on, off


def assert_same_optimum(on, off):
    """The composer's closed-form optimum is the same. The plan is the best-predicted of the compositions the
    closed-form search meets on its way (compose.py's score), a set the bound may change, so the two plans may
    differ; each is no slower than the closed-form optimum's own prediction would allow, and both are valid."""
    assert on.stats["compose"]["best_closed_form_s"] == pytest.approx(off.stats["compose"]["best_closed_form_s"],
                                                                      rel=1e-12)
    assert on.plan.predicted.iteration_time_s == pytest.approx(min(on.scored_s), rel=1e-12)
    assert off.stats["configs_bounded"] == 0


# the quick tier keeps one runtime; the others are the same search with other capabilities (seconds each)
@pytest.mark.slow
@pytest.mark.parametrize("runtime", [pytest.param(TORCH, marks=pytest.mark.slow),
                                     pytest.param(DEEPSPEED, marks=pytest.mark.slow), MEGATRON], ids=lambda c: c.name)
def test_bounded_search_finds_the_full_searchs_optimum_with_the_synthetic_parallelizer(runtime):
    cl = make_cluster([("a100-80gb", 4), ("v100-32gb", 8), ("v100-16gb", 4)])
    par = SyntheticParallelizer(layer_time_s={"a100-80gb": 0.004, "v100-32gb": 0.01, "v100-16gb": 0.01},
                                layer_static_bytes=1.5 * GIB, layer_activation_bytes=0.3 * GIB)
    model = ModelSpec(name="t8", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=1024,
                      vocab_size=1000, max_seq_len=128)
    on, off = bounded_and_full(cl, model, TrainingSpec(global_batch=16, seq_len=128, dtype="fp16"), runtime, par)
    assert_same_optimum(on, off)
    assert on.stats["configs_bounded"] > 0  # the bound did cut something here


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.lists(st.tuples(st.sampled_from(GPUS), st.sampled_from([1, 2, 4, 8])), min_size=2, max_size=4),
       runtime=st.sampled_from([TORCH, DEEPSPEED, MEGATRON]), batch=st.sampled_from([8, 16, 24]))
def test_bounded_search_finds_the_full_searchs_optimum_on_generated_clusters(nodes, runtime, batch):
    """The real megatron parallelizer on generated 2-4 node clusters: same optimum with and without the bound."""
    cl = make_cluster(nodes)
    training = TrainingSpec(global_batch=batch, seq_len=256, dtype="fp16")
    on, off = bounded_and_full(cl, TINY, training, runtime, MegatronParallelizer())
    assert_same_optimum(on, off)


@settings(max_examples=40, deadline=None)
@given(gpu=st.sampled_from(GPUS), per_node=st.sampled_from([1, 2, 4, 8]), nodes=st.integers(1, 3),
       start=st.integers(0, 5), length=st.integers(1, 6), b=st.sampled_from([1, 2, 4, 8, 16]),
       grid=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 6]), st.sampled_from([1, 2, 4])))
def test_compute_floors_are_below_every_stage_time(gpu, per_node, nodes, start, length, b, grid):
    """The floors the bound uses: each stage of any split takes at least its layers' floors (plus embedding and
    head), under every memory saver -- so floor / pp and the heaviest stage's floor bound the bottleneck."""
    stop = min(6, start + length)
    cl = make_cluster([(gpu, per_node)] * nodes)
    (island,) = build_islands(cl, dtype="fp16").islands
    q = SliceQuery(model=TINY, training=TRAIN, layers=(start, stop), island=island, microbatch_sequences=b,
                   capabilities=TORCH)
    coster = SliceCoster(q)
    tp, pp, dp = grid
    cfg = ParallelConfig(tp=tp, pp=min(pp, stop - start), dp=dp)
    if coster.check(cfg):
        return
    par = MegatronParallelizer()
    sums = coster.stage_sums(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep)
    for with_comm in (False, True):  # compute only, and with TP/CP/EP (the size, pair and grid floors)
        per_kind, emb_s, head_s = time_floors(coster, cfg.tp, cfg.cp, cfg.ep, cfg.dp, with_comm=with_comm)
        for zero, r, off in par.savers(q, cfg):
            for s in sums:
                a, z = s.layers
                floor = sum(per_kind[TINY.layer_kind(i)] for i in range(a, z))
                floor += (emb_s if s.has_embedding else 0.0) + (head_s if s.has_head else 0.0)
                n = coster.fast_stage(s, zero, r, off)
                assert n.forward_s + n.backward_s >= floor * (1 - 1e-12)


def _five_layer_answer():
    """(parallelizer, query, unbounded answer, m) for five layers of the tiny model on 8 V100s."""
    cl = make_cluster([("v100-32gb", 8), ("v100-32gb", 8)])
    (island,) = build_islands(cl, dtype="fp16").islands
    par = MegatronParallelizer()
    q = SliceQuery(model=TINY, training=TRAIN, layers=(1, 6), island=island, microbatch_sequences=4,
                   capabilities=TORCH)
    return par, q, answer(par, q), q.num_microbatches


def test_a_bounded_answer_keeps_exactly_the_plans_that_can_beat_the_bound():
    par, q, full, m = _five_layer_answer()
    floors = sorted(latency_floor_s(p.numbers(), m) for p in full.plans)
    scores = sorted(score_floor_s(p.numbers(), m) for p in full.plans)
    assert len(floors) > 4
    bound, score = floors[len(floors) // 2], scores[len(scores) // 3]
    cut = answer(par, SliceQuery(**{**q.__dict__, "latency_bound_s": bound, "score_bound_s": score}))
    kept = [p.numbers() for p in full.plans if latency_floor_s(p.numbers(), m) <= bound * (1 + 1e-9)
            or score_floor_s(p.numbers(), m) <= score * (1 + 1e-9)]
    assert [p.numbers() for p in cut.plans] == kept
    assert cut.bounded > 0 and cut.infeasible is None
    only_closed = answer(par, SliceQuery(**{**q.__dict__, "latency_bound_s": bound}))  # no score bound: no cut
    assert len(only_closed.plans) == len(full.plans)
    nothing = answer(par, SliceQuery(**{**q.__dict__, "latency_bound_s": floors[0] / 2,
                                        "score_bound_s": scores[0] / 2}))
    assert nothing.plans == () and nothing.infeasible is None and nothing.bounded > 0  # fits, but cannot win


def test_a_bounded_answer_reads_the_score_bound_at_each_plans_stages():
    """SliceQuery.score_bounds_s: a plan of s stages over n layers has a stage of at most n // s layers, and its
    score bound is score_bounds_s[n // s] (below the slice's length; beyond, score_bound_s). The answer keeps
    exactly the plans whose score floor can beat the bound at their own stage count."""
    par, q, full, m = _five_layer_answer()
    stages = {len(p.numbers().tail_s) for p in full.plans}
    assert {1, 2} <= stages and max(stages) >= 3  # 5 layers: n // s is 5, 2 and 1
    scores = sorted(score_floor_s(p.numbers(), m) for p in full.plans)
    low = scores[len(scores) // 3]
    # i = 0..4; i = 5 (one stage): the last
    cuts = (scores[len(scores) // 4] * 0.99, low, scores[len(scores) // 2], scores[-1], scores[-1])
    floors = sorted(latency_floor_s(p.numbers(), m) for p in full.plans)
    bq = SliceQuery(**{**q.__dict__, "latency_bound_s": floors[0] / 2, "score_bound_s": scores[-1],
                       "score_bounds_s": cuts})
    # (m = 4: five stages are more than the micro-batches, [0])
    assert [bq.score_bound_at(s) for s in (1, 2, 3, 4, 5)] == [scores[-1], cuts[2], cuts[1], cuts[1], cuts[0]]
    # more stages than micro-batches (m = 2 at b = 8): no pipeline holding the plan interleaves, [0]
    two = SliceQuery(**{**bq.__dict__, "microbatch_sequences": 8})
    assert two.num_microbatches == 2 and [two.score_bound_at(s) for s in (1, 2, 3)] == [scores[-1], cuts[2], cuts[0]]
    cut = answer(par, bq)
    kept = [p.numbers() for p in full.plans
            if score_floor_s(p.numbers(), m) <= bq.score_bound_at(len(p.numbers().tail_s)) * (1 + 1e-9)]
    assert [p.numbers() for p in cut.plans] == kept
    assert 0 < len(kept) < len(full.plans) and cut.bounded > 0
    # the parallelizer itself skips the rest before building them (not only answer's filter after it)
    raw = [p.numbers() for p in par.query(bq).plans]
    assert all(score_floor_s(n, m) <= bq.score_bound_at(len(n.tail_s)) * (1 + 1e-9) for n in raw)
    assert all(n in raw for n in kept)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", [TORCH, MEGATRON], ids=lambda c: c.name)
def test_size_floor_is_below_the_best_plan_at_that_size(runtime):
    cl = make_cluster([("a100-80gb", 4), ("v100-32gb", 4), ("v100-32gb", 4)])
    islands = build_islands(cl, dtype="fp16").islands
    par = MegatronParallelizer()
    for b in (1, 4, 16):
        floor = size_floor(b, model=TINY, training=TRAIN, islands=islands, caps=runtime, par=par)
        r = search(cl, TINY, TRAIN, runtime=runtime, parallelizer=par,
                   options=PlannerOptions(max_workers=1, microbatch_sequences=(b,), branch_and_bound=False))
        assert 0 < floor.latency_s <= r.composition.latency_s * (1 + 1e-12)
        assert 0 < floor.score_s <= r.plan.predicted.iteration_time_s * (1 + 1e-12)
        # the rest of the pipeline around any option takes at least the floor of the layers outside it
        placed = [r.candidates.options[i] for i in r.composition.options]
        for o in placed:
            others = sum(p.time_s for p in placed if p is not o)
            assert floor.outside_s(o.start, o.stop) <= others * (1 + 1e-12)
        assert floor.outside_s(0, TINY.num_layers) == 0.0


def test_size_floor_is_zero_for_a_parallelizer_without_compute_floors():
    cl = make_cluster([("a100-80gb", 4)])
    islands = build_islands(cl, dtype="fp16").islands
    par = SyntheticParallelizer(layer_time_s={"a100-80gb": 0.004}, layer_static_bytes=GIB,
                                layer_activation_bytes=0.1 * GIB)
    assert size_floor(4, model=TINY, training=TRAIN, islands=islands, caps=TORCH, par=par).latency_s == 0.0
    assert math.isinf(SliceQuery(model=TINY, training=TRAIN, layers=(0, 6), island=islands[0],
                                 microbatch_sequences=4, capabilities=TORCH).latency_bound_s)


def test_an_incumbent_moved_into_a_fuller_option_list_keeps_its_options_and_score():
    """A size's first (single-island) incumbent is re-indexed when the rest of its pairs are answered."""
    from tangram_launch.planner.size_composition import Incumbent, _moved
    from tangram_launch.planner.build import Candidates
    from tangram_launch.planner.compose import Composition, Metrics, Option

    a = Option(0, 6, 0, 1, 5, 1.0, 1.0, 0.1)
    b = Option(0, 3, 1, 1, 5, 0.5, 0.5, 0.0)
    c = Option(3, 6, 0, 1, 5, 0.5, 0.5, 0.0)
    old = Candidates(b=4, num_microbatches=4, islands=(), links=None, link_matrix=((0.0,),), options=[a],
                     groups=[None])
    new = Candidates(b=4, num_microbatches=4, islands=(), links=None, link_matrix=((0.0,),), options=[b, c, a],
                     groups=[None, None, None])
    comp = Composition((0,), Metrics(4.1, 1.0, 1.0, 0.1, ()), 1.0, score_s=3.9)
    lat, size, group, moved, cand = _moved(Incumbent(3.9, 4, None, comp, old), new)
    assert cand is new and moved.options == (2,) and new.options[moved.options[0]] == a
    assert moved.objective_s == 3.9 and (lat, size, group) == (3.9, 4, None)
