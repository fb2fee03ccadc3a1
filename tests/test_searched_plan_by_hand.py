"""A searched plan written by hand is the same plan: ``plan --plan`` gives its stages the same GPUs and predicts the
same iteration, whatever the cluster. One physical plan has one price: the search prices consecutive stages of one
grid on one island as one slice (their p2p in the stages' times), and so does the hand-written path
(planner/manual.py); other boundaries are links in both."""
from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tangram_launch.cli import main

# each example plans a small cluster twice (the search, then its plan by hand): about a second
pytestmark = pytest.mark.slow

GPUS = ("a100-40gb", "v100-16gb", "t4", "h100-sxm")


@st.composite
def clusters(draw) -> dict:
    """One to three GPU kinds, one to three nodes of 2 or 4 GPUs each, one network between the nodes."""
    kinds = draw(st.lists(st.sampled_from(GPUS), min_size=1, max_size=3, unique=True))
    nodes = []
    for kind in kinds:
        per_node = draw(st.sampled_from((2, 4)))
        for i in range(draw(st.integers(1, 3))):
            nodes.append({"name": f"{kind}-{i}", "gpu": kind, "count": per_node})
    bandwidth = draw(st.sampled_from((3.125, 12.5, 50.0)))
    return {"name": "gen", "network": {"default": {"bandwidth_GBps": bandwidth, "latency_us": 10}}, "nodes": nodes}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cluster=clusters(), model=st.sampled_from(("opt-350m", "gpt3-1.3b")),
       global_batch=st.sampled_from((16, 64)), seq_len=st.sampled_from((512, 1024)),
       runtime=st.sampled_from(("torch", "megatron")))
def test_a_searched_plan_written_by_hand_predicts_the_same_iteration(tmp_path, capsys, cluster, model, global_batch,
                                                                      seq_len, runtime):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    args = ["--cluster", str(path), "--model", model, "--global-batch", str(global_batch), "--seq-len", str(seq_len),
            "--dtype", "fp16", "--runtime", runtime, "--workers", "1", "--format", "json"]
    if main(["plan", *args, "-o", str(tmp_path / "searched.json"), "--stages-out", str(tmp_path / "hand.yaml")]) != 0:
        assert "no feasible plan" in capsys.readouterr().err  # an infeasible cluster says so: nothing to compare
        return
    searched = json.loads((tmp_path / "searched.json").read_text())
    assert main(["plan", *args, "--plan", str(tmp_path / "hand.yaml"), "-o", str(tmp_path / "hand.json")]) == 0, \
        capsys.readouterr().err
    hand = json.loads((tmp_path / "hand.json").read_text())
    assert [s["gpus"] for s in hand["stages"]] == [s["gpus"] for s in searched["stages"]]
    assert hand["schedule"] == searched["schedule"]
    assert hand["predicted"]["iteration_time_s"] == pytest.approx(searched["predicted"]["iteration_time_s"],
                                                                  rel=1e-9)
    capsys.readouterr()
