"""Resume a run under another layout: ``tangram-launch --resume DIR`` with the torch and DeepSpeed examples.

Real launches on CPU: layout A (2 ranks, layers 3+1) trains 4 steps without interruption, saving at steps 2 and 4;
step 4's save is then torn (manifest gone), and layout B (3 ranks, layers 1+2+1) resumes from the last complete
checkpoint (step 2) and trains steps 3-4, whose losses must equal A's. In-process: the data stream's position under
a changed global batch, what the launcher reports as changed, the plan inputs a resume keeps, and keep-last-K
retention that never trades a complete checkpoint for a corrupt newer one.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S
import torch

from tangram_launch.checkpoint import store
from tangram_launch.launch import planning as planned, torchrun as launch
from tangram_launch.errors import SpecError

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
LAYOUT_A = [(3, "local"), (1, "local")]
LAYOUT_B = [(1, "local"), (2, "local"), (1, "local")]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"))
    return env


def _cli(tmp_path: Path, *args: str, timeout: float = SUBPROCESS_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tangram_launch.cli", "--standalone", *args], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)


def _plan_file(tmp_path: Path, name: str, stages, runtime: str) -> str:
    from helpers_plans import make_plan

    path = tmp_path / f"{name}.json"
    make_plan("tiny", stages, global_batch=8, num_microbatches=4, seq_len=32, runtime=runtime).dump(str(path))
    return str(path)


def _resume_under_a_new_layout(tmp_path: Path, runtime: str, script: str) -> None:
    example = str(EXAMPLES / script)
    plan_a, plan_b = (_plan_file(tmp_path, n, s, runtime) for n, s in (("A", LAYOUT_A), ("B", LAYOUT_B)))
    ckpt = tmp_path / "ckpt"
    a = _cli(tmp_path, "--nproc-per-node", "2", "--plan", plan_a, example, "--steps", "4", "--save-dir", str(ckpt),
             "--save-every", "2", "--out", "a.json")
    assert a.returncode == 0, a.stderr[-3000:]
    assert sorted(n for n in os.listdir(ckpt) if n != ".tangram-lock") == ["step_2", "step_4"]
    os.remove(ckpt / "step_4" / store.MANIFEST)  # step 4's save torn: the resume must fall back to step 2

    b = _cli(tmp_path, "--nproc-per-node", "3", "--plan", plan_b, "--resume", str(ckpt), example, "--steps", "4",
             "--out", "b.json")
    assert b.returncode == 0, b.stderr[-3000:]
    ra, rb = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert ra["steps"] == [1, 2, 3, 4] and rb["steps"] == [3, 4]
    assert rb["losses"] == pytest.approx(ra["losses"][2:], rel=1e-5, abs=1e-6)
    assert rb["resumed"]["step"] == 2 and rb["resumed"]["consumed_samples"] == 16
    assert rb["resumed"]["layout_changed"] and rb["consumed_samples"] == 32
    # the launcher said what it resumes and what changed, before any worker started
    assert f"resuming from {ckpt / 'step_2'}: step 2, 16 samples consumed" in b.stderr
    assert "world size 2 -> 3" in b.stderr and "stages 2 -> 3" in b.stderr
    assert "stage 0: layers 0-2 on island-0" in b.stderr and "-> layers 0-0 on island-0" in b.stderr
    assert f"skipping checkpoint {ckpt / 'step_4'} (step 4): no manifest" in b.stderr  # a worker's warning


@pytest.mark.distributed
def test_torch_example_resumes_under_a_new_layout(tmp_path):
    _resume_under_a_new_layout(tmp_path, "torch", "train_gpt.py")


@pytest.mark.distributed
def test_deepspeed_example_resumes_under_a_new_layout(tmp_path):
    _resume_under_a_new_layout(tmp_path, "deepspeed", "train_gpt_deepspeed.py")


@pytest.mark.distributed
def test_resume_from_an_older_step_named_by_its_directory(tmp_path):
    """``--resume ckpt/step_2`` where step 4 exists: refused while the run's checkpoint directory would be ckpt/
    (step 4 is another history), resumed exactly (A's losses) with a checkpoint directory of its own."""
    example = str(EXAMPLES / "train_gpt.py")
    plan = _plan_file(tmp_path, "A", LAYOUT_A, "torch")
    ckpt = tmp_path / "ckpt"
    a = _cli(tmp_path, "--nproc-per-node", "2", "--plan", plan, example, "--steps", "4", "--save-dir", str(ckpt),
             "--save-every", "2", "--out", "a.json")
    assert a.returncode == 0, a.stderr[-3000:]
    before = sorted(str(p) for p in ckpt.rglob("*"))
    refused = _cli(tmp_path, "--nproc-per-node", "2", "--plan", plan, "--resume", str(ckpt / "step_2"), example,
                   "--steps", "4", "--out", "refused.json")
    assert refused.returncode == 2 and not (tmp_path / "refused.json").exists(), refused.stderr[-3000:]
    assert (f"{ckpt} holds {ckpt / 'step_4'} (step 4), newer than the resumed {ckpt / 'step_2'} (step 2)"
            in refused.stderr and "--checkpoint-dir NEW_DIR" in refused.stderr), refused.stderr[-3000:]
    assert sorted(str(p) for p in ckpt.rglob("*")) == before  # nothing written or removed
    again = tmp_path / "again"
    b = _cli(tmp_path, "--nproc-per-node", "2", "--plan", plan, "--resume", str(ckpt / "step_2"), "--checkpoint-dir",
             str(again), example, "--steps", "4", "--save-dir", str(again), "--save-every", "1", "--out", "b.json")
    assert b.returncode == 0, b.stderr[-3000:]
    ra, rb = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert rb["steps"] == [3, 4] and rb["resumed"]["step"] == 2
    assert rb["losses"] == pytest.approx(ra["losses"][2:], rel=1e-5, abs=1e-6)
    assert f"resuming from {ckpt / 'step_2'}: step 2, 16 samples consumed" in b.stderr
    assert sorted(n for n in os.listdir(again) if n.startswith("step_")) == ["step_3", "step_4"]


@pytest.mark.distributed
def test_missing_or_empty_checkpoint_directory_exits_2_naming_it(tmp_path):
    plan = _plan_file(tmp_path, "R", [(4, "local")], "torch")
    marker = tmp_path / "started"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    missing = tmp_path / "no-such-ckpt"
    proc = _cli(tmp_path, "--nproc-per-node", "1", "--plan", plan, "--resume", str(missing), str(script))
    assert proc.returncode == 2, proc.stderr
    assert f"checkpoint directory {missing} does not exist" in proc.stderr and "--resume" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SpecError, match=f"no complete checkpoint in {empty}") as info:
        launch.run(["--standalone", "--nproc-per-node", "1", "--plan", plan, "--resume", str(empty), str(script)])
    assert info.value.exit_code == 2
    assert not marker.exists()  # no worker started


