"""planner/twin_classes.py: a class whose options repeat another's (Megatron's grids with the same tp and dp x cp) is
composed once, and the plan stays the one the full search picks."""
from __future__ import annotations

import os

import pytest

from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.grid_classes import class_members
from tangram_launch.planner.twin_classes import TwinClasses

CLUSTERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "clusters")


def _search(cluster_name: str, model_name: str, global_batch: int, seq_len: int, runtime: str = "megatron"):
    from tangram_launch.islands import build_islands
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec
    cluster = ClusterSpec.load(os.path.join(CLUSTERS, f"{cluster_name}.yaml"))
    training = TrainingSpec(global_batch=global_batch, seq_len=seq_len, dtype="fp16")
    r = search(cluster, load_model(model_name), training, runtime=runtime,
                   islands=build_islands(cluster, dtype="fp16"),
                   options=PlannerOptions(max_workers=1, progress=False))
    return r, r.plan.planner["compose"]["dp_runs"]  # the DP passes the search ran


def _untimed(plan) -> dict:
    """The plan's dict without the planner's own timings (CPU seconds differ from run to run) and counts of work."""
    d = plan.to_dict()
    d["planner"] = {k: v for k, v in d["planner"].items() if not k.endswith("time_s") and k != "compose"}
    return d


def _stage_numbers(cand, i):
    return [(s.layers, s.forward_s, s.backward_s, s.static_bytes, s.activation_bytes, s.dp_sync_s, s.optimizer_s,
             s.p2p_bytes, s.shape.tp, s.shape.ep, s.shape.dp * s.shape.cp, s.shape.zero_stage, s.shape.recompute,
             s.shape.offload) for s in cand.slice_plan(i).stages]


@pytest.mark.slow  # planner searches on the paper's C3 clusters, twice each (seconds)
def test_twins_built_stages_are_the_same_forward_and_backward():
    """What twin_classes.py takes on trust: the numbers a twin check reads (a stage's forward + backward as one sum) hide
    no difference the simulation would see. Every twin option's built stages are compared."""
    r, _ = _search("c3-full-het-iii", "gpt3-13b", 128, 2048)
    compared = grids = 0
    for b, cand in sorted(r.all_candidates.items()):
        twins = TwinClasses(cand)
        for group, idx in class_members(cand.groups).items():
            other = twins.twin_of(idx, None)
            if other is None:
                continue
            assert cand.groups[other[0]] != group  # another class: another (tp, dp, cp)
            grids += 1
            for i, j in list(zip(other, idx))[::5]:
                assert _stage_numbers(cand, i) == _stage_numbers(cand, j), (b, group)
                a, z = cand.slice_plan(i).stages[0].shape, cand.slice_plan(j).stages[0].shape
                assert (a.dp, a.cp) != (z.dp, z.cp)
                compared += 1
    assert grids >= 5 and compared >= 500  # C3 (iii) under megatron has twins at several micro-batch sizes


@pytest.mark.slow  # planner searches on the paper's C3 clusters, twice each (seconds)
@pytest.mark.parametrize("cluster_name", ["c3-full-het-iii", "c3-4-islands-20gpu"])
def test_composing_each_set_of_twins_once_keeps_the_plan(cluster_name, monkeypatch):
    """The same plan, to the byte, with fewer DP passes: a twin can only tie what its first twin found."""
    with_twins, runs = _search(cluster_name, "gpt3-13b", 128, 2048)

    def none(self, idx, schedules):  # every class composed, as before twins were known
        return None

    monkeypatch.setattr(TwinClasses, "twin_of", none)
    every, runs_every = _search(cluster_name, "gpt3-13b", 128, 2048)
    assert _untimed(with_twins.plan) == _untimed(every.plan)
    assert runs < runs_every


@pytest.mark.slow  # planner searches on the paper's C3 clusters, twice each (seconds)
def test_classes_with_other_numbers_are_not_twins():
    r, _ = _search("c3-full-het-iii", "gpt3-13b", 128, 2048)
    cand = r.all_candidates[r.plan.planner["b"]]
    classes = list(class_members(cand.groups).values())
    twins = TwinClasses(cand)
    assert twins.twin_of(classes[0], None) is None
    assert twins.twin_of(classes[0], "other schedules") is None  # the schedules are part of what must agree
    assert twins.twin_of(list(classes[0]), None) is classes[0]  # the same options again
    shifted = list(classes[0])[1:] + list(classes[0])[:1]
    assert len(classes[0]) == 1 or twins.twin_of(shifted, None) is None
