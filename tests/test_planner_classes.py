"""Class floors (planner/classes.py): under uniform-grid runtimes the driver composes one compatibility class at a
time, most promising first, and skips a class whose floor cannot beat the plan found so far. The floor must be
under every composition the class admits (brute force), and the pruned search must find what composing every class
finds."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import MEGATRON
from tangram_launch.errors import InfeasibleError
from tangram_launch.parallelizers.base import GIB
from tangram_launch.planner import PlannerOptions, search, size_composition
from tangram_launch.planner.classes import class_floors_s, stage_totals
from tangram_launch.planner.bounds import lower_bound
from tangram_launch.planner.compose import Option
from tangram_launch.planner.reference import brute_force, every_composition
from tangram_launch.planner.synthetic import SyntheticParallelizer
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

from helpers_compose import scheduled

NEVER = -1
ALWAYS = 1 << 30


def instance(seed: int):
    """Options over up to 6 layers on up to 3 islands (some never fit), links, m: small enough for brute force
    (a seeded generator: hypothesis draws the seed, so generating costs nothing)."""
    rng = random.Random(seed)
    L = rng.randint(1, 6)
    K = rng.randint(1, 3)
    m = rng.choice([1, 2, 4, 32])
    options = []
    for a in range(L):
        for b in range(a + 1, L + 1):
            for k in range(K):
                for _ in range(rng.choice([0, 1, 1, 2])):
                    ns = rng.randint(1, 3)
                    bn = rng.uniform(0.05, 2.0) * (b - a) / ns
                    options.append(Option(a, b, k, ns, rng.choice([NEVER, 0, 1, 3, ALWAYS]), bn * rng.uniform(1, ns),
                                          bn, rng.choice([0.0, 0.5, 2.0])))
    link = [[0.0 if i == j else rng.choice([0.0, 0.3, 1.5]) for j in range(K)] for i in range(K)]
    return options, link, L, m


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 12))
def test_stage_totals_hold_every_compositions_stage_count(seed, most):
    """stage_totals relaxes a pipeline to slice lengths that sum to L, one per island: every composition's stage
    count (up to ``most``) is among them, so a one-grid class none of whose counts divides m cannot interleave."""
    options, link, L, m = instance(seed)
    totals = stage_totals(options, range(len(options)), L, most)
    counts = {sum(options[i].num_stages for i in c.options) for c in every_composition(options, link, L, m)}
    assert {n for n in counts if n <= most} <= totals
    assert all(n <= most for n in totals)


def test_stage_totals_of_slices_that_cannot_add_up():
    # island 0 holds [0, 2) in 3 stages, island 1 holds [2, 4) in 2 or 4: 5 or 7 stages, never 4 or 8
    options = [Option(0, 2, 0, 3, ALWAYS, 1.0, 0.4, 0.0), Option(2, 4, 1, 2, ALWAYS, 1.0, 0.5, 0.0),
               Option(2, 4, 1, 4, ALWAYS, 1.0, 0.3, 0.0), Option(0, 4, 1, 2, NEVER, 1.0, 0.5, 0.0)]
    assert stage_totals(options, range(4), 4, 64) == {5, 7}
    assert stage_totals(options, range(4), 4, 6) == {5}


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32))
def test_class_floor_is_under_every_composition_the_class_admits(seed):
    options, link, L, m = instance(seed)
    floor = class_floors_s(options, [0] * len(options), L, m).get(0, math.inf)
    best = brute_force(options, link, L, m)
    if best is None:
        return  # nothing to be under (the floor may still be finite: it ignores memory and start positions)
    assert floor <= best.latency_s
    assert floor < math.inf


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32))
def test_class_score_floor_is_under_every_compositions_predicted_floor(seed):
    """The score floor (m x least period + least tail) lies under m x period + tail of every composition, which
    lies under any predicted iteration (plain or interleaved): a class it cannot beat the best score with holds
    no plan that can."""
    options, link, L, m = instance(seed)
    score_floors: dict = {}
    class_floors_s(options, [0] * len(options), L, m, score_floors=score_floors)
    for metrics in (c.metrics for c in every_composition(options, link, L, m)):
        assert score_floors[0] <= m * metrics.period_s + metrics.tail_s


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32), st.integers(2, 8))
def test_class_interleaved_floor_is_under_every_compositions_interleaved_iteration(seed, max_chunks):
    """The interleaved floor (max(m x P*, F*) + least tail) lies under the interleaved 1F1B simulation + tail of
    every composition for every v in 2..V (helpers_compose.scheduled: the stage times consistent with each
    option's numbers, the slowest anywhere): a one-grid class it cannot beat the best score with holds no
    interleaved plan that can."""
    options, link, L, m = instance(seed)
    floors: dict = {}
    class_floors_s(options, [0] * len(options), L, m, interleaved_floors=(floors, max_chunks))
    score = scheduled(options, link, m, schedules=("interleaved",), most_chunks=max_chunks)
    for c in every_composition(options, link, L, m):
        assert floors[0] <= score(c.options, c.metrics)


def test_each_class_gets_its_own_floor_from_one_pass():
    fast = [Option(0, 2, 0, 1, ALWAYS, 2.0, 2.0, 0.0)]
    slow = [Option(0, 1, 0, 1, ALWAYS, 3.0, 3.0, 0.0), Option(1, 2, 1, 1, ALWAYS, 3.0, 3.0, 0.0)]
    floors = class_floors_s(fast + slow + [Option(0, 1, 1, 1, NEVER, 0.1, 0.1, 0.0)], ["a", "b", "b", "c"], 2, 4)
    assert floors["a"] == pytest.approx(3 * 2.0 + 2.0)
    assert floors["b"] == pytest.approx(3 * 3.0 + 6.0)
    assert floors["c"] == math.inf  # its only option never fits


def test_the_floor_uses_each_island_once_where_compose_lower_bound_reuses_the_fastest():
    """Island 0 is fast but holds one slice only: covering 4 layers takes a 3-layer slice of it and one slow
    layer of island 1. bounds.lower_bound covers the model with island 0's one-layer slices four times."""
    L, m = 4, 16
    options = [Option(a, b, 0, 1, ALWAYS, 1.0 * (b - a), 1.0 * (b - a), 0.0)
               for a in range(L) for b in range(a + 1, L + 1)]
    options += [Option(a, a + 1, 1, 1, ALWAYS, 5.0, 5.0, 0.0) for a in range(L)]
    floor = class_floors_s(options, [0] * len(options), L, m)[0]
    best = brute_force(options, [[0.0, 0.0], [0.0, 0.0]], L, m)
    assert lower_bound(options, L, m) == pytest.approx(15 * 1.0 + 4.0)
    assert floor <= best.latency_s
    assert floor > 3 * lower_bound(options, L, m)


def _cluster(nodes):
    return ClusterSpec.from_dict({
        "name": "gen", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 10}},
        "nodes": [{"name": f"n{i}", "gpu": g, "count": c} for i, (g, c) in enumerate(nodes)]})


