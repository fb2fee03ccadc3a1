"""ClassScores.plain_floor_s with a cut (class_composition.py): where the plain 1F1B floor's cycle term already lies
above the cut, the path floor (costmodel.plain_1f1b_paths) is not computed. Checked against the floor without a
cut on every call of real searches: the same value where either is at or under the cut, else both above it (the
offers compose.offer_all scores, and so the plans, are the same), and fewer path floors computed."""
from __future__ import annotations

import math

import pytest

import tangram_launch.planner.class_composition as class_composition
from tangram_launch.islands import build_islands
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec


def _watched_search(monkeypatch, cluster_file: str, runtime: str, model: str, global_batch: int):
    """A search in which every plain_floor_s call is also made without a cut: (calls, path floors with the cut,
    path floors without it, the plan); each call as (value, value without a cut, cut)."""
    paths = {"n": 0}
    path_floor = class_composition.path_floor_1f1b_s

    def counted(*args):
        paths["n"] += 1
        return path_floor(*args)

    monkeypatch.setattr(class_composition, "path_floor_1f1b_s", counted)
    plain = class_composition.ClassScores.plain_floor_s
    calls, fast, slow = [], [0], [0]

    def watched(self, seq, metrics, *, round_trips, exact=True, cut=math.inf):
        before = paths["n"]
        value = plain(self, seq, metrics, round_trips=round_trips, exact=exact, cut=cut)
        fast[0] += paths["n"] - before
        before = paths["n"]
        ref = plain(self, seq, metrics, round_trips=round_trips, exact=exact)
        slow[0] += paths["n"] - before
        calls.append((value, ref, cut))
        return value

    monkeypatch.setattr(class_composition.ClassScores, "plain_floor_s", watched)
    cluster = ClusterSpec.load(cluster_file)
    plan = search(cluster, load_model(model), TrainingSpec(global_batch=global_batch, seq_len=2048, dtype="fp16"),
                  runtime=runtime, islands=build_islands(cluster, dtype="fp16"),
                  options=PlannerOptions(max_workers=1, progress=False)).plan
    return calls, fast[0], slow[0], plan


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["deepspeed", "megatron"])
def test_the_cut_floor_is_the_floor_or_above_the_cut(monkeypatch, cluster_path, runtime):
    calls, fast, slow, plan = _watched_search(monkeypatch, cluster_path("c3-4-islands-20gpu"), runtime,
                                              "gpt3-2.7b", 64)
    assert plan.predicted.iteration_time_s > 0
    assert calls
    for value, ref, cut in calls:
        assert value <= ref  # the larger of some of the floor's terms: still a floor
        assert value == ref or (value > cut and ref > cut), (value, ref, cut)
    assert fast <= slow


@pytest.mark.slow
def test_the_cut_skips_path_floors(monkeypatch, cluster_path):
    """On the 4-island cluster under megatron many offers' cycle floors are above the cut: the path floor is
    computed for fewer of them (about half)."""
    calls, fast, slow, _plan = _watched_search(monkeypatch, cluster_path("c3-4-islands-20gpu"), "megatron",
                                               "gpt3-2.7b", 64)
    assert fast < 0.75 * slow
