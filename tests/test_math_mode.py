"""Math mode per GPU kind: ``tf32`` is FP32 storage with TF32 matmuls where the GPU has TF32 tensor cores and strict
FP32 on the others (never a reason to leave a GPU out); ``fp32`` stays strict FP32. One rule
(``specs.cluster.math_mode``) prices every peak; a tf32 plan records each stage's mode and each rank sets
``allow_tf32`` from its own stage."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest
import yaml

import tangram_launch

from tangram_launch.cli import main
from tangram_launch.costmodel.efficiency import DeviceModel, peak_tflops_for
from tangram_launch.islands import build_islands, compute_tflops
from tangram_launch.plan import Plan, tf32_matmuls_allowed
from tangram_launch.planner import PlannerOptions, search
from tangram_launch.planner.build import gpu_peak_flops
from tangram_launch.planner.slices import dtype_problem
from tangram_launch.specs.cluster import ClusterSpec, GpuRef, math_mode
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(os.path.dirname(tangram_launch.__file__), "plan.schema.json")
OPT_512 = os.path.join(REPO, "examples", "clusters", "opt350m-512gpu.yaml")  # 32x4 A100-40GB + 96x4 V100-16GB


@pytest.fixture(scope="module")
def opt512() -> ClusterSpec:
    return ClusterSpec.load(OPT_512)


def _gpu_of(cluster: ClusterSpec, kind: str):
    return next(g for _, g in cluster.iter_gpus() if g.type == kind)


def test_tf32_prices_a100_at_its_tf32_peak_and_v100_at_its_fp32_peak(opt512):
    a100, v100 = _gpu_of(opt512, "a100-40gb"), _gpu_of(opt512, "v100-16gb")
    assert (math_mode(a100, "tf32"), math_mode(v100, "tf32")) == ("tf32", "fp32")
    assert peak_tflops_for(a100, "tf32") == a100.tflops["tf32"] == 156.0
    assert peak_tflops_for(v100, "tf32") == v100.tflops["fp32"] == 15.7 and v100.tflops["tf32"] is None
    assert DeviceModel.from_gpu(a100, "tf32").peak_flops == 156e12
    assert DeviceModel.from_gpu(v100, "tf32").peak_flops == DeviceModel.from_gpu(v100, "fp32").peak_flops == 15.7e12
    # the MFU denominator and the island compute (what island similarity compares) read the same rule; the V100 is
    # not priced at its fp16 tensor-core peak, the old fallback for a dtype it lacks
    node_a, node_v = (next(r for r, g in opt512.iter_gpus() if g.type == kind) for kind in ("a100-40gb", "v100-16gb"))
    assert gpu_peak_flops(opt512, node_a.node, node_a.local_index, "tf32") == 156e12
    assert gpu_peak_flops(opt512, node_v.node, node_v.local_index, "tf32") == 15.7e12
    assert compute_tflops(v100, "tf32") == 15.7 and compute_tflops(a100, "tf32") == 156.0


def test_fp32_stays_strict_fp32_on_a100(opt512):
    a100 = _gpu_of(opt512, "a100-40gb")
    assert math_mode(a100, "fp32") == "fp32" and math_mode(a100, "bf16") == "bf16"
    assert peak_tflops_for(a100, "fp32") == a100.peak_tflops("fp32") == 19.5  # CUDA cores, torch's default
    assert DeviceModel.from_gpu(a100, "fp32").peak_flops == 19.5e12
    node = next(r for r, g in opt512.iter_gpus() if g.type == "a100-40gb")
    assert gpu_peak_flops(opt512, node.node, node.local_index, "fp32") == 19.5e12


def test_tf32_never_refuses_a_v100_island(opt512):
    islands = build_islands(opt512, dtype="tf32").islands
    kinds = {i.gpu.type: i for i in islands}
    assert set(kinds) == {"a100-40gb", "v100-16gb"}  # a V100 and an A100 differ in compute: separate islands
    assert all(dtype_problem(i, "tf32") is None for i in islands)
    assert dtype_problem(kinds["v100-16gb"], "bf16") is not None  # a dtype the V100 cannot run is still refused


@pytest.mark.slow
def test_a_tf32_search_on_the_512_gpu_cluster_gives_no_tf32_reason(opt512):
    """The V100s are usable; the planner may still leave them out for being slower, never for lacking TF32."""
    result = search(opt512, load_model("opt-350m"), TrainingSpec(global_batch=1024, seq_len=2048, dtype="tf32"),
                    runtime="torch", options=PlannerOptions(max_workers=1, progress=False, schedule="1F1B"))
    plan = result.plan
    assert {i.gpu.type for i in result.usable} == {"a100-40gb", "v100-16gb"}
    reasons = [d["reason"] for d in plan.islands_dropped]
    assert not any("tf32" in r.lower() for r in reasons), reasons
    for s in plan.stages:
        assert s.math_mode == math_mode(opt512.gpu(GpuRef(*s.gpus[0])), "tf32")


MIXED = {"name": "a100-v100", "network": {"default": {"bandwidth_GBps": 6.0, "latency_us": 50}},
         "nodes": [{"name": "a0", "gpu": "a100-40gb", "count": 4}, {"name": "v0", "gpu": "v100-16gb", "count": 4}]}
STAGES = {"microbatch_sequences": 4,
          "stages": [{"layers": [0, 18], "island": "a100-40gb", "num_gpus": 4, "tp": 1, "dp": 4},
                     {"layers": [18, 24], "island": "v100-16gb", "num_gpus": 4, "tp": 1, "dp": 4}]}


@pytest.fixture(scope="module")
def mixed_plans(tmp_path_factory) -> dict[str, str]:
    """The same hand-written two-stage pipeline (A100 stage, V100 stage) costed in tf32 and in fp32; OPT-350M at
    2,048 tokens, whose layers compute for longer than the host takes to dispatch them (costmodel/host_floor.py),
    so the math mode shows in their times."""
    d = tmp_path_factory.mktemp("math_mode")
    (d / "cluster.yaml").write_text(yaml.safe_dump(MIXED))
    (d / "stages.yaml").write_text(yaml.safe_dump(STAGES))
    out = {}
    for dtype in ("tf32", "fp32"):
        path = d / f"plan-{dtype}.json"
        rc = main(["plan", "--cluster", str(d / "cluster.yaml"), "--model", "opt-350m", "--global-batch", "8",
                   "--seq-len", "2048", "--dtype", dtype, "--plan", str(d / "stages.yaml"), "--workers", "1",
                   "--format", "json", "-o", str(path)])
        assert rc == 0
        out[dtype] = path.read_text()
    return out


def test_a_tf32_plan_records_each_stages_math_mode_and_round_trips(mixed_plans):
    raw = json.loads(mixed_plans["tf32"])
    assert [(s["island"], s["math_mode"]) for s in raw["stages"]] == [("a100-40gb", "tf32"), ("v100-16gb", "fp32")]
    with open(SCHEMA, encoding="utf-8") as f:
        schema = json.load(f)
    jsonschema.validate(raw, schema)
    bad = json.loads(mixed_plans["tf32"])
    bad["stages"][1]["math_mode"] = "bf16"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    plan = Plan.from_dict(raw)
    assert [s.math_mode for s in plan.stages] == ["tf32", "fp32"]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    assert Plan.from_dict(yaml.safe_load(plan.to_yaml())) == plan
    # the V100 stage is costed exactly as under fp32, the A100 stage faster than under fp32 (TF32 matmuls)
    fp32 = Plan.from_dict(json.loads(mixed_plans["fp32"]))
    (a, v), (a_fp32, v_fp32) = plan.predicted.stages, fp32.predicted.stages
    assert v.forward_s == v_fp32.forward_s and v.backward_s == v_fp32.backward_s
    assert a.forward_s < a_fp32.forward_s and a.backward_s < a_fp32.backward_s


def test_a_non_tf32_plan_has_no_math_mode_key(mixed_plans):
    raw = json.loads(mixed_plans["fp32"])
    assert all("math_mode" not in s for s in raw["stages"])
    assert all(s.math_mode is None for s in Plan.from_dict(raw).stages)


def test_math_mode_is_refused_on_a_non_tf32_plan_and_must_be_a_known_mode(mixed_plans):
    from tangram_launch.errors import SpecError

    raw = json.loads(mixed_plans["fp32"])
    raw["stages"][0]["math_mode"] = "tf32"
    with pytest.raises(SpecError, match="tf32 plans only"):
        Plan.from_dict(raw)
    raw = json.loads(mixed_plans["tf32"])
    raw["stages"][0]["math_mode"] = "bf16"
    with pytest.raises(SpecError, match="unknown math mode") as err:
        Plan.from_dict(raw)
    assert err.value.field == "stages[0].math_mode"


def test_each_rank_switches_tf32_from_its_own_stage(mixed_plans):
    """The pure decision behind ``torch.backends.cuda.matmul.allow_tf32`` in the torch and Megatron adapters. The
    switch itself only changes CUDA matmuls, which cannot be observed on this CPU-only machine, so the decision is
    what is tested: A100 ranks run TF32, V100 ranks strict FP32; an fp32 plan leaves torch's default alone."""
    tf32 = Plan.from_dict(json.loads(mixed_plans["tf32"]))
    decided = {tf32.place(r).stage.island: tf32_matmuls_allowed(tf32, tf32.place(r)) for r in range(tf32.world_size)}
    assert decided == {"a100-40gb": True, "v100-16gb": False}
    fp32 = Plan.from_dict(json.loads(mixed_plans["fp32"]))
    assert {tf32_matmuls_allowed(fp32, fp32.place(r)) for r in range(fp32.world_size)} == {None}
    # a tf32 plan written without math modes runs TF32 wherever the GPU has it (the switch is a no-op elsewhere)
    bare = json.loads(mixed_plans["tf32"])
    for s in bare["stages"]:
        del s["math_mode"]
    bare_plan = Plan.from_dict(bare)
    assert {tf32_matmuls_allowed(bare_plan, bare_plan.place(r)) for r in range(bare_plan.world_size)} == {True}


def test_every_catalog_gpu_trains_tf32_in_its_own_math_mode_and_fp32_strictly():
    """Over the whole catalog: tf32 is priced at the TF32 peak where the GPU has one, else at its FP32 peak, and is
    refused nowhere fp32 runs; fp32 and the other dtypes are untouched by the rule."""
    from tangram_launch.specs.catalog import default_catalog
    from test_costmodel import gpu, island

    for entry in default_catalog():
        g = gpu(entry.name)
        has_tf32 = bool(g.tflops.get("tf32"))
        assert math_mode(g, "tf32") == ("tf32" if has_tf32 else "fp32"), entry.name
        if g.tflops.get("fp32"):
            assert peak_tflops_for(g, "tf32") == g.tflops["tf32" if has_tf32 else "fp32"], entry.name
            assert peak_tflops_for(g, "fp32") == g.tflops["fp32"], entry.name
            assert dtype_problem(island(entry.name), "tf32") is None, entry.name
        for dtype in ("bf16", "fp16", "fp32", "fp8"):
            assert math_mode(g, dtype) == dtype
            assert (dtype_problem(island(entry.name), dtype) is None) == bool(g.tflops.get(dtype)), (entry.name, dtype)
