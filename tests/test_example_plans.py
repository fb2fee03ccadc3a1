"""Every example cluster, planned with a representative model and batch, gives byte for byte the Plan JSON stored in
tests/fixtures/plans/ (written from the code before the issue 17 redesign). Refactors must not move a plan.

Only the planner's wall-clock timings (``*_time_s`` under ``planner``) are zeroed before comparing; every other
byte, predicted times included, must match. Regenerate only for an intended change of plans, and say why:

    PYTHONPATH=. python tests/test_example_plans.py [NAME ...]   # rewrites tests/fixtures/plans/*.json (or NAME's)

The example plans in examples/data/ (EXAMPLE_PLANS) are checked and rewritten the same way.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest

# Each case plans a real cluster end to end (seconds to tens of seconds): the slow tier, which .ci/run runs too.
pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FIXTURES = os.path.join(HERE, "fixtures", "plans")
CLUSTERS = os.path.join(REPO, "examples", "clusters")

# (fixture name, cluster file, model, extra `tangram-launch plan` arguments). One case per example cluster; the
# README's `plan` example (c3-full-het-iii, gpt3-13b) and one case per runtime besides torch.
CASES = [
    ("c1-compute-het-4x4", "c1-compute-het-4x4", "gpt3-1.3b", ["--global-batch", "32", "--seq-len", "2048",
                                                               "--dtype", "fp16"]),
    ("c1-compute-het", "c1-compute-het", "gpt3-2.7b", ["--global-batch", "32", "--seq-len", "2048", "--dtype", "fp16"]),
    ("c1-t4-only", "c1-t4-only", "gpt3-1.3b", ["--global-batch", "32", "--seq-len", "2048", "--dtype", "fp16"]),
    ("c1-v100-only", "c1-v100-only", "gpt3-1.3b", ["--global-batch", "32", "--seq-len", "2048", "--dtype", "fp16"]),
    ("c2-modern-het", "c2-modern-het", "mixtral-8x7b-16l", ["--global-batch", "32", "--seq-len", "2048",
                                                            "--dtype", "bf16"]),
    ("c3-4-islands-20gpu", "c3-4-islands-20gpu", "gpt3-6.7b", ["--global-batch", "32", "--seq-len", "2048",
                                                               "--dtype", "fp16"]),
    ("c3-full-het-i", "c3-full-het-i", "gpt3-13b", ["--global-batch", "64", "--seq-len", "2048", "--dtype", "fp16"]),
    ("c3-full-het-ii", "c3-full-het-ii", "gpt3-13b", ["--global-batch", "64", "--seq-len", "2048", "--dtype", "fp16"]),
    ("c3-full-het-iii", "c3-full-het-iii", "gpt3-13b", ["--global-batch", "64", "--seq-len", "2048",
                                                        "--dtype", "fp16"]),
    ("c3-full-het-iii-megatron", "c3-full-het-iii", "gpt3-13b", ["--global-batch", "64", "--seq-len", "2048",
                                                                 "--dtype", "fp16", "--runtime", "megatron"]),
    ("c3-full-het-ii-deepspeed", "c3-full-het-ii", "gpt3-2.7b", ["--global-batch", "64", "--seq-len", "2048",
                                                                 "--dtype", "fp16", "--runtime", "deepspeed"]),
    ("cpu-2", "cpu-2", "tiny", ["--global-batch", "8", "--seq-len", "64", "--dtype", "fp32"]),
    ("profiled-cpu-2", "profiled-cpu-2", "tiny", ["--global-batch", "8", "--seq-len", "64", "--dtype", "fp32"]),
    ("two-pods-slow-link", "two-pods-slow-link", "llama3-8b", ["--global-batch", "64", "--seq-len", "4096",
                                                               "--dtype", "bf16"]),
    # the 256-GPU H200 + H100 cluster with the tiny model: planning Llama 3 405B on it takes minutes
    ("llama3-405b-256gpu-tiny-megatron", "llama3-405b-256gpu", "tiny", ["--global-batch", "64", "--seq-len", "64",
                                                                    "--dtype", "bf16", "--runtime", "megatron",
                                                                    "--microbatch-sequences", "16"]),
    ("profiled-h200", "profiled-h200", os.path.join(REPO, "examples", "models", "llama3.2-1b.yaml"),
     ["--global-batch", "16", "--seq-len", "2048", "--dtype", "bf16"]),
]


def _zero_timings(d: dict) -> dict:
    """Planner wall-clock timings differ run to run; nothing else may."""
    planner = d.get("planner", {})
    for key in list(planner):
        if key.endswith("_time_s"):
            planner[key] = 0.0
    return d


def plan_json(cluster: str, model: str, extra: list[str]) -> str:
    """The JSON `tangram-launch plan --format json` prints, timings zeroed, as stored in the fixture."""
    from tangram_launch.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", "--cluster", os.path.join(CLUSTERS, f"{cluster}.yaml"), "--model", model,
                   "--workers", "1", "--format", "json", *extra])
    assert rc == 0, f"planning {cluster} with {model} failed (exit {rc})"
    return json.dumps(_zero_timings(json.loads(buf.getvalue())), indent=2) + "\n"


# The planner-scale clusters (issue 12) take longer to plan than a test may: benchmarks/bench_planner_scale.py plans
# them and prints the figures.
SCALE_CLUSTERS = {"opt350m-128gpu", "opt350m-320gpu", "opt350m-512gpu", "llama3-405b-4096gpu"}


# The example plans the README and examples/train_gpt*.py launch: the stages of examples/data/plan-tiny-2cpu.stages.yaml
# costed by the planner (`plan --plan`), so their model and training fields are whatever a planned plan holds and
# checkpoints cross-resume between them and planned plans. (file name in examples/data, extra arguments)
EXAMPLE_DATA = os.path.join(REPO, "examples", "data")
STAGES = os.path.join("examples", "data", "plan-tiny-2cpu.stages.yaml")  # relative: it is recorded in the plan
EXAMPLE_PLANS = [
    ("plan-tiny-2cpu", ["--global-batch", "8", "--seq-len", "64", "--dtype", "fp32", "--optimizer", "adamw",
                        "--plan", STAGES]),
    ("plan-tiny-2cpu-deepspeed", ["--global-batch", "8", "--seq-len", "64", "--dtype", "fp32", "--optimizer",
                                  "adamw", "--plan", STAGES, "--runtime", "deepspeed"]),
]


def example_plan_json(extra: list[str]) -> str:
    with contextlib.chdir(REPO):
        return plan_json("cpu-2", "tiny", extra)


@pytest.mark.parametrize("name,extra", EXAMPLE_PLANS, ids=[c[0] for c in EXAMPLE_PLANS])
def test_example_data_plan_is_what_the_planner_writes(name, extra):
    with open(os.path.join(EXAMPLE_DATA, f"{name}.json"), encoding="utf-8") as f:
        stored = f.read()
    assert example_plan_json(extra) == stored


def test_every_example_cluster_has_a_case():
    clusters = sorted(f[:-5] for f in os.listdir(CLUSTERS) if f.endswith(".yaml") and f[:-5] not in SCALE_CLUSTERS)
    assert sorted({c[1] for c in CASES}) == clusters


@pytest.mark.parametrize("name,cluster,model,extra", CASES, ids=[c[0] for c in CASES])
def test_example_plan_is_byte_identical_to_the_stored_one(name, cluster, model, extra):
    with open(os.path.join(FIXTURES, f"{name}.json"), encoding="utf-8") as f:
        stored = f.read()
    assert plan_json(cluster, model, extra) == stored


if __name__ == "__main__":  # regenerate the fixtures (see the module docstring)
    sys.path.insert(0, REPO)
    os.makedirs(FIXTURES, exist_ok=True)
    only = set(sys.argv[1:])
    for name, cluster, model, extra in CASES:
        if only and name not in only:
            continue
        text = plan_json(cluster, model, extra)
        with open(os.path.join(FIXTURES, f"{name}.json"), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {name}.json")
    for name, extra in EXAMPLE_PLANS:
        if only and name not in only:
            continue
        text = example_plan_json(extra)
        with open(os.path.join(EXAMPLE_DATA, f"{name}.json"), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote examples/data/{name}.json")
