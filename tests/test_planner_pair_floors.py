"""Pair floors (planner/pair_floors.py): a slice/island pair whose every pipeline is slower than the plan found so
far is not queried. The floors must be under every pipeline that holds the pair (generated pipelines whose stages
take at least their compute floors), and the search that skips pairs must find the full search's optimum."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH
from tangram_launch.costmodel.interleaved_schedule import simulated_interleaved_1f1b_s
from tangram_launch.costmodel.pipeline import pipeline_latency_s
from tangram_launch.parallelizers.megatron import MegatronParallelizer
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.pair_floors import PairFloors
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec

KINDS = ("dense", "moe")


def _instance(seed: int):
    """Islands with per-kind (GPU-seconds, seconds) floors and GPU counts, and one pipeline over distinct islands
    whose stages take at least their floors (a stage of n GPUs: max(sum of seconds, sum of GPU-seconds / n)),
    with links and a tail. Returns the floors, GPUs, kinds, m, the pipeline's slices (island, start, stop), its
    closed form and its slowest stage."""
    rng = random.Random(seed)
    L = rng.randint(1, 12)
    kinds = [rng.choice(KINDS) for _ in range(L)]
    K = rng.randint(1, 4)
    gpus = {k: rng.choice([1, 2, 4, 8]) for k in range(K)}
    floors = {}
    for k in range(K):
        f = {}
        for name in (*KINDS, "embedding", "head"):
            ts = rng.uniform(0.01, 1.0)
            f[name] = (ts * rng.uniform(1.0, 4.0), ts)  # least GPU-seconds (some grid's t x n) >= least seconds
        floors[k] = f
    m = rng.choice([1, 2, 4, 32])
    used = rng.sample(range(K), rng.randint(1, min(K, L)))
    cuts = sorted(rng.sample(range(1, L), len(used) - 1))
    bounds = [0, *cuts, L]
    slices = [(k, bounds[i], bounds[i + 1]) for i, k in enumerate(used)]
    stage_s = []
    fewest = L  # the fewest layers of any stage: interleaving takes v <= them chunks (interleave.py)
    slice_s = []  # per slice, its stages' seconds
    first_of = set()  # the stages that begin a slice after the first (a link in front of them)
    for k, a, z in slices:
        slice_s.append(len(stage_s))
        if stage_s:
            first_of.add(len(stage_s))
        n_stages = rng.randint(1, min(z - a, gpus[k]))
        inner = sorted(rng.sample(range(a + 1, z), n_stages - 1))
        left = gpus[k]
        for s, (sa, sz) in enumerate(zip([a, *inner], [*inner, z])):
            fewest = min(fewest, sz - sa)
            n = rng.randint(1, left - (n_stages - 1 - s))
            left -= n
            names = [kinds[j] for j in range(sa, sz)] + (["embedding"] if sa == 0 else []) + (
                ["head"] if sz == L else [])
            need = max(sum(floors[k][x][1] for x in names), sum(floors[k][x][0] for x in names) / n)
            stage_s.append(need * rng.choice([1.0, 1.0, rng.uniform(1.0, 2.0)]))
    links = [rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in range(len(slices) - 1)]
    period = max(stage_s + links)
    fill = sum(stage_s) + 2 * sum(links)
    closed = pipeline_latency_s(m, period, fill, rng.choice([0.0, 0.3]))
    # the plain 1F1B's floor (bounds.plain_1f1b_floor_s): each stage's m micro-batches after the fill in front
    plain, front, crossed = 0.0, 0.0, iter(links)
    for j, t in enumerate(stage_s):
        if j in first_of:
            front += 2 * next(crossed)
        plain = max(plain, front + m * t)
        front += t
    # under every predicted iteration: the plain 1F1B's and the interleaved one's with any v <= 8 chunks that every
    # stage has the layers for, where the stages divide the micro-batches (capabilities.schedule_problems)
    chunks = range(2, min(8, fewest) + 1) if m % len(stage_s) == 0 else ()
    crossed = iter(links)
    p2p = [next(crossed) if j in first_of else 0.0 for j in range(1, len(stage_s))]
    fwd, bwd = [t / 3 for t in stage_s], [2 * t / 3 for t in stage_s]
    predicted = min([plain, *(simulated_interleaved_1f1b_s(fwd, bwd, p2p, m, v) for v in chunks)])
    spans = list(zip(slice_s, [*slice_s[1:], len(stage_s)]))
    slowest = [max(stage_s[i:j]) for i, j in spans]  # per slice, its slowest stage
    counts = [j - i for i, j in spans]  # per slice, its stages
    slice_s = [sum(stage_s[i:j]) for i, j in spans]
    return floors, gpus, kinds, m, slices, closed, predicted, (slice_s, links, slowest, counts)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_pair_floors_are_under_every_pipeline_holding_the_pair(seed):
    """With the least links into and out of each island (a matrix holding the pipeline's own links, the others
    slower or not: the floors are then as tight as the links allow) and without."""
    from tangram_launch.planner.bounds import least_links

    floors, gpus, kinds, m, slices, closed, predicted, (_, links, _, _) = _instance(seed)
    rng = random.Random(seed + 1)
    K = len(floors)
    other = rng.choice([0.6, 9.0])  # (the instance's links are 0.5 s at most)
    matrix = [[0.0 if i == j else rng.choice([other, rng.uniform(0.0, 1.0)]) for j in range(K)] for i in range(K)]
    for (i, _a, _z), (j, _b, _y), lk in zip(slices, slices[1:], links):
        matrix[i][j] = lk
    for pf in (PairFloors(kinds, floors, gpus, m),
               PairFloors(kinds, floors, gpus, m, least_links(matrix, range(K), default=0.0))):
        for k, a, z in slices:
            lat, score = pf.floor(k, a, z)
            assert lat <= closed * (1 + 1e-12)
            assert score <= predicted * (1 + 1e-12)  # under the plain and the interleaved 1F1B's iterations
            assert not pf.beyond(k, a, z, closed, predicted)
            outside = pf.outside_s(k, a, z)
            assert outside is None or outside <= closed


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32))
def test_a_querys_outside_fill_is_under_the_rest_of_every_pipeline_holding_its_pair(seed):
    """size_floors.outside_s (what a pair's query takes off the closed form to beat) is under what the rest of any
    pipeline holding the pair adds to its fill: the other slices' stage times and twice every link crossed; and
    size_floors.score_extra_s (what it takes off the score to beat) is under what any predicted iteration adds to
    m x the slice plan's slowest stage, with the chunks capped by the slice's length, or by the layers per stage of its
    plan (SliceQuery.score_bounds_s: a plan of s stages over n layers has a stage of at most n // s)."""
    from tangram_launch.planner.size_floors import SizeFloor, front_s, outside_s, score_extra_s
    from tangram_launch.planner.bounds import least_links
    from tangram_launch.planner.slices import Pair

    floors, gpus, kinds, m, slices, _closed, predicted, (slice_s, links, slowest, counts) = _instance(seed)
    rng = random.Random(seed)
    L, K = len(kinds), len(floors)
    pf = PairFloors(kinds, floors, gpus, m)
    least = {x: min(f[x][1] for f in floors.values()) for x in (*KINDS, "embedding", "head")}
    prefix = [0.0]
    for x in kinds:
        prefix.append(prefix[-1] + least[x])
    size = SizeFloor(0.0, 0.0, tuple(prefix), least["embedding"], least["head"], pf)
    matrix = [[0.0 if i == j else rng.uniform(0.0, 1.0) for j in range(K)] for i in range(K)]
    for (i, _a, _z), (j, _b, _y), lk in zip(slices, slices[1:], links):
        matrix[i][j] = lk
    fill = sum(slice_s) + 2.0 * sum(links)
    into, out_of = least_links(matrix, range(K), default=0.0)
    for n, (k, a, z) in enumerate(slices):
        pair = Pair((a, z), k, (k, z - a, a == 0, z == L))
        outside = outside_s(size, pair, into, out_of, L)
        assert outside <= (fill - slice_s[n]) * (1 + 1e-12)
        # what the query's score bound is lowered by: every predicted iteration is at least m x the slice plan's
        # slowest stage + that (+ the tail)
        front = front_s(size, pair, into)
        assert m * slowest[n] + score_extra_s(front, outside) <= predicted * (1 + 1e-12)
        assert m * slowest[n] + score_extra_s(front, outside, z - a) <= predicted * (1 + 1e-12)
        assert m * slowest[n] + score_extra_s(front, outside, (z - a) // counts[n]) <= predicted * (1 + 1e-12)
        if counts[n] > m:  # more stages than micro-batches: no interleaving (SliceQuery.score_bound_at's [0])
            assert m * slowest[n] + score_extra_s(front, outside, 0) <= predicted * (1 + 1e-12)


def test_a_slice_whose_other_layers_have_no_other_island_has_no_pipeline():
    f = {x: (1.0, 0.5) for x in (*KINDS, "embedding", "head")}
    pf = PairFloors(["dense"] * 4, {0: f}, {0: 4}, 8)
    assert pf.floor(0, 0, 2) == (float("inf"), float("inf"))
    lat, score = pf.floor(0, 0, 4)  # the whole model: 4 layers + embedding + head on 4 GPUs
    assert score == pytest.approx(8 * 6 * 1.0 / 4) and lat == pytest.approx(7 * 6 / 4 + 6 * 0.5)
    assert pf.floor(1, 0, 2) == (0.0, 0.0)  # an island without floors: nothing is skipped


@pytest.mark.unit
def test_the_score_floor_adds_the_interleaved_bubble_or_the_fill_in_front():
    """By hand: two islands of 2 GPUs, four dense layers; island 1 takes twice island 0's floors. The pair (island
    1, layers 2-3 and the head): own GPU-seconds 8.4 on 2 GPUs (period 4.2), seconds 4.2; the rest (layers 0-1 and
    the embedding on island 0) 4.2 GPU-seconds on 2 GPUs, 2.1 s, all of it in front. m = 4: plain 1F1B's floor
    max(4 x 4.2 + 2.1, 4 x 2.1) = 18.9; interleaved, at most 2 chunks (2 layers), max(4 x 4.2 + 2.1 / 2, 4 x 2.1) =
    17.85; the lesser. m = 1: plain 4.2 + 2.1 = 6.3; interleaved 4.2 + 2.1 / 2 would be less, but one micro-batch's
    way through every layer's compute (6.3, bounds.chain_score_floor_s) lies under any score. A slice of one layer
    cannot interleave: with island 0 on 8 GPUs, island 1's layer 3 and the head take plain 1F1B's 4 x 2.2 + 3.1. The
    query's own term (size_floors.score_extra_s) is the fill in front / its chunks."""
    from tangram_launch.planner.size_floors import score_extra_s

    f0 = {"dense": (2.0, 1.0), "embedding": (0.2, 0.1), "head": (0.2, 0.1)}
    f1 = {x: (2.0 * g, 2.0 * t) for x, (g, t) in f0.items()}
    kinds = ["dense"] * 4
    lat, score = PairFloors(kinds, {0: f0, 1: f1}, {0: 2, 1: 2}, 4).floor(1, 2, 4)
    assert lat == pytest.approx(3 * 4.2 + 6.3) and score == pytest.approx(4 * 4.2 + 2.1 / 2)
    assert PairFloors(kinds, {0: f0, 1: f1}, {0: 2, 1: 2}, 1).floor(1, 2, 4)[1] == pytest.approx(4.2 + 2.1)
    # island 0's layers 2-3: the rest (island 1's layers 0-1, 8.4 GPU-seconds on 2 GPUs) is the slowest: m x it
    assert PairFloors(kinds, {0: f0, 1: f1}, {0: 2, 1: 2}, 4).floor(0, 2, 4)[1] == pytest.approx(4 * 4.2)
    assert PairFloors(kinds, {0: f0, 1: f1}, {0: 8, 1: 2}, 4).floor(1, 3, 4)[1] == pytest.approx(4 * 2.2 + 3.1)
    # 1/8 of the fill in front (8 chunks at most), whatever the fill behind (the slowest stage may come first)
    assert score_extra_s(1.0, 16.0) == 0.125 and score_extra_s(3.0, 0.0) == 0.375 and score_extra_s(0.0, 8.0) == 0.0
    # a slice of 4 layers interleaves in 4 chunks at most, one of 1 layer not at all
    assert score_extra_s(3.0, 16.0, 4) == 0.75 and score_extra_s(5.0, 16.0, 4) == 1.25
    assert score_extra_s(9.0, 16.0, 1) == 9.0


@pytest.mark.unit
def test_the_pair_floors_count_the_links_at_the_slices_ends():
    """Four dense layers of 1 s (2 GPU-s) on two islands of 2 GPUs, m = 4, a 3 s link from island 0 to island 1
    (1.5 s back). Without links the pair [2, 4) on island 1 has period 2, fill 2 + 2, 2 s in front: closed form
    3 x 2 + 4 = 10, plain 4 x 2 + 2 = 10, interleaved (2 layers: 2 chunks) 4 x 2 + 2 / 2 = 9. The link in front
    of it bounds the period (3) and adds twice itself to the fill (10) and to what is in front (8): closed form
    3 x 3 + 10 = 19, plain 4 x 2 + 8 = 16, interleaved the larger of 4 x 2 + 8 / 2 = 12 (not m x the link: the
    simulation takes it as latency) and micro-batch 0's way, 4 s of compute and the link twice each way (2 chunks),
    16. The pair [0, 2) on island 0 has the link behind it: the same closed form, nothing in front for the plain
    one (8, the lesser)."""
    from tangram_launch.planner.bounds import least_links

    f = {"dense": (2.0, 1.0), "embedding": (0.0, 0.0), "head": (0.0, 0.0)}
    kinds = ["dense"] * 4
    plain = PairFloors(kinds, {0: f, 1: f}, {0: 2, 1: 2}, 4)
    assert plain.floor(1, 2, 4) == pytest.approx((10.0, 9.0))
    links = least_links([[0.0, 3.0], [1.5, 0.0]], [0, 1])
    assert links == ({0: 1.5, 1: 3.0}, {0: 3.0, 1: 1.5})
    linked = PairFloors(kinds, {0: f, 1: f}, {0: 2, 1: 2}, 4, links)
    assert linked.floor(1, 2, 4) == pytest.approx((19.0, 16.0))
    assert linked.floor(0, 0, 2) == pytest.approx((19.0, 8.0))
    assert linked.floor(1, 0, 4) == plain.floor(1, 0, 4)  # the whole model: no link


def test_capacity_counts_a_slower_island_at_its_slowdown():
    """pair_floors.capacity: an island whose every kind takes twice the least GPU-seconds counts half its GPUs; a
    kind it has no floor for bounds nothing on it; so the other layers' period floor rises from GPU-seconds / GPUs."""
    from tangram_launch.planner.pair_floors import capacity

    fast = {"dense": (1.0, 0.5), "embedding": (0.2, 0.1), "head": (0.2, 0.1)}
    slow = {x: (2.0 * g, 2.0 * t) for x, (g, t) in fast.items()}
    mixed = {"dense": (3.0, 1.0), "embedding": (0.2, 0.1), "head": (0.4, 0.1)}  # r = min(3, 1, 2) = 1
    assert capacity(["dense"], {0: fast, 1: slow}, {0: 8, 1: 8}) == pytest.approx(8 + 8 / 2)
    assert capacity(["dense"], {0: fast, 1: mixed}, {0: 8, 1: 8}) == pytest.approx(16)
    no_head = {x: v for x, v in slow.items() if x != "head"}
    assert capacity(["dense"], {0: fast, 1: no_head}, {0: 4, 1: 8}) == pytest.approx(4 + 8 / 2)
    # the pair (0, [0, 1)) leaves layer 1 and the head (least 1.0 + 0.2 GPU-s) to islands 1 (slow) and 2 (fast):
    # capacity 4 / 2 + 4, not their 8 GPUs
    pf = PairFloors(["dense"] * 2, {0: fast, 1: slow, 2: fast}, {0: 16, 1: 4, 2: 4}, 8)
    lat, score = pf.floor(0, 0, 1)
    assert score == pytest.approx(8 * max(1.2 / 16, 1.2 / (4 / 2 + 4)))


# the quick tier keeps one runtime; the others are the same search with other capabilities (seconds each)
@pytest.mark.parametrize("runtime", [MEGATRON, pytest.param(TORCH, marks=pytest.mark.slow),
                                     pytest.param(DEEPSPEED, marks=pytest.mark.slow)],
                         ids=["megatron", "torch", "deepspeed"])
def test_skipping_pairs_finds_the_full_searchs_optimum_and_drops_the_same_islands(runtime):
    """The real megatron parallelizer (which gives compute floors) on a 3-island cluster: the search that skips
    pairs by their floor and the full search (branch_and_bound=False) find the same plan, under megatron (one
    grid), torch (per-stage grids, interleaving one grid: ranked by the predicted iteration) and deepspeed (no TP:
    the floors of its own grids)."""
    cl = ClusterSpec.from_dict({
        "name": "gen", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 10}},
        "nodes": [{"name": f"n{i}", "gpu": g, "count": 4} for i, g in enumerate(("a100-80gb", "v100-16gb", "t4"))]})
    model = ModelSpec(name="t6", num_layers=6, hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=1024,
                      vocab_size=1000, max_seq_len=256)
    training = TrainingSpec(global_batch=16, seq_len=256, dtype="fp16")
    on = search(cl, model, training, runtime=runtime, parallelizer=MegatronParallelizer(),
                options=PlannerOptions(max_workers=1))
    off = search(cl, model, training, runtime=runtime, parallelizer=MegatronParallelizer(),
                 options=PlannerOptions(max_workers=1, branch_and_bound=False))
    assert on.stats["pairs_skipped"] > 0 and off.stats["pairs_skipped"] == 0
    assert on.stats["queries"] < off.stats["queries"]
    assert on.stats["compose"]["best_closed_form_s"] == pytest.approx(off.stats["compose"]["best_closed_form_s"],
                                                                      rel=1e-12)
    assert on.plan.predicted.iteration_time_s == pytest.approx(off.plan.predicted.iteration_time_s, rel=1e-12)
    assert {d["island"] for d in on.plan.islands_dropped} == {d["island"] for d in off.plan.islands_dropped}


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([0.7, 1.0]))
def test_seed_chains_cover_the_model_with_kept_pairs_in_each_order(seed, keep_share):
    """size_search._seed_chains: per order, a pipeline of kept pairs over its islands, front to back, covering [0, L)
    contiguously (one pair per island); with every pair kept, one per order wherever the islands have a layer
    each. _seed_pairs asks those pairs' redundancy representatives."""
    from tangram_launch.planner.size_search import _seed_chains, _seed_pairs
    from tangram_launch.planner.slices import Pair

    floors, gpus, kinds, m, _slices, _closed, _period, _ = _instance(seed)
    rng = random.Random(seed)
    L, K = len(kinds), len(floors)
    pf = PairFloors(kinds, floors, gpus, m)
    pairs = [Pair((a, z), k, (k, z - a, a == 0, z == L)) for k in range(K) for a in range(L)
             for z in range(a + 1, L + 1) if rng.random() < keep_share]
    orders = [rng.sample(range(K), K) for _ in range(3)]
    chains = _seed_chains(pairs, pf, orders, L)
    for chain in chains:
        assert chain[0].layers[0] == 0 and chain[-1].layers[1] == L
        assert all(a.layers[1] == b.layers[0] for a, b in zip(chain, chain[1:]))
        assert set(chain) <= set(pairs)
        assert [p.island for p in chain] in orders
    if keep_share == 1.0 and 2 <= K <= L:
        assert len(chains) == len(orders)
    if K < 2:
        assert chains == []
    reps = {}
    for p in pairs:
        reps.setdefault(p.key, p)
    got = _seed_pairs(list(reps.values()), pairs, pf, orders, L)
    assert set(got) == {reps[p.key] for chain in chains for p in chain}


