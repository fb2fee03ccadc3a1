"""Pre-flight through the real command line: each mistake exits 2 with one line and its fix, and no worker runs;
a hand-written YAML plan launches and trains; Ctrl-C stops a planned launch with one line and no traceback.

Every launch here is ``python -m tangram_launch.cli`` in a fresh process, as a user runs it.  "No worker ran" is
read from the output: a refused launch prints exactly its error line (no agent, worker or plan lines), and the
target, where it exists, would have printed ``worker ran``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parent.parent
CPU2 = str(REPO / "examples" / "clusters" / "cpu-2.yaml")
EXAMPLE_PLAN = str(REPO / "examples" / "data" / "plan-tiny-2cpu.json")
DEEPSPEED_PLAN = str(REPO / "examples" / "data" / "plan-tiny-2cpu-deepspeed.json")
TRAIN_GPT = str(REPO / "examples" / "train_gpt.py")
HAND_WRITTEN = "stages:\n  - {layers: [0, 2], island: cpu, num_gpus: 1}\n  - {layers: [2, 4], island: cpu, num_gpus: 1}\n"
WORKER = "print('worker ran', flush=True)\n"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"))
    env.update(extra)
    return env


def _cli(tmp_path: Path, *args: str, blocked: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    """The console script's main; ``blocked``: modules made unimportable, as when their package is not installed."""
    code = ("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
            + "from tangram_launch.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=_env(tmp_path, **env),
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def _refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 and exactly one line of output: the error, holding each needle."""
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out[-3000:]
    assert out.count("\n") == 0 and out.startswith("tangram-launch: error: "), out[-3000:]
    for needle in needles:
        assert needle in out, out
    assert "worker ran" not in out and "Traceback" not in out
    return out


@pytest.mark.distributed
def test_each_mistake_is_refused_with_one_line_before_any_worker(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    hand = tmp_path / "my-plan.yaml"
    hand.write_text(HAND_WRITTEN)
    launch = ("--standalone", "--nproc-per-node", "2")
    _refused(_cli(tmp_path, *launch, "trian.py"), "training script not found: trian.py", "did you mean train.py?")
    _refused(_cli(tmp_path, *launch, "-m", "no_such_module_x"), "no module named no_such_module_x")
    _refused(_cli(tmp_path, *launch, "--no-python", "no-such-command-x"), "command not found: no-such-command-x")
    _refused(_cli(tmp_path, *launch, "--plan", "nope.json", str(script)), "nope.json: plan file not found")
    _refused(_cli(tmp_path, "--standalone", "--nproc-per-node", "3", "--plan", EXAMPLE_PLAN, str(script)),
             "field '--nproc-per-node': plan node 'local' has 2 GPU(s)", "(got 3); valid: 2")
    _refused(_cli(tmp_path, *launch, "--cluster", CPU2, "--model", "tiny", "--seq-len", "128", str(script)),
             "field '--seq-len': model tiny has 64 learned positions", "(got 128); valid: at most 64")
    _refused(_cli(tmp_path, *launch, "--plan", DEEPSPEED_PLAN, str(script), blocked=("deepspeed",)),
             "runtime deepspeed needs the deepspeed package", 'pip install -e ".[deepspeed]"')
    _refused(_cli(tmp_path, *launch, "--cluster", CPU2, "--model", "tiny", "--runtime", "megatron", str(script),
                  blocked=("megatron",)), "runtime megatron needs the megatron.core package",
             'pip install -e ".[megatron]"')
    _refused(_cli(tmp_path, *launch, "--plan", str(hand), str(script)),
             "a hand-written plan", "add --model NAME and --cluster FILE")
    # the early reading gives up on PET_* defaults: the same refusal comes after torch's parser
    _refused(_cli(tmp_path, "--standalone", "--plan", EXAMPLE_PLAN, str(script), PET_NPROC_PER_NODE="3"),
             "plan node 'local' has 2 GPU(s)", "(got 3)")
    # `plan` refuses the sequence length the workers would
    proc = _cli(tmp_path, "plan", "--cluster", CPU2, "--model", "tiny", "--seq-len", "128")
    assert proc.returncode == 2 and "model tiny has 64 learned positions" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("cache/plans/*")), "nothing was planned"


@pytest.mark.distributed
def test_help_answers_without_importing_torch(tmp_path):
    code = ("import sys\nfrom tangram_launch.cli import main\nassert main(['--help']) == 0\n"
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: tangram-launch") and proc.stdout.rstrip().endswith("torch not imported")
    assert proc.stdout.index("tangram options:") < proc.stdout.index("torchrun options:")


@pytest.mark.distributed
def test_a_hand_written_yaml_plan_is_costed_then_launched_on_2_cpu_ranks(tmp_path):
    hand = tmp_path / "my-plan.yaml"
    hand.write_text(HAND_WRITTEN)
    proc = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                "--plan", str(hand), "--cluster", CPU2, "--model", "tiny", "--global-batch", "8", "--dtype", "fp32",
                TRAIN_GPT, "--steps", "2", "--out", str(tmp_path / "out.json"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "manual plan for tiny on cpu-2" in proc.stderr  # costed, not searched
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["steps"] == [1, 2] and len(result["losses"]) == 2
    plans = list((tmp_path / "logs" / "tangram").glob("plan-*.json"))
    assert len(plans) == 1
    plan = json.loads(plans[0].read_text())
    assert [s["layers"] for s in plan["stages"]] == [[0, 2], [2, 4]]
    assert sorted(r["rank"] for r in plan["rank_layout"]) == [0, 1]


@pytest.mark.distributed
def test_ctrl_c_stops_a_planned_launch_with_one_line_and_no_traceback(tmp_path):
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(  # its own process group, as a shell's foreground job
            [sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2", "--plan",
             EXAMPLE_PLAN, TRAIN_GPT, "--steps", "100000"], cwd=tmp_path, env=_env(tmp_path), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while "step    2 " not in out_path.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, out_path.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        proc.wait(timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out_path.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    about_it = [line for line in text.splitlines() if "SIGINT" in line or "signal" in line]
    assert about_it == [f"tangram-launch: stopped by SIGINT: plan node local's workers (2 per node, {TRAIN_GPT}) "
                        "were terminated; exit status 130"], text[-3000:]


@pytest.mark.distributed
def test_cpu_workers_given_more_threads_than_cores_are_warned_once_and_still_run(tmp_path):
    """The user's OMP_NUM_THREADS stands, as under torchrun; the launcher says what it costs and what fits."""
    from profiler.inventory import read_node_inventory

    if read_node_inventory().gpus:  # pragma: no cover - workers on GPUs compute there: no warning to see
        pytest.skip("this node has GPUs: the warning is for CPU workers")
    script = tmp_path / "train.py"
    script.write_text(WORKER)
    cores = len(os.sched_getaffinity(0))
    threads = max(2, cores)  # 2 workers' pools of this many threads hold more threads than there are cores
    over = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", str(script), OMP_NUM_THREADS=str(threads))
    out = over.stdout + over.stderr
    assert over.returncode == 0 and out.count("worker ran") == 2, out[-3000:]
    assert out.count("OMP_NUM_THREADS=") == 2, out[-3000:]  # one warning: the value, then the fix
    assert f"OMP_NUM_THREADS={threads} gives each of the 2 CPU worker(s) {threads} threads" in out
    assert f"set OMP_NUM_THREADS={max(1, cores // 2)} " in out
    fits = _cli(tmp_path, "--standalone", "--nproc-per-node", "2", str(script), OMP_NUM_THREADS="1")
    assert fits.returncode == 0 and "OMP_NUM_THREADS" not in fits.stdout + fits.stderr
