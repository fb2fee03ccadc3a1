"""Resuming a crafted checkpoint through the real launcher on 2 gloo ranks opens no byte outside the checkpoint
directory, in any process of the launch, and ends with a message naming the file and the field, no traceback.

Each crafted checkpoint points outside (a manifest entry under ``../`` or an absolute path, a symlinked
``position.json``, a DCP ``relative_path`` outside) at a file whose name is unique. It is resumed twice: through
``tangram-launch --resume`` (the launcher refuses it before any worker starts: exit 2) and through the script's own
``--resume`` (only the workers see it). What every process opened is recorded with ``strace -f -y`` where strace is
installed (it shows the file each successful open resolved to, so a followed link would show its target), and
otherwise by an audit hook on ``open`` installed in every Python process of the launch through a ``sitecustomize``
on PYTHONPATH. The unique name must appear in neither.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from timeouts import SUBPROCESS_TIMEOUT_S

from tangram_launch.checkpoint import store

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = str(REPO / "examples" / "train_gpt.py")

_SHIM = '''\
import os, sys
_path = os.environ.get("TANGRAM_TEST_OPEN_LOG")
if _path:
    _fd = os.open(f"{_path}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _hook(event, args, _fd=_fd):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            os.write(_fd, os.fsencode(args[0]) + b"\\n")

    sys.addaudithook(_hook)
'''


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1", TANGRAM_CACHE_DIR=str(tmp_path / "cache"))
    return env


def _launch(tmp_path: Path, log: Path, *args: str) -> subprocess.CompletedProcess:
    """``tangram-launch ARGS`` with every open of every process recorded under ``log``."""
    env = _env(tmp_path)
    cmd = [sys.executable, "-m", "tangram_launch.cli", "--standalone", *args]
    if shutil.which("strace"):
        cmd = ["strace", "-f", "-y", "-qq", "-e", "trace=open,openat,openat2", "-o", str(log), *cmd]
    else:
        shim = tmp_path / "shim"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(_SHIM)
        env["PYTHONPATH"] = os.pathsep.join([str(shim), str(REPO), env.get("PYTHONPATH", "")])
        env["TANGRAM_TEST_OPEN_LOG"] = str(log)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def _opened(log: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in log.parent.glob(log.name + "*"))


def _rehash(ckpt: Path, rel: str) -> None:
    manifest = json.loads((ckpt / store.MANIFEST).read_text())
    data = (ckpt / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / store.MANIFEST).write_text(json.dumps(manifest))


def _edit_manifest(ckpt: Path, rel: str) -> None:
    manifest = json.loads((ckpt / store.MANIFEST).read_text())
    manifest["files"][rel] = {"sha256": "0" * 64, "bytes": 6}
    (ckpt / store.MANIFEST).write_text(json.dumps(manifest))


def _craft(ckpt: Path, how: str, outside: Path) -> str:
    """Point checkpoint ``ckpt`` at ``outside``; returns what the refusal must name."""
    if how == "dotdot":
        _edit_manifest(ckpt, os.path.relpath(outside, ckpt))
        return "manifest.json"
    if how == "absolute":
        _edit_manifest(ckpt, str(outside))
        return "manifest.json"
    if how == "symlink":
        outside.write_text((ckpt / store.POSITION_FILE).read_text().replace('"step": 2', '"step": 1'))
        (ckpt / store.POSITION_FILE).unlink()
        (ckpt / store.POSITION_FILE).symlink_to(outside)
        _rehash(ckpt, store.POSITION_FILE)
        return "position.json"
    with open(ckpt / "state" / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, trusted here
    for info in metadata.storage_data.values():
        info.relative_path = os.path.relpath(outside, ckpt / "state")
    (ckpt / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(ckpt, "state/.metadata")
    return ".metadata"


_WORKER = """\
import json, sys
import torch
import torch.distributed as dist
from runtime_adapters.gpt import StageModule
from tangram_launch.checkpoint import LayerKeyMap, StageState, TrainingPosition, load_checkpoint, save_checkpoint
from tangram_launch.errors import SpecError
from tangram_launch.plan import Plan
from tangram_launch.specs.model import ModelSpec

