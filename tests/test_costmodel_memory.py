"""Memory corrections and the plan's memory headroom (issue 13): no dropout masks where a model has no dropout; the
loss's logit tensors; plans leave an explicit, configurable fraction of every GPU free."""
from __future__ import annotations

import json

import pytest
import yaml

from tangram_launch.cli import main
from tangram_launch.errors import SpecError
from tangram_launch.specs.constants import DEFAULT_MEMORY_HEADROOM_FRACTION
from tangram_launch.specs.model import load_model
from tangram_launch.specs.training import TrainingSpec


def test_dropout_defaults_follow_the_architecture():
    assert load_model("gpt3-13b").dropout is True  # GPT-3: dropout 0.1
    assert load_model("llama3-8b").dropout is False
    assert load_model("mixtral-8x7b").dropout is False


def test_headroom_is_a_validated_fraction_with_a_default():
    assert TrainingSpec().memory_headroom_fraction == DEFAULT_MEMORY_HEADROOM_FRACTION == 0.05
    for bad in (-0.1, 1.0, "5%", True):
        with pytest.raises(SpecError, match="memory_headroom_fraction"):
            TrainingSpec(memory_headroom_fraction=bad)
    assert TrainingSpec.from_dict({"memory_headroom_fraction": 0.2}).memory_headroom_fraction == 0.2


CLUSTER = {"name": "a100x8", "network": {"default": {"bandwidth_GBps": 25, "latency_us": 2}},
           "nodes": [{"name": "a0", "gpu": "a100-40gb", "count": 8}]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    p = tmp_path_factory.mktemp("headroom") / "cluster.yaml"
    p.write_text(yaml.safe_dump(CLUSTER))
    return str(p)


def _plan(cluster, capsys, *extra):
    rc = main(["plan", "--cluster", cluster, "--model", "gpt3-6.7b", "--global-batch", "16", "--seq-len", "2048",
               "--workers", "1", "--format", "json", *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("headroom", [None, 0.3])
def test_every_stage_of_a_plan_stays_under_capacity_less_headroom(cluster, capsys, headroom):
    extra = [] if headroom is None else ["--memory-headroom", str(headroom)]
    rc, out, err = _plan(cluster, capsys, *extra)
    assert rc == 0, err
    plan = json.loads(out)
    h = DEFAULT_MEMORY_HEADROOM_FRACTION if headroom is None else headroom
    assert plan["training"]["memory_headroom_fraction"] == h
    for pred in plan["predicted"]["stages"]:
        assert pred["peak_memory_gib"] <= pred["capacity_gib"] * (1 - h) + 1e-9


def test_a_larger_headroom_changes_the_plan_that_would_fill_the_gpus(cluster, capsys):
    """Without headroom the best plan fills 36 of 40 GiB; with 30 % left free the planner trades speed for memory."""
    full = json.loads(_plan(cluster, capsys, "--memory-headroom", "0")[1])
    roomy = json.loads(_plan(cluster, capsys, "--memory-headroom", "0.3")[1])
    peak = max(p["peak_memory_gib"] for p in full["predicted"]["stages"])
    assert peak > 40 * 0.7  # the headroom binds
    assert max(p["peak_memory_gib"] for p in roomy["predicted"]["stages"]) <= 40 * 0.7
    assert roomy["predicted"]["iteration_time_s"] >= full["predicted"]["iteration_time_s"]
