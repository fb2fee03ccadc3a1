"""The Plan artifact: round trips, invariants, a worker's place, capabilities."""
import dataclasses
import json

import pytest

from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH, capabilities_for
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan, Prediction, Stage, StagePrediction
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec


def pred(n):
    return Prediction(1.0, 100.0, 0.4, tuple(StagePrediction(0.1, 0.2, 1.0, 16.0) for _ in range(n)))


def make(stages, *, global_batch=8, m=4, model="tiny", **kw):
    spec = load_model(model)
    st = []
    for i, (layers, gpus, extra) in enumerate(stages):
        st.append(Stage(index=i, layers=layers, island=extra.pop("island", "cpu"), gpus=tuple(gpus),
                        has_embedding=i == 0, has_head=i == len(stages) - 1, **extra))
    return Plan(model=spec.to_dict(), training=TrainingSpec(global_batch=global_batch, seq_len=64).to_dict(),
                stages=tuple(st), num_microbatches=m, predicted=pred(len(st)), **kw)


def two_by_two():
    # stage 0: layers [0,3) on n1 (tp 2), stage 1: layer [3,4) on n0 (dp 2): non-contiguous node order
    return make([((0, 3), [("n1", 0), ("n1", 1), ("n1", 2), ("n1", 3)], dict(tp=2, dp=2, micro_batch_size=1)),
                 ((3, 4), [("n0", 0), ("n0", 1)], dict(dp=2, micro_batch_size=1))])


def test_round_trip_json_yaml(tmp_path):
    p = two_by_two()
    for name in ("p.json", "p.yaml"):
        p.dump(tmp_path / name)
        q = Plan.load(tmp_path / name)
        assert q == p and q.content_hash() == p.content_hash()
    d = json.loads(p.to_json())
    assert d["stages"][0]["layers"] == [0, 3] and d["stages"][0]["num_gpus"] == 4
    assert d["rank_layout"][4] == {"rank": 4, "node": "n0", "local_gpu": 0, "stage": 1,
                                   "coords": {"pp": 1, "dp": 0, "cp": 0, "tp": 0}}
    for key in ("num_microbatches", "schedule", "islands_used", "islands_dropped", "predicted"):
        assert key in d


def test_place_groups():
    p = two_by_two()
    pl = p.place(3)  # stage 0, tp 1, dp 1
    assert pl.stage.index == 0 and pl.layers == (0, 3) and pl.node == "n1" and pl.local_gpu == 3
    assert pl.tp_group == (2, 3) and pl.dp_group == (1, 3) and pl.coords == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert pl.pp_group is None  # grids differ between stages
    assert pl.next_stage_ranks == (4, 5) and pl.prev_stage_ranks == ()
    last = p.place(5)
    assert last.is_last_stage and last.dp_group == (4, 5) and last.tp_group == (5,)


def test_uniform_grid_pp_group():
    p = make([((0, 2), [("n", 0), ("n", 1)], dict(dp=2)), ((2, 4), [("n", 2), ("n", 3)], dict(dp=2))], m=4,
             global_batch=8)
    assert p.place(1).pp_group == (1, 3) and p.place(3).prev_stage_ranks == (1,)


@pytest.mark.parametrize("build, match", [
    (lambda: make([((0, 2), [("n", 0)], {}), ((3, 4), [("n", 1)], {})], global_batch=4), "contiguously"),
    (lambda: make([((0, 2), [("n", 0)], {}), ((2, 3), [("n", 1)], {})], global_batch=4), "model has 4"),
    (lambda: make([((0, 2), [("n", 0)], {}), ((2, 4), [("n", 0)], {})], global_batch=4), "used by stages 0 and 1"),
    (lambda: make([((0, 4), [("n", 0), ("n", 1)], dict(dp=2))], global_batch=4), "global batch 4"),
    (lambda: make([((0, 4), [("n", 0)], dict(tp=2))], global_batch=4), "tp\\*dp\\*cp = 2"),
    (lambda: make([((0, 4), [("n", 0)], dict(recompute="most"))], global_batch=4), "none, selective, full"),
    (lambda: make([((0, 4), [("n", 0)], dict(zero_stage=4))], global_batch=4), "zero_stage"),
])
def test_invariants(build, match):
    with pytest.raises(SpecError, match=match):
        build()


def test_tampered_rank_layout_refused(tmp_path):
    d = two_by_two().to_dict()
    d["rank_layout"][0]["node"], d["rank_layout"][4]["node"] = "n0", "n1"
    with pytest.raises(SpecError, match="rank_layout"):
        Plan.from_dict(d)
    d = two_by_two().to_dict()
    d["stages"][0]["bogus"] = 1
    with pytest.raises(SpecError, match="bogus"):
        Plan.from_dict(d, source="x.json")


def test_capabilities():
    p = two_by_two()
    assert any("one (tp, dp, cp) grid" in x for x in DEEPSPEED.plan_problems(p))
    assert TORCH.plan_problems(p) == []  # per-stage grids: runtime_adapters/schedule.py re-splits the rows
    moe = dataclasses.replace(p, model={**p.model, "num_experts": 4, "top_k": 2})
    assert any("one TP size" in x for x in TORCH.plan_problems(moe))  # MoE models keep one grid under torch
    q = make([((0, 2), [("n", 0), ("n", 1)], dict(dp=2, zero_stage=2)), ((2, 4), [("n", 2), ("n", 3)], dict(dp=2))])
    assert any("ZeRO stage <= 1" in x for x in DEEPSPEED.plan_problems(q))
    assert MEGATRON.plan_problems(make([((0, 4), [("n", 0)], {})], global_batch=4)) == []
    with pytest.raises(SpecError, match="did you mean 'deepspeed'"):
        capabilities_for("deepspeeed")