with open(sys.argv[1]) as f:
    plan = Plan.from_dict(json.load(f))
dist.init_process_group("gloo")
stage = plan.place(dist.get_rank()).stage
module = StageModule(ModelSpec.from_dict(plan.model), tuple(stage.layers), has_embedding=stage.has_embedding,
                     has_head=stage.has_head, seed=0)
opt = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=False)
state = StageState.from_module(module, LayerKeyMap.for_stage(stage, local_numbering="global"), opt)
code = 0
if sys.argv[2] == "save":
    sum(p.square().sum() for p in module.parameters()).backward()
    opt.step()
    save_checkpoint(sys.argv[3], plan=plan, state=state, position=TrainingPosition(2, 16))
for directory in sys.argv[3:] if sys.argv[2] == "load" else ():
    try:
        load_checkpoint(directory, plan=plan, state=state)
        print(f"LOADED {directory}", file=sys.stderr)
        code = 1
    except SpecError as exc:
        print(f"REFUSED {directory}: {exc}", file=sys.stderr)
        code = code or 2
dist.barrier()
dist.destroy_process_group()
sys.exit(code)
"""


@pytest.mark.distributed
def test_resume_of_crafted_checkpoints_opens_nothing_outside_and_is_refused_naming_the_file(tmp_path):
    from helpers_plans import make_plan

    plan = tmp_path / "plan.json"
    make_plan("tiny", [(3, "local"), (1, "local")], global_batch=8, num_microbatches=4, seq_len=32).dump(str(plan))
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    good = tmp_path / "good"
    first = _launch(tmp_path, tmp_path / "first.log", "--nproc-per-node", "2", "--plan", str(plan), str(worker),
                    str(plan), "save", str(good))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step_2" in _opened(tmp_path / "first.log")  # the recording sees the checkpoint's files

    crafted: dict[str, tuple[Path, str, Path]] = {}
    for how in ("dotdot", "absolute", "symlink", "dcp"):
        outside = tmp_path / f"outside-{uuid.uuid4().hex}"
        outside.write_bytes(b"secret")
        ckpt_dir = tmp_path / how
        shutil.copytree(good, ckpt_dir, ignore=shutil.ignore_patterns(".tangram-lock"))
        crafted[how] = (ckpt_dir, _craft(ckpt_dir / "step_2", how, outside), outside)

    def check(proc: subprocess.CompletedProcess, log: Path, hows: list[str], what: str) -> None:
        assert "Traceback" not in proc.stderr, (what, proc.stderr[-3000:])
        opened = _opened(log)
        for how in hows:
            ckpt_dir, names, outside = crafted[how]
            lines = [ln for ln in proc.stderr.splitlines() if str(ckpt_dir) in ln]
            assert any(names in ln for ln in lines), (what, how, proc.stderr[-3000:])
            assert str(ckpt_dir / "step_2") in opened, (what, how)  # the checkpoint itself was read
            assert outside.name not in opened, (what, how, [ln for ln in opened.splitlines() if outside.name in ln])

    for how, (ckpt_dir, _, _) in crafted.items():  # the launcher refuses before any worker starts
        log = tmp_path / f"launcher-{how}.log"
        proc = _launch(tmp_path, log, "--nproc-per-node", "2", "--plan", str(plan), "--resume", str(ckpt_dir),
                       str(worker), str(plan), "none")
        assert proc.returncode == 2, (how, proc.stderr[-3000:])
        check(proc, log, [how], "the launcher")

    log = tmp_path / "workers.log"  # only the workers see them: each rank loads each crafted checkpoint
    proc = _launch(tmp_path, log, "--nproc-per-node", "2", "--plan", str(plan), str(worker), str(plan), "load",
                   *(str(d) for d, _, _ in crafted.values()))
    assert proc.returncode != 0 and "LOADED" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("REFUSED") == 2 * len(crafted), proc.stderr[-3000:]
    check(proc, log, list(crafted), "the workers")
