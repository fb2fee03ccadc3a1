"""Training dtypes tf32 (fp32 storage, TF32 matmuls) and fp8 (FP8 GEMMs, bf16 elsewhere): catalog, cost model,
runtime capabilities and `tangram-launch plan --dtype` end to end (issue 13)."""
from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH
from tangram_launch.cli import main
from tangram_launch.costmodel.breakdown import ParallelConfig
from tangram_launch.costmodel.efficiency import DeviceModel
from tangram_launch.costmodel.memory import FRAGMENTATION_FRACTION
from tangram_launch.specs.training import TrainingSpec
from test_costmodel import coster, gpu, island
from tangram_launch.specs.model import load_model


def test_tf32_runs_matmuls_at_the_tf32_peak_with_fp32_storage():
    a100 = gpu("a100-80gb")
    fp32, tf32 = DeviceModel.from_gpu(a100, "fp32"), DeviceModel.from_gpu(a100, "tf32")
    assert tf32.peak_flops == 156e12 and fp32.peak_flops == 19.5e12
    assert tf32.dtype_bytes == fp32.dtype_bytes == 4
    model = load_model("llama3-8b")
    cfg = ParallelConfig(tp=8, pp=1, dp=1)
    t = {d: coster(model, island("a100-80gb"), seq=2048, dtype=d).plan(cfg) for d in ("fp32", "tf32", "bf16")}
    fb = {d: p.stages[0].forward_s + p.stages[0].backward_s for d, p in t.items()}
    assert fb["tf32"] < fb["fp32"] / 3  # 8x the matmul peak; element-wise work and TP traffic do not shrink
    assert fb["bf16"] < fb["tf32"]  # half the bytes and twice the peak again
    # no fp32 master copy under tf32 (the weights are fp32 already): Adam keeps 8 bytes per parameter, like fp32
    assert TrainingSpec(dtype="tf32").optimizer_state_bytes == TrainingSpec(dtype="fp32").optimizer_state_bytes == 8
    mem = {d: p.stages[0].static_bytes for d, p in t.items()}
    assert mem["tf32"] == pytest.approx(mem["fp32"])


def test_fp8_speeds_up_the_gemms_only_and_keeps_bf16_memory_but_the_gemm_inputs():
    h100 = gpu("h100-sxm")
    bf16, fp8 = DeviceModel.from_gpu(h100, "bf16"), DeviceModel.from_gpu(h100, "fp8")
    assert fp8.peak_flops == 2 * bf16.peak_flops + 1e12  # 1,979 vs 989 TFLOP/s dense
    assert fp8.attention_flops == pytest.approx(bf16.attention_flops)  # attention stays in bf16
    big = fp8.gemm_s(8192, 8192, 8192), bf16.gemm_s(8192, 8192, 8192)
    assert 1.2 < big[1] / big[0] < 2.0  # FP8 GEMMs are faster, never the full 2x of the spec sheet
    # on one GPU whose FP8 tensor cores measure exactly 2x its bf16 ones, the cast traffic keeps FP8 GEMMs under 2x
    profiled = gpu("h100-sxm", measured={"gemm_tflops": {"bf16": 700.0, "fp8": 1400.0}})
    p16, p8 = DeviceModel.from_gpu(profiled, "bf16"), DeviceModel.from_gpu(profiled, "fp8")
    assert 1.2 < p16.gemm_s(8192, 8192, 8192) / p8.gemm_s(8192, 8192, 8192) < 2.0
    model = load_model("llama3-8b")
    cfg = ParallelConfig(tp=1, pp=1, dp=8, zero_stage=3)
    p = {d: coster(model, island("h100-sxm"), b=8, gb=64, seq=4096, dtype=d).plan(cfg) for d in ("bf16", "fp8")}
    fb = {d: q.stages[0].forward_s + q.stages[0].backward_s for d, q in p.items()}
    assert fb["bf16"] / 2 < fb["fp8"] < fb["bf16"]
    assert p["fp8"].stages[0].static_bytes == pytest.approx(p["bf16"].stages[0].static_bytes)
    # Transformer Engine keeps its FP8 GEMMs' inputs in FP8 (memory.layer_activation_bytes): without recompute the
    # QKV, first FFN and down GEMM inputs take a byte an element less, the flash kernel's output keeps its 16 bits
    # beside the projection's FP8 copy; everything else stays bf16
    h, q, f = model.hidden_size, model.q_dim, model.ffn_hidden_size
    saved = model.num_layers * 4096 * (2 * h + f - q) * (1 + FRAGMENTATION_FRACTION)
    assert p["bf16"].stages[0].activation_bytes - p["fp8"].stages[0].activation_bytes == pytest.approx(saved)


