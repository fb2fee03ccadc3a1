"""pair_floors.PipelineReach against brute force: every pipeline of live pairs (distinct islands, covering [0, L)
contiguously, as compose.py builds them) is enumerated on small generated instances, and a class that is part of one
must stay usable, also after prune()."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.planner.pair_floors import PipelineReach
from tangram_launch.planner.slices import Pair


def _pipelines(pairs: list[Pair], num_layers: int) -> list[list[Pair]]:
    """Every sequence of ``pairs`` on distinct islands covering [0, L) front to back."""
    out: list[list[Pair]] = []

    def grow(chain: list[Pair], at: int, used: frozenset) -> None:
        if at == num_layers:
            out.append(chain)
            return
        for p in pairs:
            if p.layers[0] == at and p.island not in used:
                grow([*chain, p], p.layers[1], used | {p.island})

    grow([], 0, frozenset())
    return out


def _instance(seed: int, keep_share: float) -> tuple[list[Pair], int, int]:
    """Pairs on K islands over L layers, each kept with ``keep_share``; the key as slices.build_pairs makes it
    (island, length, at layer 0, at layer L), so middle slices of one length share a class."""
    rng = random.Random(seed)
    K, L = rng.randint(1, 4), rng.randint(1, 7)
    pairs = [Pair((a, z), k, (k, z - a, a == 0, z == L)) for k in range(K) for a in range(L)
             for z in range(a + 1, L + 1) if rng.random() < keep_share]
    return pairs, K, L


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([0.3, 0.6, 1.0]), st.floats(0.0, 0.5))
def test_every_class_in_a_pipeline_of_live_pairs_stays_usable(seed, keep_share, dead_share):
    pairs, _K, L = _instance(seed, keep_share)
    rng = random.Random(seed + 1)
    keys = sorted({p.key for p in pairs})
    dead = {k for k in keys if rng.random() < dead_share}
    reach = PipelineReach(pairs, L)
    for key in dead:
        reach.kill(key)
    live = [p for p in pairs if p.key not in dead]
    held = {p.key for chain in _pipelines(live, L) for p in chain}
    for key in held:
        assert reach.usable(key), key
    for key in dead:
        assert not reach.usable(key)
    reach.prune()
    for key in held:
        assert reach.usable(key), key
    # a copy is killed apart from its original
    twin = reach.copy()
    for key in held:
        twin.kill(key)
        assert reach.usable(key) and not twin.usable(key)


@pytest.mark.unit
def test_with_two_islands_a_middle_slice_is_in_no_pipeline_and_a_dead_complement_rules_out_its_pair():
    """Two islands: a slice in the middle needs two others (one in front, one behind); a slice at layer 0 on one
    island is in a pipeline only with the other island's slice from its stop, so once that one holds no plan it is
    ruled out (and the pairs of other stops are not)."""
    L = 4
    pairs = [Pair((a, z), k, (k, z - a, a == 0, z == L)) for k in range(2) for a in range(L)
             for z in range(a + 1, L + 1)]
    reach = PipelineReach(pairs, L)
    middle = {p.key for p in pairs if 0 < p.layers[0] and p.layers[1] < L}
    assert middle and not any(reach.usable(k) for k in middle)
    assert all(reach.usable(p.key) for p in pairs if p.key not in middle)
    reach.kill((1, 2, False, True))  # island 1's [2, 4)
    assert not reach.usable((0, 2, True, False))  # island 0's [0, 2): its only pipeline holds [2, 4) on island 1
    assert reach.usable((0, 1, True, False)) and reach.usable((0, 3, True, False))


@pytest.mark.unit
@pytest.mark.parametrize("gpus", [("a100-80gb", "v100-16gb"), ("a100-80gb", "v100-16gb", "t4")], ids=["2", "3"])
def test_the_search_with_the_reach_finds_the_plan_of_the_search_without_it(gpus, monkeypatch):
    """The real megatron parallelizer on 2 and 3 islands: the search that skips pairs by PipelineReach and the one
    that asks every pair (usable() always true) choose the same plan and drop the same islands, with no more queries."""
    from tangram_launch.capabilities import MEGATRON
    from tangram_launch.parallelizers.megatron import MegatronParallelizer
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import ModelSpec
    from tangram_launch.specs.training import TrainingSpec

    cl = ClusterSpec.from_dict({
        "name": "gen", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 10}},
        "nodes": [{"name": f"n{i}", "gpu": g, "count": 4} for i, g in enumerate(gpus)]})
    model = ModelSpec(name="t12", num_layers=12, hidden_size=256, num_heads=8, num_kv_heads=4, ffn_hidden_size=1024,
                      vocab_size=1000, max_seq_len=256)
    training = TrainingSpec(global_batch=48, seq_len=256, dtype="fp16")

    def plan():
        return search(cl, model, training, runtime=MEGATRON, parallelizer=MegatronParallelizer(),
                      options=PlannerOptions(max_workers=1))

    on = plan()
    monkeypatch.setattr(PipelineReach, "usable", lambda self, key: True)
    off = plan()
    # with two islands every slice in the middle goes unasked; with three the chains may reach every pair
    assert on.stats["queries"] < off.stats["queries"] if len(gpus) == 2 else on.stats["queries"] <= off.stats["queries"]
    assert on.plan.predicted.iteration_time_s == pytest.approx(off.plan.predicted.iteration_time_s, rel=1e-12)
    assert on.plan.planner["b"] == off.plan.planner["b"]
    assert [s.layers for s in on.plan.stages] == [s.layers for s in off.plan.stages]
    assert {d["island"] for d in on.plan.islands_dropped} == {d["island"] for d in off.plan.islands_dropped}
