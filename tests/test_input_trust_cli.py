"""Input trust through the real console script and real gloo launches (distributed tier).

* control characters in every kind of input file: exit 2 naming the file, no traceback;
* a model folder with ``auto_map`` and an unknown ``model_type``: the planner and a launch of train_hf.py refuse it
  with exit 2, with "y" on stdin and with stdin closed, and the folder's code never runs;
* bad input only a worker sees (another model's checkpoint, a typed error out of a script): launcher exit 2;
* ``--lr 1e30``: exit 2 naming the flag; a nan loss stops the run naming the step, the last good checkpoint kept;
* SIGKILL of the launcher: its workers die within seconds, write nothing more, and a second launch resumes exactly;
* ``--max-restarts`` without ``--checkpoint-dir``: the restarted round continues from the script's save directory.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bad_inputs import CLUSTER, PLAN, hf_config, tiny_model
from helpers_plans import make_plan
from hf_remote_code import remote_code_folder
from timeouts import SUBPROCESS_TIMEOUT_S

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parent.parent
TRAIN_GPT = REPO / "examples" / "train_gpt.py"
TRAIN_HF = REPO / "examples" / "train_hf.py"
SCRIPTS = REPO / "tests" / "scripts"
TINY_LLAMA = REPO / "examples" / "models" / "tiny-llama"
TRAIN = ["--steps", "8", "--save-every", "2", "--timeout-s", "60", "--quiet"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _cli(tmp_path: Path, *args: str, stdin: str = "devnull") -> subprocess.CompletedProcess:
    """``python -m tangram_launch.cli ARGS`` with stdin from /dev/null, "y" forever (``yes y |``) or closed."""
    cmd = shlex.join([sys.executable, "-m", "tangram_launch.cli", *args])
    shell = {"devnull": f"{cmd} </dev/null", "yes": f"yes y | {cmd}", "closed": f"{cmd} <&-"}[stdin]
    return subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)


def _refused(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr[-3000:])


def _plan(tmp_path: Path, model="tiny", stages=((3, "local"), (1, "local")), name="plan.json") -> str:
    path = tmp_path / name
    make_plan(model, list(stages), global_batch=8, num_microbatches=4 if len(stages) > 1 else 1,
              seq_len=32).dump(str(path))
    return str(path)


# --- control characters through the console script ----------------------------------------------------------------

def test_control_characters_in_every_input_file_exit_2_naming_it(tmp_path):
    files = {"cluster.yaml": "\x00\x01\x02garbage: [\n",
             "model.yaml": json.dumps(tiny_model()).replace(", ", ",\x00 ", 1),
             "config.json": json.dumps(hf_config()).replace("llama", "lla\x1bma"),
             "hand.yaml": "stages:\n  - {layers: [0, 4], island: cpu}\x07\n",
             "plan.json": PLAN.read_text().replace("{", "{\x00", 1)}
    for name, text in files.items():
        (tmp_path / name).write_text(text, newline="")
    runs = [["islands", "--cluster", "cluster.yaml"],
            ["estimate", "--cluster", str(CLUSTER), "--model", "model.yaml"],
            ["plan", "--cluster", str(CLUSTER), "--model", "config.json"],
            ["plan", "--cluster", str(CLUSTER), "--model", "tiny", "--plan", "hand.yaml", "--workers", "1"],
            ["--standalone", "--nproc-per-node", "2", "--plan", "plan.json", str(TRAIN_GPT)]]
    for argv, name in zip(runs, files):
        _refused(_cli(tmp_path, *argv), name)


# --- a model folder's own code -------------------------------------------------------------------------------------

@pytest.mark.parametrize("stdin", ["yes", "closed"])
def test_a_model_folder_with_auto_map_never_runs_its_code(tmp_path, stdin):
    folder, marker = remote_code_folder(tmp_path)
    plan = _cli(tmp_path, "plan", "--cluster", str(CLUSTER), "--model", str(folder), "--global-batch", "8",
                "--seq-len", "32", stdin=stdin)
    _refused(plan, "model_type", "evil-llama", "llama, mistral, mixtral")
    launch = _cli(tmp_path, "--standalone", "--nproc-per-node", "1",
                  "--plan", _plan(tmp_path, load_tiny_llama(), [(4, "local")]), str(TRAIN_HF),
                  "--hf-model", str(folder), "--steps", "1", stdin=stdin)
    _refused(launch, "train_hf", "model_type", "evil-llama", "refused its input")
    assert "[y/N]" not in launch.stdout + launch.stderr and "custom code" not in launch.stdout + launch.stderr
    assert not marker.exists()


def load_tiny_llama():
    from tangram_launch.specs.model import load_model

    return load_model(str(TINY_LLAMA))


# --- bad input that only a worker sees ----------------------------------------------------------------------------

def test_another_models_checkpoint_found_by_the_workers_ends_the_launch_with_2(tmp_path):
    from tangram_launch.checkpoint import TrainingPosition, save_checkpoint
    from test_checkpoint import plan_of, whole_state

    other = plan_of([(4, 1)])  # a 16-wide model, not "tiny"
    save_checkpoint(tmp_path / "other", plan=other, state=whole_state(other)[2], position=TrainingPosition(2, 8))
    proc = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", _plan(tmp_path), str(TRAIN_GPT),
                "--resume", str(tmp_path / "other"), "--steps", "2")
    _refused(proc, "train_gpt: error:", "refused its input")

    raising = tmp_path / "raising.py"  # a script's own typed error, uncaught: boot reports it in one line
    raising.write_text("from tangram_launch.errors import SpecError\n"
                       "raise SpecError('shape mismatch', field='layers.0.weight', value=[4, 4], valid='[8, 4]')\n")
    proc = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", _plan(tmp_path), str(raising))
    _refused(proc, "error: field 'layers.0.weight': shape mismatch")
    # whichever worker refused first is named; the agent stops the other one, which may not get to print
    assert re.search(r"raising\.py \(plan node local, local rank [01]\): error: field 'layers\.0\.weight'",
                     proc.stderr), proc.stderr[-3000:]


# --- numbers -------------------------------------------------------------------------------------------------------

def test_absurd_hyperparameters_are_refused_and_a_nan_loss_keeps_the_last_good_checkpoint(tmp_path):
    plan = _plan(tmp_path)
    _refused(_cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", plan, str(TRAIN_GPT), "--lr", "1e30",
                  "--steps", "1"), "field '--lr': out of range (got 1e+30)")  # nan, -1, ...: test_worker_trust.py
    _refused(_cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", plan, str(TRAIN_GPT), "--lr", "x"),
             "argument --lr: invalid float value: 'x'")  # a script's usage error: exit 2 as well

    ckpt = tmp_path / "ckpt"
    proc = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", plan, str(SCRIPTS / "nan_at_step.py"),
                "5", *TRAIN, "--save-dir", str(ckpt))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "the loss is nan at step 5 on stage 0" in proc.stderr and "on stage 1" in proc.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_2", "step_4"]
    from tangram_launch.checkpoint.store import find_latest

    assert find_latest(str(ckpt)).step == 4  # the newest checkpoint verifies, checksums included


# --- worker lifetime ------------------------------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie does no work
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _steps(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) if ckpt.exists() else []


def test_killing_the_launcher_stops_its_workers_and_a_new_launch_resumes_exactly(tmp_path):
    plan, ckpt, pids = _plan(tmp_path), tmp_path / "ckpt", tmp_path / "pids"
    pids.mkdir()
    ref = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", plan, str(TRAIN_GPT), *TRAIN,
               "--save-dir", str(tmp_path / "ref"), "--out", "ref.json")
    assert ref.returncode == 0, ref.stderr[-3000:]

    cmd = [sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2", "--plan", plan,
           "--checkpoint-dir", str(ckpt), str(SCRIPTS / "slow_saves.py"), str(pids), "4", *TRAIN,
           "--save-dir", str(ckpt)]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while not (ckpt / "step_4").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, "the run ended before step 4"
            time.sleep(0.05)
        launcher.send_signal(signal.SIGKILL)  # the workers sleep 4 s after each save: killed between two saves
        launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    workers = [int((pids / f"rank{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 3  # within their 4 s sleep: the death signal, not the check at the next save
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers), "orphaned workers outlived their launcher"
    left = _steps(ckpt)
    time.sleep(3)
    assert _steps(ckpt) == left == ["step_2", "step_4"]  # nothing written after the launcher died

    resumed = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", plan, "--resume", str(ckpt),
                   str(TRAIN_GPT), *TRAIN, "--save-dir", str(ckpt), "--out", "run.json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("run.json", "ref.json"))
    assert got["resumed"]["step"] == 4 and got["steps"] == [5, 6, 7, 8]
    assert got["losses"] == pytest.approx(want["losses"][4:], rel=1e-5, abs=1e-6)


def test_a_restart_without_checkpoint_dir_continues_from_the_scripts_save_dir(tmp_path):
    plan, ckpt = _plan(tmp_path), tmp_path / "ckpt"
    ref = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", plan, str(TRAIN_GPT), *TRAIN,
               "--save-dir", str(tmp_path / "ref"), "--out", "ref.json")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--plan", plan, "--max-restarts", "1",
               str(SCRIPTS / "die_after_save.py"), "1", "4", *TRAIN, "--save-dir", str(ckpt), "--out", "run.json")
    assert run.returncode == 0, run.stderr[-4000:]
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("run.json", "ref.json"))
    assert got["resumed"]["path"] == str(ckpt / "step_4") and got["steps"] == [5, 6, 7, 8]
    assert got["losses"] == pytest.approx(want["losses"][4:], rel=1e-5, abs=1e-6)
    assert "already exists" not in run.stderr