@pytest.mark.unit
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_the_capacity_period_is_under_every_placement_of_the_layers_on_the_islands(seed):
    """pair_floors.Capacity.period_s (the embedding and head at their own slowdown): under the period of any
    placement of every layer, the embedding and the head on islands' stages (a stage of g GPUs runs its share for
    at least its GPU-seconds on that island / g), islands without a floor for a kind holding none of it."""
    from tangram_launch.planner.pair_floors import capacities

    rng = random.Random(seed)
    K = rng.randint(1, 4)
    kinds = [rng.choice(KINDS) for _ in range(rng.randint(1, 10))]
    floors, gpus = {}, {}
    for k in range(K):
        speed = rng.uniform(1.0, 20.0)
        floors[k] = {x: (rng.uniform(0.1, 2.0) * (speed if rng.random() < 0.7 else rng.uniform(1.0, 20.0)), 0.0)
                     for x in (*KINDS, "embedding", "head") if k == 0 or rng.random() < 0.9}
        gpus[k] = rng.choice([1, 2, 4, 8])
    cap = capacities(kinds, floors, gpus)
    least = {x: min(f[x][0] for f in floors.values() if x in f) for x in (*KINDS, "embedding", "head")}
    floor_s = cap.period_s(sum(least[x] for x in kinds), least["embedding"] + least["head"])
    assert floor_s >= sum(least[x] for x in kinds) / sum(gpus.values()) * (1 - 1e-12)
    for _ in range(20):
        stages: dict[tuple[int, int], float] = {}  # (island, stage) -> GPU-seconds
        split = {k: rng.randint(1, gpus[k]) for k in range(K)}  # stages per island, GPUs spread evenly
        for x in [*kinds, "embedding", "head"]:
            k = rng.choice([o for o in range(K) if x in floors[o]])
            s = (k, rng.randrange(split[k]))
            stages[s] = stages.get(s, 0.0) + floors[k][x][0] * rng.choice([1.0, rng.uniform(1.0, 3.0)])
        period = max(g / (gpus[k] // split[k]) for (k, _j), g in stages.items())
        assert floor_s <= period * (1 + 1e-12)
