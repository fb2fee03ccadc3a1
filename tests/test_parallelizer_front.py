"""What a slice plan may stand for (megatron.exact_front): the planner ranks plans by the plain 1F1B event
simulation plus the tail, not by the closed form. Stage by stage no slower (forward and backward apart), on the
same ports, with no more tail and as deep a fit: never simulates slower, in any pipeline (property over random
ones). The closed form's dominance can (two concrete pipelines). And the parallelizer's answer is that front:
brute force over every configuration of small generated queries."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from test_gpu_counts import _two_islands
from test_parallelizers import island, query

from tangram_launch.capabilities import MEGATRON, TORCH
from tangram_launch.costmodel.breakdown import ParallelConfig, SliceCoster
from tangram_launch.costmodel.compute import RECOMPUTE_MODES
from tangram_launch.costmodel.pipeline import simulated_1f1b_s
from tangram_launch.parallelizers import megatron
from tangram_launch.parallelizers.base import capacity_bytes
from tangram_launch.parallelizers.megatron import MegatronParallelizer, exact_front


def _sim(stages: list[tuple[float, float]], m: int, p2p: list[float] | None = None) -> float:
    return simulated_1f1b_s([f for f, _ in stages], [b for _, b in stages],
                            p2p if p2p is not None else [0.0] * (len(stages) - 1), m)


def _closed_form(stages):
    times = [f + b for f, b in stages]
    return max(times), sum(times)


def test_fewer_stages_with_the_same_bottleneck_and_less_fill_can_simulate_slower():
    """The gap test_gpu_counts found, in small: behind two slow stages, 2 stages of 3 s stood for 3 stages of at most
    3 s (less fill, fewer stages), but the slow stages in front run (m - w) x their time with w stages behind."""
    front = [(2.0, 2.0), (2.0, 1.0)]
    two, three = [(1.0, 2.0), (1.0, 2.0)], [(0.75, 0.5), (0.75, 1.5), (1.0, 2.0)]
    assert _closed_form(two)[0] == _closed_form(three)[0] and _closed_form(two)[1] < _closed_form(three)[1]
    assert _sim(front + two, 8) == 38.0 and _sim(front + three, 8) == 35.0


def test_the_same_stages_with_the_same_closed_form_can_simulate_slower():
    """Equal stage counts are not enough either: the simulation reads where the slow stage sits."""
    first_fast, first_slow = [(1.0, 0.5), (1.0, 2.0)], [(1.0, 2.0), (1.0, 0.5)]
    assert _closed_form(first_fast) == _closed_form(first_slow)
    around = [(0.5, 2.0)]
    assert _sim(around + first_fast + around, 8) == 30.0 and _sim(around + first_slow + around, 8) == 28.5


_times = hst.floats(0.0, 4.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(slice_=hst.lists(hst.tuples(_times, _times), min_size=1, max_size=4),
       more=hst.lists(hst.tuples(_times, _times), min_size=1, max_size=4),
       front=hst.lists(hst.tuples(_times, _times), max_size=3), back=hst.lists(hst.tuples(_times, _times), max_size=3),
       links=hst.lists(hst.floats(0.0, 1.0), min_size=9, max_size=9), m=hst.integers(1, 9))
def test_a_slice_no_slower_stage_by_stage_never_simulates_slower_in_any_pipeline(slice_, more, front, back, links,
                                                                                 m):
    """exact_front's rule against the simulation: Q is P with each stage's forward and backward made no faster; in
    front of and behind any stages, over any links, at any micro-batch count, P's pipeline is no slower."""
    p = slice_
    q = [(f + a, b + c) for (f, b), (a, c) in zip(p, more + [(0.0, 0.0)] * len(p))]
    n = len(front) + len(p) + len(back)
    p2p = links[:n - 1]
    assert _sim(front + p + back, m, p2p) <= _sim(front + q + back, m, p2p)


def _ports(plan):
    sh = plan.stages[0].shape
    return sh.tp, sh.cp, sh.dp, len(plan.stages), plan.num_gpus


def _terms(plan, m, cap):
    return ([(s.forward_s, s.backward_s) for s in plan.stages], max(s.dp_sync_s + s.optimizer_s for s in plan.stages),
            plan.max_stages_after(m, cap))


def _stands_for(a, b) -> bool:
    """exact_front's rule on built plans' terms (ports compared by the caller)."""
    (sa, ta, da), (sb, tb, db) = a, b
    return ta <= tb and da >= db and all(fa <= fb and ba <= bb for (fa, ba), (fb, bb) in zip(sa, sb))


