"""An island the best plan leaves whole nodes of idle is planned once more split in two (planner/island_split.py).

OPT-350M in tf32 on 32 A100-40GB + 96 V100-16GB (the example cluster opt350m-128gpu): with one slice per island the
V100 slice is one stage of 64 GPUs (dp is capped at the micro-batch's 32 sequences) and 32 V100s stay idle; split,
the V100s take a layer on 32 GPUs and two on 64, a plan no slower than the same stages written by hand.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.cli import main
from tangram_launch.islands import Island, IslandSet
from tangram_launch.planner.island_split import in_pipeline_order, split_idle
from tangram_launch.specs.catalog import default_catalog
from tangram_launch.specs.cluster import GpuRef, LinkSpec

CLUSTER = os.path.join(os.path.dirname(__file__), "..", "examples", "clusters", "opt350m-128gpu.yaml")
OPT_TF32 = ["--model", "opt-350m", "--global-batch", "1024", "--seq-len", "2048", "--dtype", "tf32", "--workers", "1",
            "--schedule", "1F1B"]


class _Stage:
    def __init__(self, index, island, gpus):
        self.index, self.island, self.gpus = index, island, gpus


class _Plan:
    def __init__(self, stages):
        self.stages = stages


def _island(name: str, num_nodes: int, per_node: int = 4) -> Island:
    nodes = tuple(f"{name}-{i}" for i in range(num_nodes))
    return Island(name=name, nodes=nodes, gpus=tuple(GpuRef(n, k) for n in nodes for k in range(per_node)),
                  gpus_per_node=per_node, gpu=default_catalog().lookup("v100-16gb"),
                  inter_node_link=LinkSpec(bandwidth_GBps=6.0, latency_us=50.0) if num_nodes > 1 else None)


@pytest.mark.unit
@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.integers(2, 12).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1))))
def test_the_parts_cover_the_island_once_used_nodes_first_and_in_node_order_once_reordered(case):
    n, used = case
    isl = _island("v", n)
    other = _island("w", 1)  # used whole
    iset = IslandSet((other, isl), ())
    plan = _Plan([_Stage(0, "w", [(other.nodes[0], 0)]), _Stage(1, "v", [(isl.nodes[i], 0) for i in sorted(used)])])
    split = split_idle(iset, plan)
    if len(used) == n:  # nothing idle: nothing to split
        assert split is None
        return
    new, parts = split
    assert parts == {"v": ["v.a", "v.b"]} and new.by_name("w") == other
    a, b = new.by_name("v.a"), new.by_name("v.b")
    assert set(a.nodes) == {isl.nodes[i] for i in used} and set(a.nodes) | set(b.nodes) == set(isl.nodes)
    assert not set(a.nodes) & set(b.nodes) and a.num_gpus + b.num_gpus == isl.num_gpus
    for part in (a, b):  # the island's figures; a one-node part has no inter-node link
        assert part.gpu == isl.gpu and (part.inter_node_link is None) == (part.num_nodes == 1)
    # the idle part placed first in the pipeline: laid out again on the island's first nodes, same node counts
    later = _Plan([_Stage(0, "v.b", [(b.nodes[0], 0)]), _Stage(1, "v.a", [(a.nodes[0], 0)])])
    again = in_pipeline_order(iset, new, parts, later)
    if b.nodes == isl.nodes[:b.num_nodes]:  # the idle nodes are the island's first already
        assert again is None
        return
    assert again is not None
    first, second = again[0].by_name("v.a"), again[0].by_name("v.b")
    assert first.nodes == isl.nodes[:b.num_nodes] and second.nodes == isl.nodes[b.num_nodes:]
    assert in_pipeline_order(iset, again[0], again[1], _Plan([_Stage(0, "v.a", []), _Stage(1, "v.b", [])])) is None


@pytest.mark.slow  # three searches of 128 GPUs: about two seconds
def test_tf32_opt350m_uses_all_128_gpus_and_matches_the_same_stages_written_by_hand(tmp_path, capsys):
    assert main(["plan", "--cluster", CLUSTER, *OPT_TF32, "-o", str(tmp_path / "searched.json")]) == 0
    out = capsys.readouterr().out
    assert "islands split in two" in out and "v100-16gb: 8 nodes for stage 1, 16 nodes for stage 2" in out
    searched = json.loads((tmp_path / "searched.json").read_text())
    assert sum(len(s["gpus"]) for s in searched["stages"]) == 128
    assert [s["island"] for s in searched["stages"]] == ["a100-40gb", "v100-16gb", "v100-16gb"]
    split = searched["planner"]["islands_split"]
    assert searched["predicted"]["iteration_time_s"] < split["unsplit_iteration_s"]
    # the same three stages by hand (layer 21 on 32 V100s, 22-23 on 64): the search is no slower, on the same GPUs
    manual = {"stages": [{"layers": [0, 21], "island": "a100-40gb"},
                         {"layers": [21, 22], "island": "v100-16gb", "num_gpus": 32},
                         {"layers": [22, 24], "island": "v100-16gb", "num_gpus": 64}]}
    (tmp_path / "hand.yaml").write_text(yaml.safe_dump(manual))
    assert main(["plan", "--cluster", CLUSTER, *OPT_TF32, "--plan", str(tmp_path / "hand.yaml"),
                 "-o", str(tmp_path / "hand.json")]) == 0
    hand = json.loads((tmp_path / "hand.json").read_text())
    assert searched["predicted"]["iteration_time_s"] <= hand["predicted"]["iteration_time_s"] + 1e-9
    assert [s["gpus"] for s in hand["stages"]] == [s["gpus"] for s in searched["stages"]]
    # the planner API with the split off gives the plan over the islands as built
    from tangram_launch.planner import PlannerOptions, search
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.specs.model import load_model
    from tangram_launch.specs.training import TrainingSpec

    off = search(ClusterSpec.load(CLUSTER), load_model("opt-350m"),
                 TrainingSpec(global_batch=1024, seq_len=2048, dtype="tf32"), runtime="torch",
                 options=PlannerOptions(max_workers=1, progress=False, schedule="1F1B", split_idle_islands=False))
    assert off.plan.predicted.iteration_time_s == pytest.approx(split["unsplit_iteration_s"], rel=1e-12)
    assert off.plan.world_size == 96 and "islands_split" not in off.plan.planner


@dataclasses.dataclass(frozen=True)
class _FakeStage:
    index: int
    island: str


@dataclasses.dataclass(frozen=True)
class _FakePlan:
    iteration_s: float
    stages: tuple = (_FakeStage(0, "v-used"), _FakeStage(1, "v-idle"))
    islands_used: tuple = ("v-used", "v-idle")
    planner: tuple = ()

    @property
    def predicted(self):
        return types.SimpleNamespace(iteration_time_s=self.iteration_s)


def _fake_result(iteration_s: float, planning_s: float, islands=None):
    return types.SimpleNamespace(plan=_FakePlan(iteration_s), stats={"planning_time_s": planning_s}, islands=islands,
                                 parallelizer=None)


@pytest.mark.unit
@pytest.mark.parametrize("outcome, plan_s, planning_s", [
    ("split slower", 10.0, 3.0), ("split infeasible", 10.0, 3.0),
    ("reordered slower", 8.0, 7.0), ("reordered faster", 7.0, 7.0)])
def test_the_plans_planning_time_counts_every_search_the_split_ran(monkeypatch, outcome, plan_s, planning_s):
    """The first search took 1 s, the split one 2 s, the split re-ordered 4 s: the plan's planning time is the sum
    of the searches run, kept or not, infeasible or not (fakes for the searches and the islands, whose outcome is
    chosen; the real searches are test_tf32_opt350m_...'s)."""
    from tangram_launch.errors import InfeasibleError
    from tangram_launch.planner import plan_search

    clock = [0.0]
    monkeypatch.setattr(plan_search.time, "perf_counter", lambda: clock[0])
    iset = types.SimpleNamespace(islands=(types.SimpleNamespace(name="v-used", num_nodes=1),
                                          types.SimpleNamespace(name="v-idle", num_nodes=1)))
    parts = {"v": ("v-used", "v-idle")}
    monkeypatch.setattr(plan_search, "split_idle", lambda islands, plan: (iset, parts))
    monkeypatch.setattr(plan_search, "in_pipeline_order", lambda *a: (iset, parts))
    outcomes = {"split slower": [(11.0, 2.0)], "split infeasible": [(None, 2.0)],
                "reordered slower": [(8.0, 2.0), (9.0, 4.0)], "reordered faster": [(8.0, 2.0), (7.0, 4.0)]}[outcome]

    def search(*args, **kwargs):
        iteration_s, took_s = outcomes.pop(0)
        clock[0] += took_s
        if iteration_s is None:
            raise InfeasibleError("no plan on the split islands", [])
        return _fake_result(iteration_s, took_s)

    monkeypatch.setattr(plan_search, "_search", search)
    # the split plan as a user writes it down is costed by the hand-written path (tests/test_searched_plan_by_hand.py);
    # these fakes are no plan it can cost: as where it cannot, the split plan stands as searched
    monkeypatch.setattr(plan_search, "_as_written", lambda *a, **kw: None)
    first = _fake_result(10.0, 1.0, islands=iset)
    got = plan_search._with_idle_split(first, None, None, None, runtime="torch", pool=None,
                                       options=plan_search.PlannerOptions())
    assert not outcomes  # every search the outcome names ran
    assert got.plan.predicted.iteration_time_s == plan_s
    assert got.stats["planning_time_s"] == planning_s == dict(got.plan.planner)["planning_time_s"]
