"""Worker-side trust, in process: the lock a worker saves under is re-checked (orphans and runs that lost it stop
saving), bad input a worker detects maps to exit 2, absurd hyper-parameters and non-finite losses stop a run, and a
restart round resumes from the script's own save directory. The same through real launches:
tests/test_input_trust_cli.py."""
from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.checkpoint import TrainingPosition, save_checkpoint
from tangram_launch.checkpoint import lock as checkpoint_lock
from tangram_launch.checkpoint import store
from tangram_launch.checkpoint.rounds import ENV_CHECKPOINT_DIR, ENV_RESUME_DIR, ENV_RESTART_COUNT
from tangram_launch.errors import SpecError
from tangram_launch.launch import lifetime, worker_exit
from tangram_launch.launch.numbers import MAX_LEARNING_RATE, NonFiniteLossError, check_hyperparameter, check_loss
from tangram_launch.launch.restart import resume_dir_for_script
from test_checkpoint import BATCH, plan_of, train, whole_state


# --- the lock, re-checked before every save ----------------------------------------------------------------------

def _dead_pid() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def _lock_file(directory: Path, **fields) -> str:
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "start": checkpoint_lock._start_ticks(os.getpid()),
             "token": "launcher-token", "created_unix_s": 0.0, "command": "tangram-launch",
             "boot_id": checkpoint_lock._boot_id(), **fields}
    directory.mkdir(exist_ok=True)
    (directory / checkpoint_lock.LOCK_FILE).write_text(json.dumps(owner))
    return owner["token"]


def _worker_env(directory: Path, token: str) -> dict[str, str]:
    return {checkpoint_lock.ENV_LOCK_TOKEN: token, ENV_CHECKPOINT_DIR: str(directory)}


def test_a_worker_under_a_live_launchers_lock_saves(tmp_path):
    token = _lock_file(tmp_path / "ckpt")
    checkpoint_lock.ensure_held(str(tmp_path / "ckpt"), _worker_env(tmp_path / "ckpt", token))


def test_an_orphaned_worker_stops_saving(tmp_path):
    token = _lock_file(tmp_path / "ckpt", pid=_dead_pid())
    with pytest.raises(SpecError, match="is gone; this worker is an orphan and stops saving"):
        checkpoint_lock.ensure_held(str(tmp_path / "ckpt"), _worker_env(tmp_path / "ckpt", token))


def test_a_launcher_from_before_a_reboot_is_gone(tmp_path):
    if checkpoint_lock._boot_id() is None:
        pytest.skip("no /proc/sys/kernel/random/boot_id on this system")
    token = _lock_file(tmp_path / "ckpt", boot_id="another-boot")  # our own pid, but another boot
    with pytest.raises(SpecError, match="orphan"):
        checkpoint_lock.ensure_held(str(tmp_path / "ckpt"), _worker_env(tmp_path / "ckpt", token))


def test_a_run_whose_lock_was_taken_over_or_removed_stops_saving_and_never_takes_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    _lock_file(ckpt, token="the-second-run")
    with pytest.raises(SpecError, match=r"lost the lock .*\(now held by host"):
        checkpoint_lock.ensure_held(str(ckpt), _worker_env(ckpt, "launcher-token"))
    os.remove(ckpt / checkpoint_lock.LOCK_FILE)
    with pytest.raises(SpecError, match="lock file is gone"):
        checkpoint_lock.ensure_held(str(ckpt), _worker_env(ckpt, "launcher-token"))
    assert not (ckpt / checkpoint_lock.LOCK_FILE).exists()


def test_the_lock_records_the_launchers_boot_id(tmp_path):
    checkpoint_lock.acquire(str(tmp_path))
    try:
        owner = checkpoint_lock.read_owner(str(tmp_path))
        assert owner.pid == os.getpid() and owner.boot_id == checkpoint_lock._boot_id() and owner.alive()
    finally:
        checkpoint_lock.release(str(tmp_path))


# --- worker exit status and lifetime -----------------------------------------------------------------------------

def test_bad_input_in_a_worker_exits_with_the_status_the_launcher_maps_to_2(capsys):
    told = {worker_exit.ENV_INPUT_ERROR_EXIT: str(worker_exit.EXIT_WORKER_INPUT_ERROR)}
    bad = SpecError("another model's checkpoint", field="model")
    assert worker_exit.exit_status_for(bad, prog="train_gpt", env=told) == worker_exit.EXIT_WORKER_INPUT_ERROR
    assert worker_exit.exit_status_for(bad, prog="train_gpt", env={}) == 2  # python train_gpt.py: plain 2
    assert worker_exit.exit_status_for(NonFiniteLossError("nan"), prog="train_gpt", env=told) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "train_gpt: error: field 'model': another model's checkpoint"
    assert "Traceback" not in err

    failed = {0: SimpleNamespace(exitcode=1), 3: SimpleNamespace(exitcode=worker_exit.EXIT_WORKER_INPUT_ERROR)}
    status, line = worker_exit.launcher_status(failed)
    assert status == 2 and "rank 3 refused its input" in line
    assert worker_exit.launcher_status({0: SimpleNamespace(exitcode=1)}) is None


