"""The README is a user guide: short, its links resolve, no work-log, and its first screen's two commands work as
printed in a fresh clone with an empty HOME."""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from timeouts import SUBPROCESS_TIMEOUT_S

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
USER_DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _first_screen_block(title: str) -> list[str]:
    """The command lines of the ```bash block after the README's bold TITLE."""
    text = README.read_text(encoding="utf-8")
    block = text.split(f"**{title}**", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line and not line.startswith("#")]


def test_readme_is_at_most_300_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        if not (doc.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"{doc.name}: broken relative links {broken}"


@pytest.mark.parametrize("doc", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_user_docs_carry_no_work_log(doc):
    text = doc.read_text(encoding="utf-8")
    assert not re.search(r"\bissue \d+|\bbranch [a-z]+\b|\b20\d\d-\d\d-\d\d\b", text), doc.name
    # a commit hash: 7+ hex digits with at least one letter and one digit, outside code blocks' hex literals
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, (doc.name, hashes)


def test_first_screen_holds_both_commands_within_two_lines_each():
    main_job, tests = _first_screen_block("Run the main job"), _first_screen_block("Run the tests")
    assert 1 <= len(main_job) <= 2 and 1 <= len(tests) <= 2
    head = "\n".join(README.read_text(encoding="utf-8").splitlines()[:40])
    assert "**Run the main job**" in head and "**Run the tests**" in head


@pytest.mark.slow
@pytest.mark.distributed
def test_first_screen_commands_work_in_a_fresh_clone_with_an_empty_home(tmp_path):
    """Both blocks run as printed, by bash, in a `git clone` of this repository with an empty HOME (cold pip, torch
    extension and profile caches). The tests block runs the README's pytest command with PYTEST_ADDOPTS selecting
    this file's unit tests, so the suite does not run itself recursively; the install line runs in full."""
    clone, home = tmp_path / "clone", tmp_path / "home"
    home.mkdir()
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=SUBPROCESS_TIMEOUT_S)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PYTEST", "TANGRAM"))}
    env.update(HOME=str(home), PATH=os.environ.get("PATH", "/usr/bin:/bin"))

    def run(lines: list[str], extra_env: dict) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        done = subprocess.run(["bash", "-ec", "\n".join(lines)], cwd=clone, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=3 * SUBPROCESS_TIMEOUT_S)
        return done, time.monotonic() - start

    main_job = _first_screen_block("Run the main job")
    done, _ = run(main_job, {})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([\d.]+)", out)]
    assert len(losses) >= 5 and losses[-1] < losses[0], out[-4000:]
    assert "Traceback" not in out

    done, _ = run(_first_screen_block("Run the tests"), {"PYTEST_ADDOPTS": "-m unit -k test_readme"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"\b\d+ passed\b", out), out[-2000:]


@pytest.mark.parametrize("doc", [README, REPO / "docs" / "inputs.md"], ids=lambda p: p.name)
def test_the_cluster_files_shown_in_the_docs_load(doc, tmp_path):
    from tangram_launch.specs.cluster import ClusterSpec

    blocks = [b.split("```", 1)[0] for b in doc.read_text(encoding="utf-8").split("```yaml")[1:]]
    clusters = [b for b in blocks if "\nnodes:" in b and "network:" in b]
    assert clusters, doc.name
    for i, block in enumerate(clusters):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(block)
        assert ClusterSpec.load(path).num_gpus > 0