# --- in-process --------------------------------------------------------------------------------------------------

def _train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLES / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("data", ["synthetic", str(EXAMPLES / "data" / "corpus.txt")])
def test_data_position_survives_a_changed_global_batch(data):
    tg = _train_gpt()
    b8 = tg.TokenBatches(data, global_batch=8, seq_len=16, vocab_size=256, seed=7)
    b4 = tg.TokenBatches(data, global_batch=4, seq_len=16, vocab_size=256, seed=7)
    stream = torch.cat([b8.batch(0), b8.batch(8), b8.batch(16)])  # (24, 17): an uninterrupted run at batch 8
    assert stream.shape == (24, 17) and len({tuple(r.tolist()) for r in stream}) >= 20  # not one row repeated
    # resumed at 16 consumed samples with global batch 4: the next rows are the stream's, in order
    assert torch.equal(torch.cat([b4.batch(16), b4.batch(20)]), stream[16:24])
    assert torch.equal(b4.batch(8), stream[8:12])


def test_resume_plans_with_the_checkpoint_model_and_batch_unless_changed():
    from tangram_launch.checkpoint.store import CheckpointInfo, TrainingPosition
    from tangram_launch.specs.model import load_model

    old = {"model": load_model("tiny").to_dict(), "runtime": "deepspeed", "planner": {"parallelizer": "uniform"},
           "training": {"global_batch": 12, "seq_len": 32, "dtype": "fp32", "optimizer": "sgd"}}
    info = CheckpointInfo("ckpt/step_3", 3, old, TrainingPosition(3, 36), ())
    kept = planned.plan_inputs(launch.TangramOptions(resume="ckpt"), info)
    assert (kept.model.name, kept.global_batch, kept.seq_len, kept.dtype, kept.optimizer, kept.runtime,
            kept.parallelizer) == ("tiny", 12, 32, "fp32", "sgd", "deepspeed", "uniform")
    changed = planned.plan_inputs(launch.TangramOptions(resume="ckpt", global_batch=6, runtime="torch"), info)
    assert (changed.global_batch, changed.runtime, changed.seq_len) == (6, "torch", 32)


