"""SIGTERM/SIGINT to the launcher: one line saying what was stopped, exit status 128 + signal, no worker left."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = """
import os, sys, time
with open(sys.argv[1] + "." + os.environ["RANK"], "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone as far as work goes
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.distributed
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_launch_with_one_line_and_128_plus_signal(tmp_path: Path, sig):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "2",
                             str(script), str(tmp_path / "started")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"started.{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "workers did not start"
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("tangram-launch:")]
    assert lines == [f"tangram-launch: stopped by {sig.name}: this node's workers (2 per node, {script}) were "
                     f"terminated; exit status {128 + sig}"], err[-2000:]
    assert "SignalException" not in err  # (on SIGINT the workers themselves print a KeyboardInterrupt)
    pids = [int((tmp_path / f"started.{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
