"""The command line in a subprocess, for distributed-tier tests: `python -m tangram_launch.cli ARGS` in a directory,
with this repository importable, one OpenMP thread, a private cache and no inherited launcher variables."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from timeouts import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parent.parent


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return env


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the CLI in ``tmp_path``; a non-zero exit fails the test with the end of stderr."""
    proc = subprocess.run([sys.executable, "-m", "tangram_launch.cli", *args], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