@pytest.mark.parametrize("gpu_type", ["a100-80gb", "v100-32gb", "t4", "rtx-4090"])
def test_fp8_is_refused_on_gpus_without_fp8_training_with_the_reason(gpu_type):
    c = coster(load_model("llama3-8b"), island(gpu_type), dtype="fp8")
    assert c.device_error and "fp8" in c.device_error and "FP8 tensor cores" in c.device_error


def test_runtime_capabilities_say_who_runs_fp8_and_tf32():
    assert MEGATRON.dtype_problems("fp8") == [] and MEGATRON.dtype_problems("tf32") == []
    assert TORCH.dtype_problems("tf32") == []
    (why,) = TORCH.dtype_problems("fp8")
    assert "torch cannot train in fp8" in why and "FP8 GEMM path" in why
    assert DEEPSPEED.dtype_problems("fp8") and DEEPSPEED.dtype_problems("tf32")


H100_A100 = {"name": "h100-a100", "network": {"default": {"bandwidth_GBps": 25, "latency_us": 2}},
             "nodes": [{"name": "h0", "gpu": "h100-sxm", "count": 8}, {"name": "a0", "gpu": "a100-80gb", "count": 8}]}
SMALL = {"name": "small-llama", "num_layers": 4, "hidden_size": 1024, "num_heads": 8, "num_kv_heads": 8,
         "ffn_hidden_size": 4096, "vocab_size": 8192, "max_seq_len": 1024}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dtypes")
    (d / "cluster.yaml").write_text(yaml.safe_dump(H100_A100))
    (d / "model.yaml").write_text(yaml.safe_dump(SMALL))
    return str(d / "cluster.yaml"), str(d / "model.yaml")


def _plan(files, capsys, *extra):
    cluster, model = files
    rc = main(["plan", "--cluster", cluster, "--model", model, "--global-batch", "8", "--workers", "1", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_fp8_with_megatron_uses_only_the_fp8_gpus(files, capsys):
    rc, out, err = _plan(files, capsys, "--dtype", "fp8", "--runtime", "megatron", "--format", "json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["training"]["dtype"] == "fp8"
    assert {s["island"] for s in plan["stages"]} == {"h100-sxm"}  # the A100s have no FP8 tensor cores


def test_plan_fp8_with_torch_is_refused_with_the_runtime_reason(files, capsys):
    rc, out, err = _plan(files, capsys, "--dtype", "fp8", "--runtime", "torch")
    assert rc == 3
    assert "torch cannot train in fp8" in err + out


def test_plan_tf32_with_torch_plans_on_every_gpu(files, capsys):
    rc, out, err = _plan(files, capsys, "--dtype", "tf32", "--runtime", "torch", "--format", "json")
    assert rc == 0, err
    modes = [s["math_mode"] for s in json.loads(out)["stages"]]
    assert json.loads(out)["training"]["dtype"] == "tf32"
    rc, out, err = _plan(files, capsys, "--dtype", "tf32", "--runtime", "torch")
    assert rc == 0, err
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    x = lines[at].index(" math ") + 1  # the table shows each stage's math mode under its own heading
    assert [line[x:].split()[0] for line in lines[at + 1:at + 1 + len(modes)]] == modes


def test_megatron_translates_fp8_and_tf32():
    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("megatron.core") is None:  # installed? (importing it costs seconds, unused here)
        pytest.skip("megatron-core is not installed (the 'megatron' extra)")
    from runtime_adapters.megatron_adapter import dtype_kwargs

    fp8 = dtype_kwargs("fp8")
    assert fp8["fp8"] == "hybrid" and fp8["bf16"] and fp8["params_dtype"] == torch.bfloat16
    tf32 = dtype_kwargs("tf32")
    assert "fp8" not in tf32 and not tf32["bf16"] and tf32["params_dtype"] == torch.float32


def test_an_fp8_plan_validates_against_the_plan_schema(files, capsys):
    import os

    import jsonschema

    import tangram_launch

    rc, out, err = _plan(files, capsys, "--dtype", "fp8", "--runtime", "megatron", "--format", "json")
    assert rc == 0, err
    with open(os.path.join(os.path.dirname(tangram_launch.__file__), "plan.schema.json"), encoding="utf-8") as f:
        jsonschema.validate(json.loads(out), json.load(f))
