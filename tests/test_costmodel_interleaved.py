"""Interleaved 1F1B (issue 13): the bubble and memory of virtual stages, the Plan's schedule fields, the runtimes'
capabilities and the planner's --schedule auto|1F1B|interleaved-1F1B."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest
import yaml

import tangram_launch
from tangram_launch.capabilities import DEEPSPEED, MEGATRON, TORCH
from tangram_launch.cli import main
from tangram_launch.costmodel.pipeline import inflight_microbatches, pipeline_latency_s
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan, interleaved_chunks


# ------------------------------------------------------------------------------------------------ formulas
def test_interleaving_divides_the_bubble_by_the_virtual_stages():
    p, t, m = 4, 1.0, 8  # four equal stages of t per micro-batch (forward + backward)
    fill = p * t
    assert pipeline_latency_s(m, t, fill, 0.0) == (m + p - 1) * t  # Narayanan et al. 2021: (m + p - 1) slots
    for v in (2, 4):
        assert pipeline_latency_s(m, t, fill, 0.0, v) == pytest.approx(m * t + (p - 1) * t / v)
    assert pipeline_latency_s(m, t, fill, 0.5, 1) == pipeline_latency_s(m, t, fill, 0.5, virtual_stages=1)


def test_interleaving_holds_more_activations_on_early_stages():
    p, m = 4, 16
    for k in range(p):
        assert inflight_microbatches(p - 1 - k, p, m) == p - k  # 1F1B: stage k holds p - k micro-batches
    # Megatron-core's warm-up: 2 (p - k - 1) + (v - 1) p chunk forwards, plus the one in flight, 1/v each
    assert inflight_microbatches(p - 1, p, m, 2) == (2 * 3 + 4 + 1) / 2  # first stage: 5.5 > 4
    assert inflight_microbatches(0, p, m, 2) == (4 + 1) / 2  # last stage: 2.5 > 1
    assert inflight_microbatches(p - 1, p, 2, 4) == 2  # never more than all m micro-batches


def test_chunks_are_laid_chunk_major_and_cover_the_model():
    chunks = interleaved_chunks([5, 3, 4], 2)
    assert chunks == (((0, 3), (7, 9)), ((3, 5), (9, 10)), ((5, 7), (10, 12)))
    flat = sorted(c for stage in chunks for c in stage)
    assert flat[0][0] == 0 and flat[-1][1] == 12 and all(a[1] == b[0] for a, b in zip(flat, flat[1:]))


# ------------------------------------------------------------------------------------------------ capabilities
def test_megatron_and_torch_run_interleaved_and_need_whole_microbatch_groups():
    for caps in (MEGATRON, TORCH):  # torch: runtime_adapters/interleaved.py (tests/test_torch_interleaved.py)
        assert caps.schedule_problems("interleaved-1F1B", num_stages=4, num_microbatches=8) == []
        (why,) = caps.schedule_problems("interleaved-1F1B", num_stages=4, num_microbatches=6)
        assert "multiple of the pipeline stages" in why
    assert DEEPSPEED.schedule_problems("interleaved-1F1B")


# ------------------------------------------------------------------------------------------------ planner
CLUSTER = {"name": "v100x8", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 5}},
           "nodes": [{"name": "v0", "gpu": "v100-16gb", "count": 4}, {"name": "v1", "gpu": "v100-16gb", "count": 4}]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    p = tmp_path_factory.mktemp("interleaved") / "cluster.yaml"
    p.write_text(yaml.safe_dump(CLUSTER))
    return str(p)


def _plan(cluster, capsys, *extra):
    rc = main(["plan", "--cluster", cluster, "--model", "gpt3-2.7b", "--global-batch", "32", "--seq-len", "1024",
               "--dtype", "fp16", "--workers", "1", "--format", "json", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def megatron_plans(cluster):
    import contextlib
    import io

    out = {}
    for schedule in ("auto", "1F1B", "interleaved-1F1B"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["plan", "--cluster", cluster, "--model", "gpt3-2.7b", "--global-batch", "32", "--seq-len",
                       "1024", "--dtype", "fp16", "--workers", "1", "--format", "json", "--runtime", "megatron",
                       "--schedule", schedule])
        assert rc == 0
        out[schedule] = json.loads(buf.getvalue())
    return out


@pytest.mark.slow  # plans real clusters end to end: seconds each
def test_auto_interleaves_a_megatron_pipeline_when_it_is_faster(megatron_plans, cluster, tmp_path, capsys):
    plain, auto = megatron_plans["1F1B"], megatron_plans["auto"]
    assert len(plain["stages"]) >= 2 and "virtual_stages" not in plain  # plain plans' JSON is unchanged
    assert auto["schedule"] == "interleaved-1F1B" and auto["virtual_stages"] >= 2
    assert auto["predicted"]["iteration_time_s"] < plain["predicted"]["iteration_time_s"]
    # auto reports its own stages' plain 1F1B time, which no sequence beats the 1F1B search's best (its layout
    # may differ from that plan's: the best stages to interleave need not be the best plain ones)
    assert auto["planner"]["plain_1f1b_iteration_s"] >= plain["predicted"]["iteration_time_s"] * (1 - 1e-9)
    assert auto["predicted"]["iteration_time_s"] < auto["planner"]["plain_1f1b_iteration_s"]
    v = auto["virtual_stages"]
    assert [tuple(map(tuple, s["chunks"])) for s in auto["stages"]] == list(
        interleaved_chunks([s["layers"][1] - s["layers"][0] for s in auto["stages"]], v))
    # the first stage holds more activations than the same stages under 1F1B (written by hand, costed by plan --plan)
    keys = ("layers", "island", "num_gpus", "tp", "dp", "cp", "zero_stage", "recompute", "offload", "micro_batch_size")
    manual = tmp_path / "stages.yaml"
    manual.write_text(yaml.safe_dump({"microbatch_sequences": auto["planner"]["b"],
                                      "stages": [{k: st[k] for k in keys} for st in auto["stages"]]}))
    rc, out, err = _plan(cluster, capsys, "--runtime", "megatron", "--schedule", "1F1B", "--plan", str(manual))
    assert rc == 0, err
    same = json.loads(out)
    assert [st["tp"] for st in same["stages"]] == [st["tp"] for st in auto["stages"]]
    assert auto["predicted"]["stages"][0]["peak_memory_gib"] > same["predicted"]["stages"][0]["peak_memory_gib"]
    forced = megatron_plans["interleaved-1F1B"]
    assert forced["schedule"] == "interleaved-1F1B"


@pytest.mark.slow  # plans real clusters end to end: seconds each
def test_an_interleaved_plan_round_trips_and_validates_against_the_schema(megatron_plans):
    d = megatron_plans["auto"]
    with open(os.path.join(os.path.dirname(tangram_launch.__file__), "plan.schema.json"), encoding="utf-8") as f:
        jsonschema.validate(d, json.load(f))
    plan = Plan.from_dict(d)
    assert plan.to_dict() == d
    bad = json.loads(json.dumps(d))
    bad["stages"][0]["chunks"][0] = [0, 1]
    with pytest.raises(SpecError, match="chunks"):
        Plan.from_dict(bad)
    bad = json.loads(json.dumps(d))
    del bad["virtual_stages"]
    with pytest.raises(SpecError, match="virtual"):
        Plan.from_dict(bad)


@pytest.mark.slow  # plans real clusters end to end: seconds each
def test_torch_interleaves_when_forced_and_auto_is_never_slower(cluster, capsys):
    rc, out, err = _plan(cluster, capsys, "--runtime", "torch", "--schedule", "1F1B")
    assert rc == 0
    plain = json.loads(out)
    rc, out, err = _plan(cluster, capsys, "--runtime", "torch", "--schedule", "interleaved-1F1B")
    assert rc == 0, err
    forced = json.loads(out)
    assert forced["schedule"] == "interleaved-1F1B" and forced["virtual_stages"] >= 2
    rc, out, err = _plan(cluster, capsys, "--runtime", "torch")
    assert rc == 0
    auto = json.loads(out)
    assert auto["predicted"]["iteration_time_s"] <= min(plain["predicted"]["iteration_time_s"],
                                                        forced["predicted"]["iteration_time_s"]) + 1e-12
    rc, out, err = _plan(cluster, capsys, "--runtime", "deepspeed", "--schedule", "interleaved-1F1B")
    assert rc == 3 and "deepspeed has no interleaved-1F1B schedule" in err + out
