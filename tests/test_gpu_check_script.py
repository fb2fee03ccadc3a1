"""benchmarks/gpu_check_costmodel.sh, the prepared GPU check of the cost model, run for real on CPU (``ON_CPU=1``:
the same profile, plan, launch, analytic re-pricing and table, on a tiny Llama-style model), so the script a GPU
session runs once is known to work before it gets its minutes. What needs a GPU: the figures it prints there."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.distributed
def test_gpu_check_runs_every_step_on_cpu(tmp_path):
    env = dict(os.environ, ON_CPU="1", PYTHON=sys.executable, OMP_NUM_THREADS="1", STEPS="6")
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check_costmodel.sh"), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "gpu_check_costmodel: ran every step" in out
    # one row per stage: predicted (measured-priced), analytic, measured, both errors
    rows = re.findall(r"^\s+(\d+)\s+\S+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([+-][\d.]+%)\s+([+-][\d.]+%)$", out, re.M)
    assert rows, out[-3000:]
    assert all(float(r[3]) > 0 for r in rows)  # measured forward + backward per micro-batch
    assert (tmp_path / "out" / "run" / "run-report.json").is_file()
    assert re.search(r"iteration: predicted [\d.]+ ms \(analytic [\d.]+\), measured median [\d.]+ ms", out)


@pytest.mark.distributed
def test_gpu_check_refuses_without_a_gpu_or_cpu_mode(tmp_path):
    """Without CUDA and without ON_CPU=1 the script says what it needs and exits 2 (it starts nothing)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the script would run for real")
    env = {k: v for k, v in os.environ.items() if k != "ON_CPU"} | {"PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_check_costmodel.sh"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 2 and "no CUDA GPU visible" in proc.stderr
