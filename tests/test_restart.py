"""``--max-restarts``: a worker killed with SIGKILL mid-run; the restarted round continues from the newest
complete checkpoint (not from step 0), with the losses of an uninterrupted run, on real torchrun machinery."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_gpt.py"
DIE = REPO / "tests" / "scripts" / "die_after_save.py"


def _cli(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_a_killed_worker_restarts_from_the_newest_checkpoint_with_the_same_losses(tmp_path):
    from helpers_plans import make_plan

    plan = tmp_path / "plan.json"
    make_plan("tiny", [(3, "local"), (1, "local")], global_batch=8, num_microbatches=4, seq_len=32,
              runtime="torch").dump(str(plan))
    train = ["--steps", "6", "--save-every", "2", "--timeout-s", "60", "--quiet"]
    ref = _cli(tmp_path, "--plan", str(plan), str(EXAMPLE), *train, "--save-dir", str(tmp_path / "ref"),
               "--out", "ref.json")
    assert ref.returncode == 0, ref.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    run = _cli(tmp_path, "--plan", str(plan), "--max-restarts", "1", "--checkpoint-dir", str(ckpt), str(DIE), "1",
               "4", *train, "--save-dir", str(ckpt), "--out", "run.json")
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Connection refused" not in run.stderr
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("run.json", "ref.json"))
    assert got["resumed"]["step"] == 4 and got["resumed"]["path"] == str(ckpt / "step_4")
    assert got["steps"] == [5, 6] and want["steps"] == [1, 2, 3, 4, 5, 6]
    assert got["losses"] == pytest.approx(want["losses"][4:], rel=1e-5, abs=1e-6)
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("step_")) == ["step_2", "step_4", "step_6"]
    assert not (ckpt / ".tangram-lock").exists()  # the launcher released its lock