def _skip_vs_every(times, counts, batch, static_gib):
    """Megatron (one grid class per job) with the synthetic parallelizer, which offers many classes: the search
    that skips classes by their floor, and the same search composing every class (floors of 0, patched in as the
    reference); None when nothing fits (either way)."""
    gpus = ("a100-80gb", "v100-32gb", "v100-16gb")
    cl = _cluster(list(zip(gpus, counts)))
    par = SyntheticParallelizer(layer_time_s=dict(zip(gpus, times)), layer_static_bytes=static_gib * GIB,
                                layer_activation_bytes=0.3 * GIB)
    model = ModelSpec(name="t8", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_hidden_size=1024,
                      vocab_size=1000, max_seq_len=128)
    training = TrainingSpec(global_batch=batch, seq_len=128, dtype="fp16")
    opts = PlannerOptions(max_workers=1)
    composed = []  # per search, how many classes it composed (_compose_group calls)

    def searched(mp):
        calls = [0]
        inner = size_composition.compose_group

        def counting(*a, **k):
            calls[0] += 1
            return inner(*a, **k)

        mp.setattr(size_composition, "compose_group", counting)
        try:
            return search(cl, model, training, runtime=MEGATRON, parallelizer=par, options=opts)
        finally:
            composed.append(calls[0])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(size_composition, "class_floors_s", lambda options, groups, L, m, **kw: {g: 0.0 for g in groups})
        try:
            every = searched(mp)
        except InfeasibleError:
            every = None
    if every is None:
        with pytest.raises(InfeasibleError):
            search(cl, model, training, runtime=MEGATRON, parallelizer=par, options=opts)
        return None
    with pytest.MonkeyPatch.context() as mp:
        pruned = searched(mp)
    pruned.stats["classes_composed"], every.stats["classes_composed"] = composed[1], composed[0]
    return pruned, every


