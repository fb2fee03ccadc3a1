"""The topology (rank -> stage, coordinates, every group) against a brute-force reading of the Plan's rank layout,
on seeded random heterogeneous plans, and the invariants every group set must keep."""
from __future__ import annotations

import random

import pytest
from helpers_plans import make_plan

from runtime_adapters.groups import group_layout
from tangram_launch.specs.shape import StageShape
from tangram_launch.topology import Topology

MODEL = {"name": "t", "num_layers": 8, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 4, "ffn_hidden_size": 128,
         "vocab_size": 128, "max_seq_len": 32}


def _random_plan(rng: random.Random):
    n = rng.randint(1, 4)
    uniform = rng.random() < 0.5
    grid = (rng.choice((1, 2)), rng.choice((1, 2, 3)))
    stages = []
    for i in range(n):
        tp, dp = grid if uniform else (rng.choice((1, 2, 4)), rng.choice((1, 2, 3)))
        layers = 8 // n + (8 % n if i == n - 1 else 0)  # the stages cover the model's 8 layers
        stages.append({"layers": layers, "gpus": f"n{i}", "tp": tp, "dp": dp})
    return make_plan(MODEL, stages, global_batch=12, num_microbatches=2)


def _brute(plan, rank):
    """Groups as read off the rank layout row by row (what Plan.place and groups.py computed before)."""
    me = plan.rank_layout[rank]
    mine = [r for r in plan.rank_layout if r.stage == me.stage]
    same = [(r.tp, r.cp, r.dp) == (me.tp, me.cp, me.dp) for r in plan.rank_layout]
    uniform = len({(s.tp, s.cp, s.dp) for s in plan.stages}) == 1
    return {"coords": (me.stage, me.dp, me.cp, me.tp),
            "tp": tuple(r.rank for r in mine if (r.dp, r.cp) == (me.dp, me.cp)),
            "cp": tuple(r.rank for r in mine if (r.dp, r.tp) == (me.dp, me.tp)),
            "dp": tuple(r.rank for r in mine if (r.cp, r.tp) == (me.cp, me.tp)),
            "pp": tuple(r.rank for r, s in zip(plan.rank_layout, same) if s) if uniform else None}


@pytest.mark.parametrize("seed", range(25))
def test_topology_matches_the_rank_layout_read_by_brute_force(seed):
    plan = _random_plan(random.Random(seed))
    topo = plan.topology
    assert topo.world_size == plan.world_size
    for rank in range(plan.world_size):
        want = _brute(plan, rank)
        assert tuple(topo.coords(rank)) == want["coords"]
        assert topo.rank_of(want["coords"][0], dp=want["coords"][1], cp=want["coords"][2],
                            tp=want["coords"][3]) == rank
        assert (topo.tp_group(rank), topo.cp_group(rank), topo.dp_group(rank), topo.pp_group(rank)) == (
            want["tp"], want["cp"], want["dp"], want["pp"])
        place = plan.place(rank)
        assert (place.tp_group, place.dp_group, place.pp_group) == (want["tp"], want["dp"], want["pp"])


@pytest.mark.parametrize("seed", range(10))
def test_each_kind_of_group_partitions_every_stage(seed):
    plan = _random_plan(random.Random(100 + seed))
    lay = group_layout(plan)
    for k, stage in enumerate(plan.stages):
        ranks = sorted(plan.topology.stage_ranks(k))
        for kind in (lay.tp, lay.cp, lay.dp):
            flat = sorted(r for g in kind[k] for r in g)
            assert flat == ranks
    if lay.pp:
        assert sorted(r for g in lay.pp for r in g) == list(range(plan.world_size))
        assert all(len(g) == plan.num_stages for g in lay.pp)


def test_expert_groups_fold_cp_and_dp_with_ep_fastest():
    # one stage, tp=2 cp=2 dp=2 ep=2: ranks = tp + 2 * (cp + 2 * dp); experts pair cp neighbours
    topo = Topology.from_shapes([StageShape(tp=2, cp=2, dp=2, ep=2)])
    assert topo.ep_group(0) == (0, 2) and topo.ep_group(1) == (1, 3) and topo.ep_group(4) == (4, 6)
    assert topo.ep_group(5) == (5, 7)
    four = Topology.from_shapes([StageShape(tp=1, dp=4, ep=4), StageShape(tp=1, dp=2, ep=1)])
    assert four.ep_group(2) == (0, 1, 2, 3) and four.ep_group(5) == (5,)


def test_stages_with_different_grids_have_no_pipeline_groups_but_know_their_neighbours():
    topo = Topology.from_shapes([StageShape(tp=2, dp=2), StageShape(tp=1, dp=2)])
    assert topo.pp_groups() == () and topo.pp_group(0) is None
    assert topo.stage_peers(0, 1) == (4, 5) and topo.stage_peers(4, 0) == (0, 1, 2, 3)
    assert topo.stage_peers(0, -1) == ()
    with pytest.raises(ValueError):
        topo.coords(6)
