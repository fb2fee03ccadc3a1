"""The README's main job through the CLI (torch's own launch machinery, gloo, 2 CPU processes, the tiny model): its
``--profile`` times the model's layers, the plan's stages are priced from them, and a second launch reuses the
cached profile without timing any layer again."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

from tangram_launch.costmodel.measured_layers import HOW
from tangram_launch.specs.cluster import ClusterSpec

REPO = Path(__file__).resolve().parent.parent
README_JOB = ["--standalone", "--nproc-per-node", "2", "--profile", "--model", "tiny", "--global-batch", "8",
              "--seq-len", "64", "examples/train_gpt.py", "--steps", "2"]


def _launch(cache: Path, logs: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-m", "tangram_launch.cli", "--log-dir", str(logs), *README_JOB],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def _plan(logs: Path) -> dict:
    files = sorted((logs / "tangram").glob("plan-*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


@pytest.mark.slow
@pytest.mark.distributed
def test_the_readme_job_prices_its_stages_from_layers_timed_at_launch_then_reuses_them(tmp_path):
    cache = tmp_path / "cache"
    first = _launch(cache, tmp_path / "logs1")
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    assert "no cached profile for hardware fingerprint" in out and "model layer tiny (dense) b=1 s=64 tp=1" in out
    [profile] = (cache / "profiles").glob("*.yaml")
    spec = ClusterSpec.load(profile)
    # every shape the planner prices, in the profiler's order (the most useful first); the launch's layer budget
    # is wall-clock, so on a loaded machine it may stop early: then it says so, the shapes left out are the last
    # ones, and the stages are priced from the nearest measured shape instead
    # (tp 1 with the embedding and head, then the 2-way shard of the layer)
    planned = [f"tiny|{kind}|seq=64|mbs={mbs}|tp={tp}" for tp in (1, 2) for mbs in (1, 2, 4, 8)
               for kind in (("dense", "embedding", "head") if tp == 1 else ("dense",))]
    spent = re.search(r"layer budget \d+ s spent: (\d+) of (\d+) shape", out)
    for _, gpu in spec.iter_gpus():
        timed = set(gpu.measured["layer_forward_s"])
        if spent is None:
            assert set(planned) <= timed, sorted(set(planned) - timed)
        else:
            assert int(spent[2]) == len(planned) and int(spent[1]) >= len(planned) // 2, spent[0]
            assert [k in timed for k in planned] == [i < int(spent[1]) for i in range(len(planned))], sorted(timed)
    plan = _plan(tmp_path / "logs1")
    stages = plan["predicted"]["stages"]
    hows = ("measured",) if spent is None else HOW
    assert stages and all((s.get("measured") or {}).get("how") in hows for s in stages), stages
    parts = {p for s in stages for p in s["measured"]["parts"]}
    assert {"dense", "embedding", "head"} <= parts and not any(s["measured"].get("analytic_parts") for s in stages)
    assert "stage 0: priced from measured layer times" in out
    assert "step    2  loss" in first.stdout

    second = _launch(cache, tmp_path / "logs2")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "reusing the cached profile" in out
    assert "profiling: tangram-launch" not in out and "model layer" not in out and "[profile rank" not in out
    assert _plan(tmp_path / "logs2") == plan  # the same measured figures, the same plan
    assert "stage 0: priced from measured layer times" in out and "step    2  loss" in second.stdout