CASES = [("gpt3-1.3b", "a100-40gb", 4, 6), ("gpt3-1.3b", "v100-32gb", 6, 3), ("opt-350m", "t4", 6, 6),
         ("opt-350m", "a100-80gb", 8, 3)]


@settings(max_examples=16, deadline=None, derandomize=True)
@given(case=hst.sampled_from(CASES), start=hst.integers(0, 4), length=hst.integers(2, 6), b=hst.sampled_from((1, 2)),
       torch=hst.booleans(), every=hst.booleans())
def test_the_answer_stands_for_every_configuration_by_brute_force(case, start, length, b, torch, every):
    """Every configuration the parallelizer enumerates, costed through the explained path, that fits: an answer plan
    of its class and ports stands for it (stage by stage no slower, no more tail, as deep a fit); and no answer
    plan stands for another (ties aside: identical terms)."""
    model, gpu, per_node, max_layers = case
    layers = (start, start + min(length, max_layers))
    q = query(model, island(gpu, per_node=per_node), layers=layers, b=b, gb=16, seq=1024, dtype="fp16",
              caps=TORCH if torch else MEGATRON)
    par = MegatronParallelizer(gpu_counts="all" if every else "tiling")
    res = par.query(q)
    m, cap = q.num_microbatches, capacity_bytes(q.island)
    answer = {}
    for plan in res.plans:
        answer.setdefault(_ports(plan), []).append(_terms(plan, m, cap))
    for group in answer.values():
        for i, a in enumerate(group):
            assert not any(j != i and _stands_for(c, a) and c != a for j, c in enumerate(group))
    coster = SliceCoster(q)
    for grid in par.grids(q, coster):
        if coster.check(grid, search_space=not every):
            continue
        for zero, r, off in par.savers(q, grid):
            cfg = ParallelConfig(tp=grid.tp, pp=grid.pp, dp=grid.dp, cp=grid.cp, ep=grid.ep, zero_stage=zero,
                                 recompute=RECOMPUTE_MODES[r], offload=off)
            plan = coster.materialize(cfg, coster.stage_sums(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep))
            terms = _terms(plan, m, cap)
            if terms[2] < 0:
                continue
            assert any(_stands_for(a, terms) for a in answer.get(_ports(plan), ())), (cfg, terms)


def test_exact_front_keeps_a_plan_of_more_stages_and_drops_one_slower_stage_by_stage():
    """On numbers alone: 2 stages do not stand for 3 (other ports), and within one set of ports a point slower at
    one stage and no faster at any other is dropped, while one faster at some stage and slower at another stays."""
    g2, g3 = ParallelConfig(tp=2, pp=2, dp=1), ParallelConfig(tp=2, pp=3, dp=1)
    times = {}

    def pt(grid, stages, tail=0.1, depth=3):
        point = (max(f + b for f, b in stages), sum(f + b for f, b in stages), tail, depth, grid.pp,
                 grid.pp * grid.tp, grid, len(times))
        times[point[-1]] = tuple(stages)
        return point
    two = pt(g2, [(1.0, 2.0), (1.0, 2.0)])
    three = pt(g3, [(0.75, 0.5), (0.75, 1.5), (1.0, 2.0)])
    slower = pt(g2, [(1.0, 2.5), (1.0, 2.0)])
    swapped = pt(g2, [(0.5, 1.0), (1.0, 2.5)])
    shallow = pt(g2, [(1.0, 2.0), (1.0, 2.0)], depth=2)
    kept = exact_front([two, three, slower, swapped, shallow], lambda p: times[p[-1]])
    assert set(kept) == {two, three, swapped}


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True)
@given(seed=hst.integers(0, 10_000), per_node=hst.lists(hst.sampled_from((2, 3, 5, 6)), min_size=2, max_size=2),
       runtime=hst.sampled_from(("torch", "megatron", "deepspeed")), gpu_counts=hst.sampled_from(("tiling", "all")))
def test_the_search_over_the_front_finds_what_the_search_over_every_configuration_finds(seed, per_node, runtime,
                                                                                        gpu_counts):
    """End to end on small two-island clusters: planning over the parallelizer's answers (exact_front) gives the
    score planning over every configuration that fits (no front at all) gives."""
    front = _two_islands(seed, per_node, runtime, gpu_counts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(megatron, "exact_front", lambda points, terms, interleaves=False: list(points))
        every = _two_islands(seed, per_node, runtime, gpu_counts)
    assert (front is None) == (every is None)
    if front is not None:
        assert front.predicted.iteration_time_s == every.predicted.iteration_time_s