def test_the_worker_environment_is_exported_for_the_launch_only(monkeypatch):
    monkeypatch.delenv(lifetime.ENV_LAUNCHER_PID, raising=False)
    monkeypatch.setenv(worker_exit.ENV_INPUT_ERROR_EXIT, "earlier")
    with lifetime.worker_environment():
        assert os.environ[lifetime.ENV_LAUNCHER_PID] == str(os.getpid())
        assert os.environ[worker_exit.ENV_INPUT_ERROR_EXIT] == str(worker_exit.EXIT_WORKER_INPUT_ERROR)
    assert lifetime.ENV_LAUNCHER_PID not in os.environ
    assert os.environ[worker_exit.ENV_INPUT_ERROR_EXIT] == "earlier"
    assert lifetime.die_with_launcher({}) is False  # not started by tangram-launch: nothing armed


# --- numbers -------------------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 100), st.booleans(),
                 st.sampled_from([1e30, -1e-3, 0.0, "3e-4", None])))
def test_a_learning_rate_is_taken_only_when_finite_positive_and_sane(value):
    ok = (not isinstance(value, (bool, str)) and value is not None and math.isfinite(value)
          and 0 < value <= MAX_LEARNING_RATE)
    if ok:
        assert check_hyperparameter(value, flag="--lr", high=MAX_LEARNING_RATE) == float(value)
    else:
        with pytest.raises(SpecError) as info:
            check_hyperparameter(value, flag="--lr", high=MAX_LEARNING_RATE)
        assert info.value.field == "--lr" and info.value.exit_code == 2


def test_a_non_finite_loss_names_the_step_and_stage():
    check_loss(2.5, step=3, stage=1)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(NonFiniteLossError, match=r"at step 7 on stage 1; .*newest checkpoint is the last good"):
            check_loss(bad, step=7, stage=1)


# --- restart rounds without --checkpoint-dir ---------------------------------------------------------------------

def test_a_restart_round_resumes_from_the_scripts_save_directory(tmp_path):
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    for d, steps in (("old", (2,)), ("save", (2, 4))):
        for step in steps:
            train(module, opt, [step])
            save_checkpoint(tmp_path / d, plan=plan, state=state, position=TrainingPosition(step, step * BATCH))
    save, old = str(tmp_path / "save"), str(tmp_path / "old")
    assert resume_dir_for_script(None, save, env={}) is None  # round 0, nothing asked: a fresh start
    assert resume_dir_for_script(old, save, env={}) == old
    restarted = {ENV_RESTART_COUNT: "1"}
    assert resume_dir_for_script(None, save, env=restarted) == save  # no --checkpoint-dir: its own saves
    assert resume_dir_for_script(old, save, env=restarted) == save  # step 4 beats --resume's step 2
    assert resume_dir_for_script(None, save, env={**restarted, ENV_RESUME_DIR: old, ENV_CHECKPOINT_DIR: old}) == save
    assert resume_dir_for_script(None, str(tmp_path / "none"), env=restarted) is None


def test_a_restart_round_of_a_run_resumed_from_one_older_checkpoint(tmp_path):
    """``tangram-launch --resume ckpt/step_2 --checkpoint-dir new``: round 0 and a restart before the run saved
    resume step 2 (not ckpt's newer step 4); once the run saved into new/, a restart resumes from there."""
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    for step in (2, 4):
        train(module, opt, [step])
        save_checkpoint(tmp_path / "ckpt", plan=plan, state=state, position=TrainingPosition(step, step * BATCH))
    one, new = str(tmp_path / "ckpt" / "step_2"), str(tmp_path / "new")
    env = {ENV_RESUME_DIR: one, ENV_CHECKPOINT_DIR: new}
    assert resume_dir_for_script(None, new, env=env) == one
    restarted = {**env, ENV_RESTART_COUNT: "1"}
    assert resume_dir_for_script(None, new, env=restarted) == one  # nothing saved yet: still step 2
    assert store.find_latest(one).step == 2  # what the workers then load
    train(module, opt, [3])
    save_checkpoint(new, plan=plan, state=state, position=TrainingPosition(3, 3 * BATCH))
    assert resume_dir_for_script(None, new, env=restarted) == new


@pytest.mark.parametrize("kind", ["fifo", "symlink", "deep", "huge"])
def test_a_lock_file_that_is_not_one_is_an_unknown_owner_read_without_blocking(tmp_path, kind):
    lock = tmp_path / checkpoint_lock.LOCK_FILE
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "symlink":
        (tmp_path / "elsewhere").write_text(json.dumps({"host": "h", "pid": 1, "token": "t"}))
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        lock.write_text("[" * 100_000 + "]" * 100_000 if kind == "deep" else " " * (1 << 20))
    owner = checkpoint_lock.read_owner(str(tmp_path))
    assert owner.pid == -1 and owner.token == ""
