"""Hand-written plans with their own grid per stage (``tangram-launch plan --plan``): a stage's tp, dp and cp imply its
GPUs, any shape the runtime runs is accepted (dp 2 on two GPUs of a three-GPU node, then dp 1 on the third), and a
refusal names the stage's field and why. The 3-rank dp2 + dp1 plan, written as YAML or as JSON, trains on 3 CPU ranks
with examples/train_gpt.py exactly as a single-process run of the same model and batch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers_cli import REPO, run_cli

from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.planner import PlannerOptions
from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan
from tangram_launch.specs.cluster import ClusterSpec
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

CPU3 = {"name": "cpu-3", "nodes": [{"name": "local", "host": "localhost", "gpu": "cpu", "count": 3}]}
DP2_DP1 = {"stages": [{"layers": [0, 2], "island": "cpu", "dp": 2, "num_gpus": 2},
                      {"layers": [2, 4], "island": "cpu", "dp": 1}]}
TRAINING = TrainingSpec(global_batch=4, seq_len=32, dtype="fp32")
SERIAL = PlannerOptions(max_workers=1, progress=False)


def _cost(data, training=TRAINING):
    model = load_model("tiny")
    manual = parse_manual_plan(data, num_layers=model.num_layers, island_names=["cpu"])
    return cost_manual_plan(manual, ClusterSpec.from_dict(CPU3), model, training, runtime="torch", options=SERIAL)


def test_grid_fields_imply_the_stage_gpus():
    manual = parse_manual_plan({"stages": [{"layers": [0, 2], "island": "cpu", "dp": 2},
                                           {"layers": [2, 4], "island": "cpu", "tp": 2, "cp": 1}]},
                               num_layers=4, island_names=["cpu"])
    assert [s.num_gpus for s in manual.stages] == [2, 2]
    assert "num_gpus" not in manual.stages[0].fixed  # (the fields the user gave)
    given = parse_manual_plan({"stages": [{"layers": [0, 4], "island": "cpu", "dp": 2, "num_gpus": 4},
                                          {"layers": [4, 6], "island": "cpu"}]},
                              num_layers=6, island_names=["cpu"])
    assert [s.num_gpus for s in given.stages] == [4, None]  # dp 2 of 4 GPUs: tp 2; no grid: the planner's choice


def test_a_gpu_count_the_grid_does_not_divide_is_refused_naming_the_field():
    with pytest.raises(SpecError) as err:
        parse_manual_plan({"stages": [{"layers": [0, 4], "island": "cpu", "dp": 2, "num_gpus": 3}]},
                          num_layers=4, island_names=["cpu"])
    assert err.value.field == "stages[0].num_gpus" and "dp=2" in str(err.value)


def test_dp2_then_dp1_on_a_three_gpu_island_is_accepted():
    plan = _cost(DP2_DP1)
    assert [(s.dp, s.num_gpus, s.micro_batch_size) for s in plan.stages] == [(2, 2, 1), (1, 1, 2)]
    assert plan.world_size == 3 and plan.num_microbatches == 2
    assert not plan.stages[0].gpus[0] in plan.stages[1].gpus


def test_a_stage_grid_that_cannot_run_is_refused_with_the_field_and_why():
    # dp 2 cannot split a micro-batch of one sequence, and a global batch of 1 has no other
    with pytest.raises(InfeasibleError) as err:
        _cost(DP2_DP1, TrainingSpec(global_batch=1, seq_len=32, dtype="fp32"))
    text = "\n".join(err.value.reasons)
    assert "stages[0]" in text and "dp=2 must divide the 1 sequences" in text
    # more GPUs than the stage may take on its island
    too_many = {"stages": [{"layers": [0, 2], "island": "cpu", "dp": 4},
                           {"layers": [2, 4], "island": "cpu", "dp": 1}]}
    with pytest.raises(InfeasibleError) as err:
        _cost(too_many)
    assert "stages[0]" in "\n".join(err.value.reasons) and "GPUs" in "\n".join(err.value.reasons)


def _train(tmp_path: Path, plan: str, nproc: int, out: str, *planning: str) -> list[float]:
    run_cli(tmp_path, "--standalone", "--nproc-per-node", str(nproc), "--plan", plan, *planning,
            str(REPO / "examples" / "train_gpt.py"), "--steps", "4", "--data", "synthetic", "--quiet", "--out", out)
    return json.loads((tmp_path / out).read_text())["losses"]


@pytest.mark.distributed
def test_dp2_dp1_plan_from_yaml_or_json_trains_on_three_ranks_as_one_process(tmp_path):
    from helpers_plans import make_plan
    from tangram_launch.launch.planning import canonical_plan_bytes
    from tangram_launch.plan import Plan

    (tmp_path / "cpu3.yaml").write_text(yaml.safe_dump(CPU3))
    (tmp_path / "manual.yaml").write_text(yaml.safe_dump(DP2_DP1))
    (tmp_path / "manual.json").write_text(json.dumps(DP2_DP1))
    costed = {}
    for src in ("manual.yaml", "manual.json"):  # the launcher runs costed plans: cost each, then launch the JSON
        out = src.replace("manual.", "costed-") + ".json"
        run_cli(tmp_path, "plan", "--cluster", "cpu3.yaml", "--model", "tiny", "--global-batch", "4", "--seq-len", "32",
             "--dtype", "fp32", "--runtime", "torch", "--workers", "1", "--plan", src, "-o", out)
        costed[src] = Plan.load(str(tmp_path / out))
    yaml_plan, json_plan = costed["manual.yaml"], costed["manual.json"]
    assert json.loads(canonical_plan_bytes(yaml_plan)) | {"planner": None} == \
        json.loads(canonical_plan_bytes(json_plan)) | {"planner": None}  # (the planner block names its source)
    assert [(s.dp, s.num_gpus) for s in yaml_plan.stages] == [(2, 2), (1, 1)]
    make_plan("tiny", [(4, "local")], global_batch=4, num_microbatches=yaml_plan.num_microbatches,
              seq_len=32).dump(str(tmp_path / "one.json"))
    reference = _train(tmp_path, "one.json", 1, "one-out.json")
    for src in ("costed-yaml.json", "costed-json.json"):
        got = _train(tmp_path, src, 3, f"{src}-out.json")
        assert got == pytest.approx(reference, abs=2e-5), src
    # and the hand-written YAML as it is: the launcher costs it from the same planning request, then launches it
    got = _train(tmp_path, "manual.yaml", 3, "direct-yaml-out.json", "--cluster", "cpu3.yaml", "--model", "tiny",
                 "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32", "--runtime", "torch")
    assert got == pytest.approx(reference, abs=2e-5), "manual.yaml launched directly"
    assert abs(reference[-1] - reference[0]) > 1e-2  # the steps trained: equal losses are not equal inits
