"""Around a save: a corrupt newest checkpoint is moved aside, one run per directory, a full disk is a message and
leaves no temporary, and the launcher picks the checkpoint the workers load."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tangram_launch.checkpoint import guard as checkpoint_guard, lock as checkpoint_lock
from tangram_launch.launch import planning as planned
from tangram_launch.checkpoint import store
from tangram_launch.checkpoint import TrainingPosition, load_checkpoint, save_checkpoint
from tangram_launch.errors import SpecError
from test_checkpoint import BATCH, _corrupt, plan_of, train, whole_state


def _names(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n != checkpoint_lock.LOCK_FILE)


@pytest.fixture(autouse=True)
def _release_locks():
    yield
    checkpoint_lock.release_all()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped byte", "truncated manifest", "deleted file"])
def test_a_corrupt_newest_checkpoint_is_skipped_and_the_run_saves_past_it(tmp_path, damage):
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    for step in (1, 2):
        train(module, opt, [step])
        save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(step, step * BATCH))
    step2 = tmp_path / "step_2"
    if damage == "flipped byte":
        _corrupt(str(next((step2 / "state").glob("*.distcp"))))
    elif damage == "truncated manifest":
        data = (step2 / store.MANIFEST).read_bytes()
        (step2 / store.MANIFEST).write_bytes(data[: len(data) // 2])
    else:
        os.remove(step2 / store.POSITION_FILE)
    m2, o2, s2 = whole_state(plan, seed=7)
    assert load_checkpoint(tmp_path, plan=plan, state=s2).step == 1
    assert planned.describe_resume(str(tmp_path)).step == 1  # the launcher picks what the workers load
    train(m2, o2, [2])
    save_checkpoint(tmp_path, plan=plan, state=s2, position=TrainingPosition(2, 2 * BATCH))  # saves past it
    names = _names(tmp_path)
    assert names[:2] == ["step_1", "step_2"] and len(names) == 3 and names[2].startswith("step_2.corrupt-")
    assert load_checkpoint(tmp_path, plan=plan, state=whole_state(plan, seed=8)[2]).step == 2


def test_a_same_size_corrupt_plan_makes_the_launcher_fall_back_not_refuse(tmp_path):
    plan = plan_of([(4, 1)])
    _, _, state = whole_state(plan)
    for step in (8, 12):
        save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(step, step * BATCH))
    path = tmp_path / "step_12" / store.PLAN_FILE
    data = bytearray(path.read_bytes())
    data[0] = ord("[")  # same size, not JSON any more
    path.write_bytes(bytes(data))
    info = planned.describe_resume(str(tmp_path))
    assert info.step == 8 and "checksum mismatch in plan.json" in info.skipped[0].reason
    _corrupt(str(next((tmp_path / "step_8" / "state").glob("*.distcp"))))
    with pytest.raises(SpecError, match="no complete checkpoint"):  # every checkpoint corrupt: no worker starts
        planned.describe_resume(str(tmp_path))


HOLDER = """
import sys, time
from tangram_launch.checkpoint import lock as checkpoint_lock
checkpoint_lock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.distributed
def test_a_second_run_is_refused_naming_the_owner_and_a_stale_lock_is_taken_over(tmp_path):
    ckpt = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(ckpt)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SpecError, match=rf"in use by another run \(host \S+, pid {holder.pid}, since"):
            checkpoint_lock.acquire(str(ckpt))
        plan = plan_of([(4, 1)])
        _, _, state = whole_state(plan)
        with pytest.raises(SpecError, match=f"pid {holder.pid}"):
            save_checkpoint(ckpt, plan=plan, state=state, position=TrainingPosition(1, 4))
        assert _names(ckpt) == []  # nothing written, not even a temporary
        # the launcher: exit 2 before any worker starts
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
        proc = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "1",
                               "--checkpoint-dir", str(ckpt), "--no-python", "touch", str(tmp_path / "ran")],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2 and f"pid {holder.pid}" in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "ran").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    token = checkpoint_lock.acquire(str(ckpt))  # the owner is gone: stale, taken over
    assert checkpoint_lock.read_owner(str(ckpt)).token == token
    checkpoint_lock.release(str(ckpt))
    assert not (ckpt / checkpoint_lock.LOCK_FILE).exists()


def test_workers_write_under_their_launchers_lock(tmp_path, monkeypatch):
    token = checkpoint_lock.acquire(str(tmp_path))
    owner = checkpoint_lock.read_owner(str(tmp_path))
    checkpoint_lock._HELD.clear()  # now as a worker process that did not take it
    monkeypatch.setenv(checkpoint_lock.ENV_LOCK_TOKEN, token)
    checkpoint_lock.ensure_held(str(tmp_path))
    assert checkpoint_lock.read_owner(str(tmp_path)) == owner
    monkeypatch.setenv(checkpoint_lock.ENV_LOCK_TOKEN, "another-launcher")
    with pytest.raises(SpecError, match="in use by another run"):
        checkpoint_lock.ensure_held(str(tmp_path))
    os.remove(tmp_path / checkpoint_lock.LOCK_FILE)


def test_disk_full_while_writing_removes_the_temporary_and_says_how_much_space(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    real_writer = dcp.FileSystemWriter

    class FullDiskWriter(real_writer):  # writes some bytes, then the disk is full
        def write_data(self, plan, planner):
            with open(os.path.join(self.path, "partial.distcp"), "wb") as f:
                f.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")

    plan = plan_of([(4, 1)])
    _, _, state = whole_state(plan)
    save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(1, 4))
    stale = tmp_path / "step_1.tmp-0123456789ab"  # a temporary of an earlier crash: pruned before saving
    stale.mkdir()
    monkeypatch.setattr(dcp, "FileSystemWriter", FullDiskWriter)
    with pytest.raises(SpecError) as exc:
        save_checkpoint(tmp_path, plan=plan, state=state, position=TrainingPosition(2, 8))
    text = str(exc.value)
    assert f"{tmp_path} ran out of space: the checkpoint needs about" in text and "free now" in text
    assert "partial save was removed" in text
    assert _names(tmp_path) == ["step_1"]  # no temporary of this save, none of the earlier one


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.distributed
def test_a_small_filesystem_refuses_before_writing_or_cleans_up_after_enospc(tmp_path, monkeypatch):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        plan = plan_of([(4, 1)])
        _, _, state = whole_state(plan)
        with pytest.raises(SpecError, match=rf"not enough free space in {disk}.*needs about 4\.\d MiB, \d+\.\d KiB"):
            save_checkpoint(disk, plan=plan, state=state, position=TrainingPosition(1, 4))
        assert _names(disk) == []
        monkeypatch.setattr(checkpoint_guard, "SMALL_FILES_MARGIN_BYTES", 0)  # the estimate fits; the write won't
        monkeypatch.setattr("tangram_launch.checkpoint.guard.SMALL_FILES_MARGIN_BYTES", 0)
        (disk / "ballast").write_bytes(b"\0" * (200 << 10))
        with pytest.raises(SpecError, match=rf"{disk} ran out of space"):
            save_checkpoint(disk, plan=plan, state=state, position=TrainingPosition(1, 4))
        assert _names(disk) == ["ballast"]
    finally:
        subprocess.run(["umount", str(disk)], check=False)
