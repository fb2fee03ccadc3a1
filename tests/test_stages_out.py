"""``plan --stages-out``: a plan's stages written as a hand-written plan, to edit and cost again with ``--plan``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tangram_launch.cli import main

pytestmark = pytest.mark.unit

CLUSTER = Path(__file__).resolve().parent.parent / "examples" / "clusters" / "c3-full-het-iii.yaml"
README_PLAN = ["--cluster", str(CLUSTER), "--model", "gpt3-13b", "--global-batch", "128",
               "--seq-len", "2048", "--dtype", "fp16", "--workers", "1"]
V100_X8 = {"name": "v100x8", "network": {"default": {"bandwidth_GBps": 12.5, "latency_us": 5}},
           "nodes": [{"name": "v0", "gpu": "v100-16gb", "count": 4}, {"name": "v1", "gpu": "v100-16gb", "count": 4}]}


def test_the_readme_plan_written_out_is_the_same_plan_by_hand(tmp_path, capsys):
    """The README's `plan` command with --stages-out: one line per stage, every field given, in the format --plan
    reads; costed back, the same stages on the same GPUs at the same predicted iteration."""
    stages = tmp_path / "my-plan.yaml"
    assert main(["plan", *README_PLAN, "-o", str(tmp_path / "searched.json"), "--stages-out", str(stages)]) == 0
    assert f"stages written to {stages}" in capsys.readouterr().out
    searched = json.loads((tmp_path / "searched.json").read_text())
    text = stages.read_text()
    assert text.count("\n  - {layers: [") == len(searched["stages"])
    written = yaml.safe_load(text)
    assert written["microbatch_sequences"] == searched["planner"]["b"]
    for w, s in zip(written["stages"], searched["stages"], strict=True):
        assert w == {k: s[k] for k in w}
        assert set(w) == {"layers", "island", "tp", "dp", "cp", "ep", "zero_stage", "recompute", "offload",
                          "micro_batch_size", "num_gpus"}
    assert main(["plan", *README_PLAN, "--plan", str(stages), "-o", str(tmp_path / "hand.json")]) == 0
    hand = json.loads((tmp_path / "hand.json").read_text())
    assert [s["gpus"] for s in hand["stages"]] == [s["gpus"] for s in searched["stages"]]
    assert hand["predicted"]["iteration_time_s"] == pytest.approx(searched["predicted"]["iteration_time_s"],
                                                                  rel=1e-9)


def test_an_interleaved_plan_is_written_as_its_plain_stages(tmp_path, capsys):
    """Interleaved 1F1B (2 x 4 V100s, Megatron, --schedule auto): the stages hold their plain share of layers and a
    comment names the schedule; costed back under the same --schedule, the same interleaved plan."""
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(V100_X8))
    args = ["--cluster", str(tmp_path / "cluster.yaml"), "--model", "gpt3-2.7b", "--global-batch", "32", "--seq-len",
            "1024", "--dtype", "fp16", "--runtime", "megatron", "--schedule", "auto", "--workers", "1"]
    stages = tmp_path / "my-plan.yaml"
    assert main(["plan", *args, "-o", str(tmp_path / "searched.json"), "--stages-out", str(stages)]) == 0
    searched = json.loads((tmp_path / "searched.json").read_text())
    assert searched["schedule"] == "interleaved-1F1B"
    assert (f"# planned as interleaved-1F1B, {searched['virtual_stages']} model chunks per stage: cost it with "
            "--schedule auto or interleaved-1F1B") in stages.read_text()
    assert [w["layers"] for w in yaml.safe_load(stages.read_text())["stages"]] == \
        [s["layers"] for s in searched["stages"]]
    assert main(["plan", *args, "--plan", str(stages), "-o", str(tmp_path / "hand.json")]) == 0
    hand = json.loads((tmp_path / "hand.json").read_text())
    assert (hand["schedule"], hand["virtual_stages"]) == ("interleaved-1F1B", searched["virtual_stages"])
    assert hand["predicted"]["iteration_time_s"] == pytest.approx(searched["predicted"]["iteration_time_s"],
                                                                  rel=1e-9)
