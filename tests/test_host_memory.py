"""A node's host memory bounds optimizer offload (costmodel/host_memory.py): ``host_memory_gib`` in the cluster file,
one rule for the planner's search, hand-written plans and ``tangram-launch estimate --offload``, and unknown host
memory changes nothing."""
from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.cli import main
from tangram_launch.costmodel.host_memory import (
    USABLE_HOST_MEMORY_FRACTION,
    fits_host_memory,
    host_memory_problem,
)
from tangram_launch.errors import InfeasibleError, SpecError
from tangram_launch.islands import build_islands
from tangram_launch.planner import PlannerOptions, make_plan
from tangram_launch.planner.manual import cost_manual_plan, parse_manual_plan
from tangram_launch.specs.cluster import ClusterSpec, NodeHostMemory
from tangram_launch.specs.constants import GIB
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

SERIAL = PlannerOptions(max_workers=1, progress=False)
# llama3-8b on H100s in bf16 under the torch runtime: one GPU holds its fp32 parameters and gradients (~60 GiB) but
# not Adam's moments too, so offload is what fits; the host then keeps ~90 GiB (moments + fp32 master copy)
SMALL_HOST_GIB, AMPLE_HOST_GIB = 64, 2048


def _cluster(count: int, host_memory_gib: float | None) -> ClusterSpec:
    node = {"name": "n0", "gpu": "h100-sxm", "count": count}
    if host_memory_gib is not None:
        node["host_memory_gib"] = host_memory_gib
    return ClusterSpec.from_dict({"name": f"h100x{count}", "nodes": [node]})


# --- the cluster file -------------------------------------------------------------------------------------------
def test_host_memory_round_trips_through_the_cluster_yaml(tmp_path):
    c = _cluster(8, 1536)
    assert c.nodes[0].host_memory_gib == 1536.0
    assert c.nodes[0].host_memory() == NodeHostMemory("n0", 1536.0, 8)
    c.dump(tmp_path / "c.yaml")
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["nodes"][0]["host_memory_gib"] == 1536.0
    again = ClusterSpec.load(tmp_path / "c.yaml")
    assert again.to_dict() == c.to_dict() and again.nodes[0].host_memory_gib == 1536.0
    assert again.content_hash() == c.content_hash() != _cluster(8, 768).content_hash()


def test_absent_host_memory_is_unknown_and_leaves_the_file_as_it_was():
    c = _cluster(8, None)
    assert c.nodes[0].host_memory_gib is None and c.nodes[0].host_memory() is None
    assert "host_memory_gib" not in c.to_dict()["nodes"][0]
    assert build_islands(c).islands[0].host_memory is None


@pytest.mark.parametrize("bad", [-64, 0, "lots", True, float("nan")])
def test_a_bad_host_memory_is_refused_naming_the_field_the_value_and_what_is_valid(bad):
    with pytest.raises(SpecError) as err:
        _cluster(8, bad)
    assert err.value.field == "nodes[0] (n0).host_memory_gib"
    assert repr(bad) in str(err.value) and "a number > 0" in str(err.value)


def test_an_island_is_bounded_by_its_node_with_the_least_host_memory_per_gpu():
    c = ClusterSpec.from_dict({"name": "two", "network": {"default": {"bandwidth_GBps": 25, "latency_us": 2}},
                               "nodes": [{"name": "big", "gpu": "h100-sxm", "count": 8, "host_memory_gib": 2048},
                                         {"name": "small", "gpu": "h100-sxm", "count": 8, "host_memory_gib": 512},
                                         {"name": "unknown", "gpu": "h100-sxm", "count": 8}]})
    (isl,) = build_islands(c).islands
    assert isl.host_memory == NodeHostMemory("small", 512.0, 8)


