"""Checkpoints cross-resume between every example plan in examples/data/ and a planner-made plan of the same model.

Real launches on 2 CPU ranks: a run under the example plan saves at step 2 and trains to step 4; a run under the plan
``tangram-launch plan`` makes for the same model and batch resumes from that step 2 and must reach step 4 with the
same losses, and the other way round for the torch example. In-process: a field left at its default (``dropout``
absent from an older plan) equals the default a planned plan spells out, and a real difference names its fix.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from timeouts import SUBPROCESS_TIMEOUT_S

from tangram_launch.checkpoint.save_load import model_differences
from tangram_launch.specs.model import load_preset

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
EXAMPLE_PLANS = {"plan-tiny-2cpu.json": "train_gpt.py", "plan-tiny-2cpu-deepspeed.json": "train_gpt_deepspeed.py"}
PLANNED_ARGS = ["--global-batch", "8", "--seq-len", "64", "--dtype", "fp32", "--optimizer", "adamw"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"))
    return env


def _train(tmp_path: Path, plan: str, script: str, out: str, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2",
                           "--plan", plan, str(EXAMPLES / script), "--steps", "4", "--out", out, "--quiet", *extra],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / out).read_text())


def _planned(tmp_path: Path) -> str:
    """The plan `tangram-launch plan` makes for the example plans' model and batch on the 2-rank CPU cluster."""
    path = tmp_path / "planned.json"
    proc = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "plan", "--cluster",
                           str(EXAMPLES / "clusters" / "cpu-2.yaml"), "--model", "tiny", *PLANNED_ARGS,
                           "--workers", "1", "-o", str(path)], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(path)


def _keep_step_2(tmp_path: Path) -> None:
    """The whole run saved at steps 2 and 4; the resume starts from step 2."""
    shutil.rmtree(tmp_path / "ckpt" / "step_4")


def _same_losses(resumed: dict, whole: dict) -> None:
    assert resumed["steps"] == [3, 4] and whole["steps"] == [1, 2, 3, 4]
    assert resumed["resumed"]["step"] == 2
    assert resumed["losses"] == pytest.approx(whole["losses"][2:], rel=1e-5, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("example", sorted(EXAMPLE_PLANS))
def test_an_example_plans_checkpoint_resumes_under_a_planned_plan(tmp_path, example):
    planned = _planned(tmp_path)
    plan = str(EXAMPLES / "data" / example)
    with open(plan, encoding="utf-8") as f, open(planned, encoding="utf-8") as g:
        assert json.load(f)["model"] == json.load(g)["model"]  # the same model, field for field
    whole = _train(tmp_path, plan, EXAMPLE_PLANS[example], "a.json", "--save-dir", "ckpt", "--save-every", "2")
    _keep_step_2(tmp_path)
    resumed = _train(tmp_path, planned, "train_gpt.py", "b.json", "--resume", "ckpt")
    _same_losses(resumed, whole)


@pytest.mark.distributed
def test_a_planned_plans_checkpoint_resumes_under_the_example_plan(tmp_path):
    planned = _planned(tmp_path)
    whole = _train(tmp_path, planned, "train_gpt.py", "a.json", "--save-dir", "ckpt", "--save-every", "2")
    _keep_step_2(tmp_path)
    resumed = _train(tmp_path, str(EXAMPLES / "data" / "plan-tiny-2cpu.json"), "train_gpt.py", "b.json",
                     "--resume", "ckpt")
    _same_losses(resumed, whole)


# --- in-process ---------------------------------------------------------------------------------------------------

def test_a_field_left_at_its_default_equals_the_default_spelled_out():
    spelled = load_preset("tiny").to_dict()
    assert spelled["dropout"] is True  # learned positions: GPT-2's dropout
    older = {k: v for k, v in spelled.items() if k != "dropout"}
    assert model_differences(older, spelled) == []
    assert model_differences({**spelled, "dropout": None}, spelled) == []
    assert model_differences({**spelled, "dropout": False}, spelled) == [("dropout", False, True)]


def test_a_checkpoint_of_an_older_plan_loads_under_one_that_spells_the_default_out(tmp_path):
    from test_checkpoint import SPEC, plan_of, whole_state

    from tangram_launch.checkpoint import TrainingPosition, load_checkpoint, save_checkpoint
    from tangram_launch.plan import Plan

    spelled = plan_of([(4, 1)])
    assert spelled.model["dropout"] is True
    older = Plan.from_dict({**spelled.to_dict(), "model": {k: v for k, v in spelled.model.items() if k != "dropout"}})
    _, _, state = whole_state(older)
    save_checkpoint(tmp_path, plan=older, state=state, position=TrainingPosition(1, 4))
    _, _, state2 = whole_state(spelled, seed=99)
    assert load_checkpoint(tmp_path, plan=spelled, state=state2).position.step == 1
    for k, v in state.model.items():
        assert torch.equal(state2.model[k], v), k
    assert SPEC.dropout is True


def test_a_different_model_is_refused_with_the_fix(tmp_path):
    from test_checkpoint import SPEC, plan_of, whole_state

    from tangram_launch.checkpoint import TrainingPosition, load_checkpoint, save_checkpoint
    from tangram_launch.errors import SpecError
    from tangram_launch.specs.model import ModelSpec

    plan = plan_of([(4, 1)])
    _, _, state = whole_state(plan)
    save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(1, 4))
    no_dropout = plan_of([(4, 1)], spec=ModelSpec.from_dict({**SPEC.to_dict(), "dropout": False}))
    _, _, state2 = whole_state(no_dropout)
    with pytest.raises(SpecError) as exc:
        load_checkpoint(tmp_path, plan=no_dropout, state=state2)
    text = str(exc.value)
    assert "dropout: True in the checkpoint, False in the plan" in text
    assert f"to resume it, plan for the model it was written for (its plan: {tmp_path / 'step_1' / 'plan.json'})" \
        in text
