"""A checkpoint never runs code on resume, and the launcher picks the checkpoint the workers will load.

Tampering is done the way an attacker with write access to the directory would: replace ``state/.metadata`` with
a pickle that creates a marker file when unpickled, then rewrite the manifest's size and sha256 so the
checkpoint verifies. The payload is first shown to work with plain ``pickle.loads`` (so the tests can fail).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tangram_launch.checkpoint import store
from tangram_launch.checkpoint import TrainingPosition, load_checkpoint, save_checkpoint
from tangram_launch.errors import SpecError
from tangram_launch.checkpoint.safe_load import UnsafeCheckpointError, check_dcp_directory, loads_metadata
from test_checkpoint import BATCH, plan_of, train, whole_state

REPO = Path(__file__).resolve().parent.parent


class _Payload:
    """Unpickling this opens (creates) ``path``: what a planted pickle could do with os.system instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _rehash(ckpt: Path, rel: str) -> None:
    """Make the manifest agree with the (tampered) file, as an attacker would."""
    manifest_path = ckpt / store.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    data = (ckpt / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest_path.write_text(json.dumps(manifest))


def _saved(tmp_path: Path, steps=(1,)) -> tuple:
    plan = plan_of([(4, 1)])
    module, opt, state = whole_state(plan)
    for step in steps:
        train(module, opt, [step])
        save_checkpoint(tmp_path / "ckpt", plan=plan, state=state, position=TrainingPosition(step, step * BATCH),
                        keep_last=None)
    return plan, state


def _plant(ckpt: Path, marker: Path) -> None:
    evil = pickle.dumps(_Payload(str(marker)))
    probe = marker.with_name("probe")
    pickle.loads(pickle.dumps(_Payload(str(probe))))  # the payload works with a plain unpickler
    assert probe.exists()
    probe.unlink()
    (ckpt / "state" / ".metadata").write_bytes(evil)
    _rehash(ckpt, "state/.metadata")


def test_tampered_metadata_is_refused_in_process_without_running_it(tmp_path):
    plan, state = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _plant(tmp_path / "ckpt" / "step_1", marker)
    assert store.find_latest(str(tmp_path / "ckpt")).step == 1  # the manifest is consistent: it verifies
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load (io|builtins)\.open"):
        load_checkpoint(tmp_path / "ckpt", plan=plan, state=state)
    assert not marker.exists()


@pytest.mark.distributed
def test_tampered_checkpoint_exits_2_at_launch_and_no_worker_runs(tmp_path):
    plan, _ = _saved(tmp_path)
    plan_path = tmp_path / "plan.json"
    plan.dump(str(plan_path))
    marker, ran = tmp_path / "pwned", tmp_path / "worker-ran"
    _plant(tmp_path / "ckpt" / "step_1", marker)
    script = tmp_path / "worker.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_", "TANGRAM_"))}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tangram_launch.cli", "--standalone", "--nproc-per-node", "1",
                           "--plan", str(plan_path), "--resume", str(tmp_path / "ckpt"), str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "refusing to load io.open" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists() and not ran.exists()


def test_metadata_with_a_byte_entry_or_a_foreign_class_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    plan, state = _saved(tmp_path)
    ckpt = tmp_path / "ckpt" / "step_1"
    meta_path = ckpt / "state" / ".metadata"
    with open(meta_path, "rb") as f:
        metadata = pickle.load(f)  # our own file, trusted here
    key = next(iter(metadata.state_dict_metadata))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()  # would be read with torch.load(weights_only=False)
    meta_path.write_bytes(pickle.dumps(metadata))
    _rehash(ckpt, "state/.metadata")
    with pytest.raises(UnsafeCheckpointError, match="BytesStorageMetadata"):
        load_checkpoint(tmp_path / "ckpt", plan=plan, state=state)
    marker = tmp_path / "m2"
    for evil in (pickle.dumps(_Payload(str(marker)), protocol=2), b"cos\nsystem\n(S'true'\ntR.",
                 b"\x80\x02c__builtin__\neval\n.", b"\x80\x04\x95\x05"):
        with pytest.raises(UnsafeCheckpointError):
            loads_metadata(evil, source="x")
    assert not marker.exists()


def test_untampered_checkpoints_still_load_through_the_safe_reader(tmp_path):
    plan, state = _saved(tmp_path, steps=(1, 2))
    check_dcp_directory(str(tmp_path / "ckpt" / "step_2" / "state"))
    _, _, s2 = whole_state(plan, seed=3)
    loaded = load_checkpoint(tmp_path / "ckpt", plan=plan, state=s2)
    assert loaded.step == 2
    for k, t in state.model.items():
        assert torch.equal(t, s2.model[k]), k


def _enums_by_getattr(obj, target=None) -> bytes:
    """``obj`` pickled as some Python builds write it (Debian's 3.11.2): enum members as getattr(EnumClass, name).
    ``target``: instead, every enum member becomes getattr(target[0], target[1]), as a planted pickle would."""
    import enum

    class Pickler(pickle.Pickler):
        def reducer_override(self, o):
            if isinstance(o, enum.Enum):
                return (getattr, target if target is not None else (type(o), o.name))
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=4).dump(obj)
    return buf.getvalue()


def _small_metadata():
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    size = torch.Size([2, 3])
    entry = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=size,
                                  chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size)])
    return Metadata(state_dict_metadata={"w": entry})


def test_enum_members_pickled_by_getattr_load_and_nothing_else_does():
    """Metadata whose enum members were pickled as getattr(EnumClass, name) reads back; a getattr that reaches
    anything but an enum member (a method of an allowed class) is refused."""
    data = _enums_by_getattr(_small_metadata())
    assert b"getattr" in data
    back = loads_metadata(data, source="debian-3.11.2")
    assert back.state_dict_metadata["w"].properties.memory_format == torch.contiguous_format
    for target in [(Path, "home"), (torch.Size, "__reduce__"), (torch.Size, "count")]:
        evil = _enums_by_getattr(_small_metadata(), target=target)
        with pytest.raises(UnsafeCheckpointError) as err:
            loads_metadata(evil, source="planted/.metadata")
        assert "getattr" in str(err.value) and "planted/.metadata" in str(err.value)