def test_the_islands_command_shows_the_host_memory_offload_is_checked_against(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    ClusterSpec.from_dict({"name": "two", "network": {"default": {"bandwidth_GBps": 25, "latency_us": 2}},
                           "nodes": [{"name": "big", "gpu": "h100-sxm", "count": 8, "host_memory_gib": 2048},
                                     {"name": "small", "gpu": "h100-sxm", "count": 8, "host_memory_gib": 512},
                                     {"name": "t4", "gpu": "t4", "count": 4}]}).dump(path)
    assert main(["islands", "--cluster", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    head = next(line for line in table if line.startswith("island "))
    assert head.rstrip().endswith("host GiB/GPU")
    assert next(line for line in table if "h100-sxm" in line).rstrip().endswith("64 (small)")  # 512 GiB / 8 GPUs
    assert next(line for line in table if " t4 " in line).rstrip().endswith("-")  # not given: not checked
    assert main(["islands", "--cluster", str(path), "--format", "json"]) == 0
    by_gpu = {isl["gpu_type"]: isl["host_memory"] for isl in json.loads(capsys.readouterr().out)["islands"]}
    assert by_gpu == {"h100-sxm": {"node": "small", "host_memory_gib": 512.0, "gib_per_gpu": 64.0}, "t4": None}
    _cluster(8, None).dump(path)  # no node gives it: the table keeps its columns
    assert main(["islands", "--cluster", str(path)]) == 0 and "host GiB" not in capsys.readouterr().out


# --- the rule ---------------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(per_gpu_gib=st.floats(0.0, 4096.0), gpus=st.integers(1, 16), host_gib=st.floats(0.5, 16384.0))
def test_the_check_accepts_exactly_what_the_node_holds(per_gpu_gib, gpus, host_gib):
    per_gpu = per_gpu_gib * GIB
    host = NodeHostMemory("n0", host_gib, gpus)
    holds = per_gpu * gpus <= USABLE_HOST_MEMORY_FRACTION * host_gib * GIB
    assert fits_host_memory(per_gpu, host) is holds
    problem = host_memory_problem(per_gpu, host)
    assert (problem is None) is holds
    if problem:
        assert "node n0" in problem and f"{host_gib:g} GiB" in problem and "without offload" in problem
    assert fits_host_memory(per_gpu, None) and host_memory_problem(per_gpu, None) is None  # unknown: not checked


# --- hand-written plans and the planner ---------------------------------------------------------------------------
def _manual(host_memory_gib: float | None):
    model = load_model("llama3-8b")
    manual = parse_manual_plan({"microbatch_sequences": 1, "stages": [
        {"layers": [0, model.num_layers], "island": "h100-sxm", "dp": 1, "zero_stage": 0, "recompute": "full",
         "offload": True}]}, num_layers=model.num_layers, island_names=["h100-sxm"])
    training = TrainingSpec(global_batch=8, seq_len=1024, dtype="bf16")
    return cost_manual_plan(manual, _cluster(1, host_memory_gib), model, training, runtime="torch", options=SERIAL)


@pytest.mark.parametrize("host_memory_gib", [None, AMPLE_HOST_GIB])
def test_a_hand_written_offload_plan_runs_where_the_host_holds_it(host_memory_gib):
    plan = _manual(host_memory_gib)
    assert [s.offload for s in plan.stages] == [True]


def test_a_hand_written_offload_plan_the_host_cannot_hold_is_refused_with_the_reason():
    with pytest.raises(InfeasibleError) as err:
        _manual(SMALL_HOST_GIB)
    text = str(err.value)
    assert "optimizer offload needs" in text and "node n0" in text and f"{SMALL_HOST_GIB} GiB" in text
    assert "without offload" in text


def _planned(count: int, host_memory_gib: float | None, global_batch: int, seq_len: int):
    training = TrainingSpec(global_batch=global_batch, seq_len=seq_len, dtype="bf16")
    return make_plan(_cluster(count, host_memory_gib), load_model("llama3-8b"), training, runtime="torch",
                     options=SERIAL)


def test_the_planner_falls_back_to_a_plan_without_offload_where_the_host_is_small():
    # two GPUs, a long iteration: offload without recompute beats full recompute, where the host holds it
    for host in (None, AMPLE_HOST_GIB):
        assert any(s.offload for s in _planned(2, host, 256, 4096).stages)
    plan = _planned(2, SMALL_HOST_GIB, 256, 4096)
    assert not any(s.offload for s in plan.stages)


def test_the_planner_reports_the_host_memory_where_only_offload_fits_the_gpu():
    assert _planned(1, AMPLE_HOST_GIB, 8, 1024).stages[0].offload
    with pytest.raises(InfeasibleError) as err:
        _planned(1, SMALL_HOST_GIB, 8, 1024)
    assert any("offload=yes it fits in GPU memory" in r and "node n0" in r and "host memory" in r
               for r in err.value.reasons)
    assert err.value.reasons[-1] == ("no slice plan of any pair fits in GPU memory without offload, and offload "
                                     "does not fit in host memory (above)")


# --- the estimate command ---------------------------------------------------------------------------------------
def _estimate(tmp_path, capsys, host_memory_gib: float | None) -> tuple[int, str]:
    path = tmp_path / "c.yaml"
    _cluster(8, host_memory_gib).dump(path)
    rc = main(["estimate", "--cluster", str(path), "--model", "llama3-8b", "--pp", "2", "--dp", "2", "--zero", "3",
               "--offload", "--global-batch", "16", "--seq-len", "4096", "--runtime", "torch", "--dtype", "bf16"])
    return rc, capsys.readouterr().out


def test_estimate_with_offload_names_the_host_memory_it_misses(tmp_path, capsys):
    rc, out = _estimate(tmp_path, capsys, SMALL_HOST_GIB)
    assert rc == 3
    assert "does NOT fit in host memory: stage 0 (layers 0:17): optimizer offload needs" in out
    assert "for the 8 GPUs of node n0, which has 64 GiB" in out


@pytest.mark.parametrize("host_memory_gib", [None, AMPLE_HOST_GIB])
def test_estimate_with_offload_fits_where_the_host_holds_it(tmp_path, capsys, host_memory_gib):
    rc, out = _estimate(tmp_path, capsys, host_memory_gib)
    assert rc == 0 and "host memory" not in out and "offloaded to host" in out