def test_plan_changes_name_stages_layers_islands_and_world_size():
    from helpers_plans import make_plan

    a = make_plan("tiny", LAYOUT_A, global_batch=8, num_microbatches=4).to_dict()
    b = make_plan("tiny", LAYOUT_B, global_batch=4, num_microbatches=4).to_dict()
    lines = planned.plan_changes(a, b)
    assert "world size 2 -> 3" in lines and "stages 2 -> 3" in lines and "global_batch 8 -> 4" in lines
    assert any(line.startswith("stage 1: layers 3-3 on island-1") and line.endswith(
        "-> layers 1-2 on island-1 (1 GPU(s) on local; tp1 dp1 zero0)") for line in lines)
    assert "islands island-0, island-1 -> island-0, island-1, island-2" not in lines  # hand plans list none
    assert planned.plan_changes(a, a) == []


def _fake_checkpoint(root: Path, step: int, payload: bytes = b"x" * 64) -> Path:
    tmp = root / store.tmp_dir_name(step)
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "shard.bin").write_bytes(payload)
    store.write_manifest(str(tmp), {"format": store.FORMAT, "version": store.FORMAT_VERSION, "step": step,
                                    "files": store.hash_files(str(tmp), store.list_files(str(tmp)))})
    final = Path(store.step_dir(str(root), step))
    store.commit(str(tmp), str(final))
    return final


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_keep_last_counts_only_checkpoints_that_verify(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step)
    _flip_a_byte(tmp_path / "step_3" / "state" / "shard.bin")  # same size, wrong sha256
    newest = _fake_checkpoint(tmp_path, 4)
    removed = store.prune(str(tmp_path), 2, keep=str(newest))
    # step 3 does not verify: it stays but does not count; steps 4 and 2 are the two kept, step 1 goes
    assert removed == [str(tmp_path / "step_1")]
    assert sorted(n for n in os.listdir(tmp_path) if n != ".tangram-lock") == ["step_2", "step_3", "step_4"]
    assert store.find_latest(str(tmp_path)).step == 4


def test_keep_last_never_prunes_past_the_newest_verified_checkpoint(tmp_path):
    for step in (1, 2):
        _fake_checkpoint(tmp_path, step)
    newest = _fake_checkpoint(tmp_path, 3)
    os.remove(newest / "state" / "shard.bin")  # the just-committed one lost a file
    assert store.prune(str(tmp_path), 1, keep=str(newest)) == [str(tmp_path / "step_1")]
    # step 2, the newest complete one, stays
    assert sorted(n for n in os.listdir(tmp_path) if n != ".tangram-lock") == ["step_2", "step_3"]
    assert store.find_latest(str(tmp_path)).step == 2
    _flip_a_byte(tmp_path / "step_2" / "state" / "shard.bin")
    assert store.prune(str(tmp_path), 1, keep=str(newest)) == []  # nothing verifies: nothing is removed
