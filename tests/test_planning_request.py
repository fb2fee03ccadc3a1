"""One planning request for `tangram-launch plan` and launch-time planning (launch/planning.planning_request), with
one set of defaults, so the same arguments give the same plan bytes; and one runtime registry
(tangram_launch.capabilities.runtime) pairing each runtime's capabilities with its adapter, which a third-party
adapter joins through its entry point, is planned for, and is what a worker's plan hands back."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from helpers_cli import REPO, run_cli

from tangram_launch.capabilities import TORCH, capabilities_for, runtime, runtime_names
from tangram_launch.commands.plan import add_arguments
from tangram_launch.errors import SpecError
from tangram_launch.launch import planning as planned, torchrun as launch
from tangram_launch.plan import Plan

PLAN_WORKER = str(Path(__file__).parent / "scripts" / "plan_worker.py")


def _plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--cluster", "c.yaml", *argv])


def _same(a: planned.PlanningRequest, b: planned.PlanningRequest) -> None:
    assert a.model == b.model and a.training == b.training
    assert (a.runtime, a.parallelizer) == (b.runtime, b.parallelizer)
    assert (a.options.schedule, a.options.microbatch_sequences, a.options.pruning) == \
        (b.options.schedule, b.options.microbatch_sequences, b.options.pruning)


def test_both_command_lines_build_the_same_request_with_one_set_of_defaults():
    # Llama-3 8B's context is 8,192 tokens: without --seq-len both plan at most 2,048
    plan_req = planned.planning_request(_plan_args("--model", "llama3-8b"))
    launch_req = planned.plan_inputs(launch.TangramOptions(model="llama3-8b"))
    _same(plan_req, launch_req)
    assert (plan_req.seq_len, plan_req.dtype, plan_req.global_batch, plan_req.runtime, plan_req.schedule) == \
        (2048, "bf16", 8, "torch", "auto")
    given = ("--model", "tiny", "--global-batch", "12", "--seq-len", "32", "--dtype", "fp32", "--runtime", "deepspeed",
             "--parallelizer", "uniform")
    _same(planned.planning_request(_plan_args(*given)),
          planned.plan_inputs(launch.TangramOptions(model="tiny", global_batch=12, seq_len=32, dtype="fp32",
                                                    runtime="deepspeed", parallelizer="uniform")))


def test_a_short_model_context_is_kept_and_an_unknown_runtime_is_refused_naming_the_registered_ones():
    assert planned.planning_request(_plan_args("--model", "tiny")).seq_len == planned.default_seq_len(
        planned.planning_request(_plan_args("--model", "tiny")).model)
    with pytest.raises(SpecError) as err:
        planned.planning_request(_plan_args("--model", "tiny", "--runtime", "torchh"))
    assert err.value.field == "runtime" and "torch" in str(err.value) and "entry point" in str(err.value)


def test_the_registry_pairs_each_builtin_runtime_with_its_adapter():
    assert runtime_names()[:3] == ["torch", "deepspeed", "megatron"]
    assert runtime("torch").capabilities is TORCH is capabilities_for("torch")
    assert runtime("torch").adapter_target == "runtime_adapters.torch_native:TorchAdapter"


ADAPTER_MODULE = '''
import dataclasses
from tangram_launch.capabilities import TORCH
from runtime_adapters.torch_native import TorchAdapter


class ThirdAdapter(TorchAdapter):
    name = "third"
    capabilities = dataclasses.replace(TORCH, name="third", uniform_grid=True, schedules=("1F1B",))
'''


def _install_third_party(root: Path) -> None:
    """A real distribution on sys.path: its dist-info names the adapter under the entry point group."""
    (root / "third_rt.py").write_text(ADAPTER_MODULE)
    info = root / "third_rt-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: third-rt\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tangram_launch.runtime_adapters]\nthird = third_rt:ThirdAdapter\n")


def test_a_third_party_adapter_is_planned_for_and_handed_back_by_the_plan(tmp_path, monkeypatch):
    from tangram_launch.planner import PlannerOptions, make_plan
    from tangram_launch.specs.cluster import ClusterSpec
    from tangram_launch.worker import WorkerPlan

    _install_third_party(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "third" in runtime_names()
    req = planned.planning_request(_plan_args("--model", "tiny", "--runtime", "third", "--global-batch", "4",
                                              "--seq-len", "32", "--dtype", "fp32"))
    cluster = ClusterSpec.load(str(REPO / "examples" / "clusters" / "cpu-2.yaml"))
    plan = make_plan(cluster, req.model, req.training, runtime=req.runtime,
                     options=PlannerOptions(max_workers=1, progress=False))
    assert plan.runtime == "third"
    assert len({(s.tp, s.dp, s.cp) for s in plan.stages}) == 1  # its capabilities (one grid) were planned for
    me = WorkerPlan(plan_path="p.json", plan_hash="", plan_dict=plan.to_dict(), rank=0, local_rank=0,
                    world_size=plan.world_size, node="local", node_index=0, local_gpu=0, stage=0, island=None,
                    layers=None, torchrun_rank=0)
    adapter = me.adapter()
    assert type(adapter).__name__ == "ThirdAdapter" and adapter.capabilities.name == "third"


def plan_and_launched_bytes(tmp_path: Path, *same: str) -> tuple[bytes, bytes]:
    """(`plan -o`'s plan made canonical, the plan a 2-rank launch planned and wrote) for the same arguments."""
    run_cli(tmp_path, "plan", *same, "-o", "a.json")
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    run_cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), *same, PLAN_WORKER, str(out))
    files = sorted((logs / "tangram").glob("plan-*.json"))
    assert len(files) == 1, files
    return planned.canonical_plan_bytes(Plan.load(str(tmp_path / "a.json"))), files[0].read_bytes()


@pytest.mark.distributed
def test_plan_and_launch_time_planning_give_the_same_plan_bytes(tmp_path):
    cluster = REPO / "examples" / "clusters" / "cpu-2.yaml"
    same = ("--cluster", str(cluster), "--model", "tiny", "--global-batch", "8")  # no --seq-len, --dtype, --runtime
    planned_bytes, launched = plan_and_launched_bytes(tmp_path, *same)
    # the launcher writes canonical bytes (sorted keys, no wall-clock figures): `plan -o`'s plan, made canonical
    assert planned_bytes == launched
    assert json.loads(launched)["training"]["dtype"] == "bf16"
