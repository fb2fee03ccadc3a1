"""``gpu_counts="all"`` (``--gpu-counts all``): the parallelizer offers a slice every GPU count whose stages can be
placed, not only powers of two within a node and whole nodes. The wider space holds the default's, and its plan is
no slower on generated clusters; the default's answers are unchanged (test_example_plans.py); both command lines
take the option into the one planning request, and give the same plan bytes."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from helpers_cli import REPO
from test_parallelizers import island, query
from test_planning_request import plan_and_launched_bytes

from tangram_launch.costmodel.breakdown import SliceCoster
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.launch import planning as planned, torchrun as launch
from tangram_launch.capabilities import StageShape
from tangram_launch.commands.plan import add_arguments
from tangram_launch.parallelizers.megatron import MegatronParallelizer, candidate_gpu_counts, stages_placeable
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.allocation import allocate_gpus
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import ModelSpec
from tangram_launch.specs.training import TrainingSpec


def _answer_counts(par: MegatronParallelizer, q) -> tuple[set[int], set[int]]:
    """(GPU counts of the grids offered, GPU counts of the answer's plans)."""
    grids = {g.num_gpus for g in par.grids(q, SliceCoster(q))}
    res = par.query(q)
    assert res.infeasible is None
    return grids, {p.num_gpus for p in res.plans}


def test_six_gpus_on_one_node_get_three_four_and_five_gpu_slices_only_with_the_option():
    q = query("opt-350m", island("a100-80gb", per_node=6), b=6, gb=24)
    tiling_grids, tiling_plans = _answer_counts(MegatronParallelizer(), q)
    all_grids, all_plans = _answer_counts(MegatronParallelizer(gpu_counts="all"), q)
    assert tiling_grids == {1, 2, 6} and all_grids == {1, 2, 3, 4, 5, 6}
    assert {3, 4, 5} <= all_plans and not {3, 4, 5} & tiling_plans
    assert 6 in all_plans and 6 in tiling_plans  # the whole node is a tiling count already
    with pytest.raises(SpecError) as err:
        MegatronParallelizer(gpu_counts="odd")
    assert err.value.field == "gpu_counts" and "tiling, all" in str(err.value)


@settings(max_examples=200, deadline=None)
@given(g=hst.integers(1, 8), nodes=hst.integers(1, 3), data=hst.data())
def test_every_offered_grid_is_placed_with_each_stage_in_one_node_or_on_whole_nodes(g, nodes, data):
    """stages_placeable's promise against allocation.allocate_gpus, which the plan's rank layout comes from; and
    the default's grids are a subset of the lifted ones."""
    n = data.draw(hst.integers(1, g * nodes))
    pp = data.draw(hst.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    if stages_placeable(n, pp, g) and n in candidate_gpu_counts(g * nodes, g):
        assert stages_placeable(n, pp, g, True) and n in candidate_gpu_counts(g * nodes, g, True)
    if not stages_placeable(n, pp, g, True):
        return
    isl = island("a100-80gb", nodes=nodes, per_node=g)
    sg = n // pp
    placed = allocate_gpus(isl, [StageShape(dp=sg)] * pp)
    assert placed is not None
    for stage in placed:
        used = {ref.node for ref in stage}
        assert len(used) == 1 or len(stage) == g * len(used), (n, pp, g, stage)


GPUS = ("a100-80gb", "v100-32gb", "t4", "l4")


def _two_islands(seed: int, per_node: list[int], runtime: str, gpu_counts: str):
    """The plan (None: nothing fits) for two islands of 3, 5 or 6 GPUs on one node each (counts the default
    cannot split in most ways), a 1.3B-class model of 8-12 layers, a small batch."""
    nodes = [{"name": f"{t}-0", "gpu": t, "count": c} for t, c in zip(GPUS[seed % 3:seed % 3 + 2], per_node)]
    cluster = ClusterSpec.from_dict({"name": f"gen-{seed}", "network": {"default": {"bandwidth_GBps": 6.0}},
                                     "nodes": nodes})
    model = ModelSpec(name="gen", num_layers=8 + seed % 5, hidden_size=2048, num_heads=16, num_kv_heads=16,
                      ffn_hidden_size=8192, vocab_size=32000, max_seq_len=2048)
    training = TrainingSpec(global_batch=(8, 16, 32)[seed % 3], seq_len=1024, dtype="fp16")
    try:
        return search(cluster, model, training, runtime=runtime, options=PlannerOptions(
            max_workers=1, progress=False, gpu_counts=gpu_counts)).plan
    except InfeasibleError:
        return None


def _lifted_no_worse(seed: int, per_node: list[int], runtime: str) -> None:
    default, lifted = (_two_islands(seed, per_node, runtime, gc) for gc in ("tiling", "all"))
    if default is None:
        return
    assert lifted is not None
    assert lifted.predicted.iteration_time_s <= default.predicted.iteration_time_s * (1 + 1e-12)
    assert lifted.planner["gpu_counts"] == "all" and "gpu_counts" not in default.planner


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=hst.integers(0, 10_000), per_node=hst.lists(hst.sampled_from((3, 5, 6)), min_size=2, max_size=2),
       runtime=hst.sampled_from(("torch", "megatron")))
def test_the_lifted_search_finds_a_plan_at_least_as_good_as_the_default(seed, per_node, runtime):
    _lifted_no_worse(seed, per_node, runtime)


def test_the_lifted_search_is_no_worse_on_the_case_hypothesis_found():
    """Once a gap (0.3385 s lifted against 0.3321 s): the T4 slice's 2 x TP 2 plan, offered only under "all", stood
    for its 3 x TP 2 plan (same bottleneck, less summed time: the closed form's dominance), which simulates faster
    behind the V100 stages. Slice plans now stand for others only as megatron.exact_front allows."""
    _lifted_no_worse(529, [3, 6], "torch")


def test_on_five_gpu_nodes_the_lifted_search_finds_a_faster_plan_on_four_of_them():
    """Five GPUs per node: the default may use 1 or 5 of them (5 does not divide the batch of 8 for DP)."""
    default, lifted = (_two_islands(7, [5, 5], "megatron", gc) for gc in ("tiling", "all"))
    assert lifted.predicted.iteration_time_s < default.predicted.iteration_time_s
    assert 4 in {s.num_gpus for s in lifted.stages} and 4 not in {s.num_gpus for s in default.stages}


def _plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--cluster", "c.yaml", *argv])


def test_both_command_lines_take_the_option_into_one_request():
    assert planned.planning_request(_plan_args("--model", "tiny")).options.gpu_counts == "tiling"
    plan_req = planned.planning_request(_plan_args("--model", "tiny", "--gpu-counts", "all"))
    launch_req = planned.plan_inputs(launch.TangramOptions(model="tiny", gpu_counts="all"))
    # (launch-time planning writes no progress: the one difference between the two)
    assert dataclasses.replace(plan_req.options, progress=False) == launch_req.options
    assert launch_req.options.gpu_counts == "all"
    assert "gpu_counts" in launch.TangramOptions(model="tiny", gpu_counts="all").planning_given()
    with pytest.raises(SpecError) as err:
        PlannerOptions(gpu_counts="every")
    assert err.value.field == "gpu_counts"


def test_a_parallelizer_instance_set_otherwise_is_refused():
    cluster = ClusterSpec.from_dict({"name": "one", "network": {"default": {"bandwidth_GBps": 6.0}},
                                     "nodes": [{"name": "a", "gpu": "a100-80gb", "count": 2}]})
    with pytest.raises(SpecError) as err:
        search(cluster, ModelSpec(name="m", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4,
                                  ffn_hidden_size=1024, vocab_size=1000, max_seq_len=256),
               TrainingSpec(global_batch=4, seq_len=128, dtype="fp16"), parallelizer=MegatronParallelizer(),
               options=PlannerOptions(max_workers=1, progress=False, gpu_counts="all"))
    assert err.value.field == "gpu_counts"


@pytest.mark.distributed
def test_plan_and_launch_time_planning_give_the_same_bytes_with_the_option(tmp_path):
    cluster = REPO / "examples" / "clusters" / "cpu-2.yaml"
    same = ("--cluster", str(cluster), "--model", "tiny", "--global-batch", "8", "--gpu-counts", "all")
    planned_bytes, launched = plan_and_launched_bytes(tmp_path, *same)
    assert planned_bytes == launched
    assert json.loads(launched)["planner"]["gpu_counts"] == "all"