def _assert_same_optimum(pruned, every):
    """The closed-form optimum is the same, and the plan is the best-predicted one the search scored, no slower
    than the plan composing every class gives."""
    assert pruned.stats["compose"]["best_closed_form_s"] == pytest.approx(
        every.stats["compose"]["best_closed_form_s"], rel=1e-12)
    assert pruned.plan.predicted.iteration_time_s == pytest.approx(min(pruned.scored_s), rel=1e-12)
    assert pruned.plan.predicted.iteration_time_s <= every.plan.predicted.iteration_time_s * (1 + 1e-12)


@pytest.mark.slow
def test_skipping_classes_by_their_floor_finds_what_composing_every_class_finds():
    pruned, every = _skip_vs_every((0.004, 0.01, 0.01), (4, 8, 4), 16, 1.5)
    _assert_same_optimum(pruned, every)
    # classes were skipped: fewer composed (each a preparation; the kernel's own bound may then stop it before any
    # DP run, so DP runs alone need not differ)
    assert pruned.stats["classes_composed"] < every.stats["classes_composed"]
    assert pruned.stats["compose"]["dp_runs"] <= every.stats["compose"]["dp_runs"]


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(times=st.tuples(*[st.sampled_from([0.002, 0.004, 0.01, 0.03])] * 3),
       counts=st.tuples(*[st.sampled_from([2, 4, 8])] * 3), batch=st.sampled_from([8, 16]),
       static_gib=st.sampled_from([0.5, 1.5, 3.0]))
def test_skipping_classes_finds_what_composing_every_class_finds_on_generated_clusters(times, counts, batch,
                                                                                       static_gib):
    both = _skip_vs_every(times, counts, batch, static_gib)
    if both is not None:
        _assert_same_optimum(*both)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 4), st.booleans())
def test_class_floors_merged_from_parts_equal_one_pass_over_the_options(seed, parts, mapped):
    """The driver's class floors merge per-answer minima (group_minima, kept across rounds) through a map from
    option groups to classes: the same floors, score and interleaved floors as one pass over the options."""
    from tangram_launch.planner.classes import option_minima

    options, _link, L, m = instance(seed)
    rng = random.Random(seed + 1)
    groups = [rng.choice("abc") for _ in options]
    to_class = {"a": "x", "b": "x", "c": None} if mapped else {g: g for g in "abc"}
    classes = [to_class[g] for g in groups]
    cuts = sorted(rng.sample(range(len(options) + 1), min(parts - 1, len(options) + 1)))
    minima = []
    for lo, hi in zip([0, *cuts], [*cuts, len(options)]):
        minima += option_minima(options[lo:hi], groups[lo:hi], L)
    got_score, got_inter, want_score, want_inter = {}, {}, {}, {}
    got = class_floors_s(options, classes, L, m, score_floors=got_score, interleaved_floors=(got_inter, 4),
                         minima=minima, class_of=to_class.__getitem__)
    want = class_floors_s(options, classes, L, m, score_floors=want_score, interleaved_floors=(want_inter, 4))
    assert got == want and got_score == want_score and got_inter == want_inter
