"""A checkpoint is input: nothing outside its directory is opened, and every crafted file or field is refused with a
SpecError (exit status 2) naming the file and the field, never a traceback, a hang or an unbounded read.

Crafting is done as an attacker with write access to the directory would: change a file, then rewrite the
manifest's size and sha256 so that the checkpoint verifies. What is opened is recorded by an audit hook on ``open``
(builtins and ``os.open``) in this process; every target outside the checkpoint has a unique name that must never
appear in what was opened.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import signal
import sys
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram_launch.checkpoint import TrainingPosition, load_checkpoint, save_checkpoint, store
from tangram_launch.checkpoint import confined
from tangram_launch.checkpoint.dcp_metadata import UnsafeCheckpointError, loads_metadata
from tangram_launch.errors import SpecError
from test_checkpoint import BATCH, plan_of, train, whole_state

_OPENED: list[list[str]] = []  # the lists the audit hook appends to while a test records


def _hook(event: str, args: tuple) -> None:
    if event == "open" and _OPENED and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED[-1].append(os.fsdecode(args[0]))


sys.addaudithook(_hook)  # an audit hook cannot be removed; it records only inside ``opened()``


@contextlib.contextmanager
def opened() -> Iterator[list[str]]:
    """Every path (or name under a directory descriptor) this process opens inside the block."""
    paths: list[str] = []
    _OPENED.append(paths)
    try:
        yield paths
    finally:
        _OPENED.remove(paths)


@contextlib.contextmanager
def no_hang(seconds: int = 20) -> Iterator[None]:
    """Fail instead of blocking forever (a FIFO opened for reading without O_NONBLOCK would)."""
    def fail(*_):
        raise AssertionError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def rehash(ckpt: Path, rel: str) -> None:
    """Make the manifest agree with a changed file, as an attacker would."""
    manifest = json.loads((ckpt / store.MANIFEST).read_text())
    data = (ckpt / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / store.MANIFEST).write_text(json.dumps(manifest))


PLAN = plan_of([(4, 1)])  # a frozen Plan, shared by the tests


def edit_json(ckpt: Path, rel: str, change: Callable[[dict], None]) -> None:
    data = json.loads((ckpt / rel).read_text())
    change(data)
    (ckpt / rel).write_text(json.dumps(data))
    if rel != store.MANIFEST:
        rehash(ckpt, rel)


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory) -> Path:
    """A checkpoint directory after one training step, saved once: each test edits its own copy (``saved``)."""
    ckpt_dir = tmp_path_factory.mktemp("confined") / "ckpt"
    module, opt, state = whole_state(PLAN)
    train(module, opt, [1])
    save_checkpoint(ckpt_dir, plan=PLAN, state=state, position=TrainingPosition(1, BATCH), keep_last=None)
    return ckpt_dir


@pytest.fixture
def saved(saved_once, tmp_path):
    """(plan, a fresh state to load into, the checkpoint directory, step_1/) after one training step: a copy of
    the module's saved checkpoint, so a test's edits stay its own."""
    shutil.copytree(saved_once, tmp_path / "ckpt", symlinks=True)
    _, _, fresh = whole_state(PLAN, seed=3)
    return PLAN, fresh, tmp_path / "ckpt", tmp_path / "ckpt" / "step_1"


@pytest.fixture
def outside(tmp_path):
    """A file outside the checkpoint, uniquely named, that nothing may open."""
    path = tmp_path / f"outside-{uuid.uuid4().hex}"
    path.write_bytes(b"secret" * 100)
    return path


def assert_not_opened(paths: list[str], target: Path) -> None:
    assert not [p for p in paths if target.name in p], f"{target} was opened"


# --- the confined layer ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../x", "a\x00b", "", "a//b", "./a", "a/.", "a\\..\\b",
                                 "state/..", 7, None])
def test_paths_that_leave_or_reenter_the_directory_are_refused(tmp_path, rel):
    with pytest.raises(confined.CheckpointFileError) as err:
        confined.parts_of(rel, root=str(tmp_path), field="files")
    assert "files" in str(err.value)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(["a", "b", ".", "/", "\\", "\x00", "\x01", "\n", " ", "é"]), max_size=12))
def test_any_accepted_path_stays_inside_its_directory(rel):
    root = "/r/ckpt"
    try:
        parts = confined.parts_of(rel, root=root)
    except confined.CheckpointFileError:
        return
    assert os.path.normpath(os.path.join(root, *parts)).startswith(root + "/")


def test_a_symlink_is_never_followed_in_the_file_or_a_parent(tmp_path, outside):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "link").symlink_to(outside)
    (tmp_path / "dirlink").symlink_to(tmp_path / "d")
    with opened() as paths:
        for rel in ("d/link", "dirlink/link"):
            with pytest.raises(confined.CheckpointFileError, match="symbolic link"):
                confined.read_bytes(str(tmp_path), rel, max_bytes=1 << 20)
    assert_not_opened(paths, outside)


def test_a_fifo_or_device_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with no_hang():
        with pytest.raises(confined.CheckpointFileError, match="FIFO"):
            confined.read_bytes(str(tmp_path), "fifo", max_bytes=10)
        with pytest.raises(confined.CheckpointFileError, match="character device"):
            confined.read_bytes("/dev", "zero", max_bytes=10)


def test_sizes_are_checked_before_reading_and_a_hash_reads_at_most_the_declared_size(tmp_path):
    big = tmp_path / "sparse"
    with open(big, "wb") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse
    with no_hang(10):
        with pytest.raises(confined.CheckpointFileError, match="manifest says 100"):
            confined.sha256(str(tmp_path), "sparse", size_bytes=100)
        with pytest.raises(confined.CheckpointFileError, match="more than the"):
            confined.read_json(str(tmp_path), "sparse")
    (tmp_path / "f").write_bytes(b"abc")
    assert confined.sha256(str(tmp_path), "f", size_bytes=3) == hashlib.sha256(b"abc").hexdigest()


@pytest.mark.parametrize("text, why", [
    ("{\"a\": " + "9" * 5000 + "}", "digits"),
    ("[" * 100_000 + "]" * 100_000, "deep"),
    ("[" * 65 + "]" * 65, "deep"),
    ("{\"a\": NaN}", "NaN"),
    ("{\"a\": 1e400}", "float"),
    ("{\"a\": \"\x01\"}", "control character"),
    ("\x00{}", "JSON"),
])
def test_json_with_huge_numbers_deep_nesting_or_control_characters_is_refused(tmp_path, text, why):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(confined.CheckpointFileError, match=why) as err:
        confined.read_json(str(tmp_path), "x.json")
    assert "x.json" in str(err.value)


def test_written_files_honour_the_umask_and_never_replace_a_link(tmp_path, outside):
    confined.write_json(str(tmp_path), "a/b.json", {"x": 1})
    assert (tmp_path / "a" / "b.json").stat().st_mode & 0o777 == 0o666 & ~confined.umask()
    (tmp_path / "a" / "c.json").symlink_to(outside)
    with pytest.raises(FileExistsError):
        confined.write_json(str(tmp_path), "a/c.json", {"x": 1})
    assert outside.read_bytes().startswith(b"secret")


# --- manifests that reach outside ----------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_manifest_entry_outside_the_directory_is_never_opened(saved, outside, how):
    plan, state, ckpt_dir, ckpt = saved
    rel = os.path.relpath(outside, ckpt) if how == "dotdot" else str(outside)
    edit_json(ckpt, store.MANIFEST, lambda m: m["files"].__setitem__(rel, {"sha256": "0" * 64, "bytes": 1}))
    with opened() as paths:
        with pytest.raises(SpecError) as err:
            load_checkpoint(ckpt_dir, plan=plan, state=state)
        with pytest.raises(SpecError):
            store.describe(str(ckpt_dir), checksums=True)
    assert_not_opened(paths, outside)
    assert "manifest.json" in str(err.value) and "files[" in str(err.value)
    assert "600 bytes" not in str(err.value)  # the outside file's size is not revealed


def test_symlinked_files_and_directories_in_a_checkpoint_are_refused(saved, tmp_path, outside):
    plan, state, ckpt_dir, ckpt = saved
    other = tmp_path / "pos.json"
    other.write_text(json.dumps({"step": 77, "consumed_samples": 0}))
    (ckpt / store.POSITION_FILE).unlink()
    (ckpt / store.POSITION_FILE).symlink_to(other)
    rehash(ckpt, store.POSITION_FILE)  # an attacker's manifest agrees with the link's target
    with pytest.raises(SpecError, match="symbolic link") as err:
        store.describe(str(ckpt_dir), checksums=False)
    assert "position.json" in str(err.value)

    (ckpt / store.POSITION_FILE).unlink()
    (ckpt / store.POSITION_FILE).write_text(other.read_text())
    rehash(ckpt, store.POSITION_FILE)
    (ckpt / "step_9").symlink_to(ckpt)  # a newer step that is a link is not followed
    assert store.describe(str(ckpt_dir)).step == 1


def test_a_manifest_that_is_a_fifo_or_dev_zero_is_refused_without_blocking(saved):
    plan, state, ckpt_dir, ckpt = saved
    (ckpt / store.MANIFEST).unlink()
    os.mkfifo(ckpt / store.MANIFEST)
    with no_hang():
        with pytest.raises(SpecError, match="FIFO"):
            store.describe(str(ckpt_dir))
    (ckpt / store.MANIFEST).unlink()
    (ckpt / store.MANIFEST).symlink_to("/dev/zero")
    with no_hang():
        with pytest.raises(SpecError, match="symbolic link"):
            load_checkpoint(ckpt_dir, plan=plan, state=state)


def test_a_huge_sparse_file_listed_with_a_small_size_is_not_read(saved):
    plan, state, ckpt_dir, ckpt = saved
    with open(ckpt / store.PLAN_FILE, "r+b") as f:
        f.truncate(1 << 40)
    with no_hang(10):
        with pytest.raises(SpecError, match="plan.json"):
            store.describe(str(ckpt_dir), checksums=True)


# --- crafted fields ------------------------------------------------------------------------------------------

def _set(path: list, value):
    def change(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return change


def _first_optim(m):
    return next(iter(m["optimizer"]))


CRAFTED = {
    # manifest: huge, negative, string optimizer shapes; bad model shapes and sizes
    "optimizer shape huge": (store.MANIFEST, lambda m: m["optimizer"][_first_optim(m)]["exp_avg"].__setitem__(
        "shape", [4_000_000_000_000_000_000]), "shape"),
    "optimizer shape negative": (store.MANIFEST, lambda m: m["optimizer"][_first_optim(m)]["exp_avg"].__setitem__(
        "shape", [-1]), "shape"),
    "optimizer shape string": (store.MANIFEST, lambda m: m["optimizer"][_first_optim(m)]["exp_avg"].__setitem__(
        "shape", "abc"), "shape"),
    "optimizer shape of another parameter": (store.MANIFEST, lambda m: m["optimizer"][_first_optim(m)][
        "exp_avg"].__setitem__("shape", [3, 5]), "neither its parameter's"),
    "model dtype": (store.MANIFEST, lambda m: m["model"][next(iter(m["model"]))].__setitem__("dtype", "os.system"),
                    "dtype"),
    "file size negative": (store.MANIFEST, lambda m: m["files"][store.PLAN_FILE].__setitem__("bytes", -5), "bytes"),
    "step huge": (store.MANIFEST, _set(["step"], 10 ** 25), "step"),
    # position
    "consumed_samples 1e25": (store.POSITION_FILE, _set(["consumed_samples"], 1e25), "position.consumed_samples"),
    "consumed_samples 10**25": (store.POSITION_FILE, _set(["consumed_samples"], 10 ** 25),
                                "position.consumed_samples"),
    "step string": (store.POSITION_FILE, _set(["step"], "3"), "position.step"),
    "data not an object": (store.POSITION_FILE, _set(["data"], ["ab"]), "position.data"),
    # RNG
    "rng torch not base64": ("rng/rank_0.json", _set(["torch"], "!!!"), "rng.torch"),
    "rng torch short": ("rng/rank_0.json", _set(["torch"], "AAAA"), "rng.torch"),
    "rng python state short": ("rng/rank_0.json", lambda r: r["python"].__setitem__("state", [1, 2, 3]),
                               "rng.python.state"),
    "rng numpy pos": ("rng/rank_0.json", lambda r: r["numpy"].__setitem__("pos", 10 ** 9), "rng.numpy.pos"),
    # optimizer hyper-parameters
    "lr abc": (store.OPTIMIZER_FILE, lambda o: o[next(iter(o))]["hparams"].__setitem__("lr", "abc"), "hparams.lr"),
    "lr negative": (store.OPTIMIZER_FILE, lambda o: o[next(iter(o))]["hparams"].__setitem__("lr", -1.0),
                    "hparams.lr"),
    "betas out of range": (store.OPTIMIZER_FILE, lambda o: o[next(iter(o))]["hparams"].__setitem__("betas", [2, 0]),
                           "hparams.betas[0]"),
    "optimizer entry not an object": (store.OPTIMIZER_FILE, lambda o: o.__setitem__(next(iter(o)), 5), "5"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_each_crafted_field_is_refused_naming_the_file_and_the_field(saved, case):
    plan, state, ckpt_dir, ckpt = saved
    rel, change, field = CRAFTED[case]
    edit_json(ckpt, rel, change)
    before = {k: t.clone() for k, t in state.model.items()}
    with pytest.raises(SpecError) as err:
        load_checkpoint(ckpt_dir, plan=plan, state=state)
    text = str(err.value)
    assert os.path.basename(rel) in text and field in text, text
    for k, t in state.model.items():  # refused before anything was loaded
        assert torch.equal(t, before[k]), k


def _metadata(ckpt: Path):
    with open(ckpt / "state" / ".metadata", "rb") as f:
        return pickle.load(f)  # our own file, trusted here


def _write_metadata(ckpt: Path, metadata) -> None:
    (ckpt / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    rehash(ckpt, "state/.metadata")


def test_metadata_shapes_that_disagree_with_the_manifest_are_refused(saved):
    plan, state, ckpt_dir, ckpt = saved
    metadata = _metadata(ckpt)
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    entry = metadata.state_dict_metadata[key]
    entry.size = torch.Size([entry.size[0] + 1, *entry.size[1:]])
    _write_metadata(ckpt, metadata)
    with pytest.raises(UnsafeCheckpointError, match="disagrees with its manifest") as err:
        load_checkpoint(ckpt_dir, plan=plan, state=state)
    assert ".metadata" in str(err.value) and key in str(err.value)


def test_chunks_that_leave_part_of_a_tensor_unloaded_are_refused(saved):
    plan, state, ckpt_dir, ckpt = saved
    metadata = _metadata(ckpt)
    key = next(k for k, e in metadata.state_dict_metadata.items() if k.startswith("model.") and len(e.size) == 2)
    chunk = metadata.state_dict_metadata[key].chunks[0]
    chunk.sizes = torch.Size([1, *chunk.sizes[1:]])
    _write_metadata(ckpt, metadata)
    with pytest.raises(UnsafeCheckpointError, match="cover the tensor exactly once"):
        load_checkpoint(ckpt_dir, plan=plan, state=state)


def test_a_truncated_shard_with_its_manifest_updated_is_refused(saved):
    plan, state, ckpt_dir, ckpt = saved
    shard = next((ckpt / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    rehash(ckpt, f"state/{shard.name}")
    with pytest.raises(UnsafeCheckpointError, match="truncated or altered shard") as err:
        load_checkpoint(ckpt_dir, plan=plan, state=state)
    assert shard.name in str(err.value)


def test_shard_bytes_altered_to_match_nothing_are_refused_not_a_traceback(saved):
    plan, state, ckpt_dir, ckpt = saved
    shard = next((ckpt / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[: len(data) // 2] = b"\x00" * (len(data) // 2)
    shard.write_bytes(bytes(data))
    rehash(ckpt, f"state/{shard.name}")
    with pytest.raises(SpecError, match="cannot read the checkpoint's tensors"):
        load_checkpoint(ckpt_dir, plan=plan, state=state)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "unlisted"])
def test_a_dcp_relative_path_outside_the_directory_is_never_opened(saved, outside, how):
    plan, state, ckpt_dir, ckpt = saved
    metadata = _metadata(ckpt)
    shard = next((ckpt / "state").glob("*.distcp"))
    if how == "dotdot":
        target = os.path.relpath(outside, ckpt / "state")
    elif how == "absolute":
        target = str(outside)
    elif how == "symlink":
        (ckpt / "state" / "link.distcp").symlink_to(outside)
        target = "link.distcp"
    else:  # a real file of the directory that the manifest does not list (never verified)
        (ckpt / "state" / "extra.distcp").write_bytes(shard.read_bytes())
        target = "extra.distcp"
    for info in metadata.storage_data.values():
        info.relative_path = target
    _write_metadata(ckpt, metadata)
    with opened() as paths:
        with pytest.raises(SpecError) as err:
            load_checkpoint(ckpt_dir, plan=plan, state=state)
    assert_not_opened(paths, outside)
    assert ".metadata" in str(err.value) and "relative_path" in str(err.value)


# --- the metadata reader ------------------------------------------------------------------------------------

class _Probe:
    """A throwaway class: shows that a plain unpickler sets class attributes from a pickle."""


def test_metadata_cannot_set_attributes_on_any_class(saved):
    def build_onto(module: str, name: str) -> bytes:  # GLOBAL module.name; BUILD (None, {"tangram_probe": 1})
        return f"c{module}\n{name}\n(N(dVtangram_probe\nI1\nstb.".encode()

    pickle.loads(build_onto(__name__, "_Probe"))  # the payload works with a plain unpickler
    assert _Probe.tangram_probe == 1
    import pathlib

    for module, name in (("pathlib", "PurePosixPath"), ("torch.distributed.checkpoint.metadata", "Metadata"),
                         ("torch", "Size"), ("collections", "OrderedDict")):
        with pytest.raises(UnsafeCheckpointError, match="BUILD"):
            loads_metadata(build_onto(module, name), source="planted/.metadata")
    assert not hasattr(pathlib.PurePosixPath, "tangram_probe")
    _, _, _, ckpt = saved
    back = loads_metadata((ckpt / "state" / ".metadata").read_bytes(), source="ok")
    assert back.state_dict_metadata == _metadata(ckpt).state_dict_metadata


def test_metadata_objects_are_built_only_from_fields_of_the_right_type(saved):
    _, _, _, ckpt = saved
    metadata = _metadata(ckpt)
    next(iter(metadata.storage_data.values())).offset = "0"
    with pytest.raises(UnsafeCheckpointError, match="_StorageInfo.offset"):
        loads_metadata(pickle.dumps(metadata), source="x")
    metadata = _metadata(ckpt)
    next(e for k, e in metadata.state_dict_metadata.items() if k.startswith("model.")).chunks = "x"
    with pytest.raises(UnsafeCheckpointError, match="chunks"):
        loads_metadata(pickle.dumps(metadata), source="x")


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_damage_to_metadata_bytes_is_refused_cleanly(data):
    good = pickle.dumps(_metadata_template())
    pos = data.draw(st.integers(0, len(good) - 1))
    byte = data.draw(st.integers(0, 255))
    damaged = good[:pos] + bytes([byte]) + good[pos + 1:]
    try:
        loads_metadata(damaged, source="fuzz")
    except UnsafeCheckpointError:
        pass


def _metadata_template():
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    size = torch.Size([2, 3])
    entry = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=size,
                                  chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size)])
    return Metadata(state_dict_metadata={"w": entry},
                    storage_data={MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 10)})


# --- fuzz: control characters and NUL bytes in the JSON files -------------------------------------------------

_CONTROL = st.sampled_from([chr(c) for c in range(32)] + ["\x7f", "\\u0000", "\"", "{", "[", "9" * 40])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([store.MANIFEST, store.POSITION_FILE]), st.lists(st.tuples(st.integers(0, 10_000), _CONTROL),
                                                                         min_size=1, max_size=4))
def test_control_characters_and_nul_bytes_in_manifest_or_position_are_refused_cleanly(tmp_path_factory, rel,
                                                                                       edits):
    root = tmp_path_factory.mktemp("fuzz")
    position = {"step": 1, "consumed_samples": 4, "data": {"seed": 1}, "extra": {}}
    manifest = {"format": store.FORMAT, "version": store.FORMAT_VERSION, "step": 1, "files": {
        store.POSITION_FILE: {"sha256": "0" * 64, "bytes": 1}}, "model": {"a.w": {"shape": [2], "dtype": "float32"}}}
    text = json.dumps(manifest if rel == store.MANIFEST else position)
    for at, insert in edits:
        at %= len(text) + 1
        text = text[:at] + insert + text[at:]
    (root / rel).write_text(text)
    try:
        if rel == store.MANIFEST:
            store.read_manifest(str(root))
        else:
            store.read_position(str(root))
    except SpecError as exc:
        assert rel in str(exc)


# --- export --------------------------------------------------------------------------------------------------

EXPORT_CASES = {
    "manifest entry outside": lambda ckpt, outside: edit_json(
        ckpt, store.MANIFEST, lambda m: m["files"].__setitem__("../../" + outside.name, {"sha256": "0" * 64,
                                                                                          "bytes": 1})),
    "shape string": lambda ckpt, outside: edit_json(
        ckpt, store.MANIFEST, lambda m: m["model"][next(iter(m["model"]))].__setitem__("shape", "abc")),
    "consumed_samples 1e25": lambda ckpt, outside: edit_json(ckpt, store.POSITION_FILE,
                                                             _set(["consumed_samples"], 1e25)),
    "deep position": lambda ckpt, outside: ((ckpt / store.POSITION_FILE).write_text("[" * 100_000 + "]" * 100_000),
                                            rehash(ckpt, store.POSITION_FILE)),
    "truncated shard": lambda ckpt, outside: [
        (s.write_bytes(s.read_bytes()[:10]), rehash(ckpt, f"state/{s.name}")) for s in (ckpt / "state").glob("*.distcp")],
    "fifo manifest": lambda ckpt, outside: ((ckpt / store.MANIFEST).unlink(), os.mkfifo(ckpt / store.MANIFEST)),
}


@pytest.mark.parametrize("case", sorted(EXPORT_CASES))
def test_export_refuses_each_crafted_checkpoint_with_exit_2(saved, outside, tmp_path, capsys, case):
    from tangram_launch.cli import main

    _, _, ckpt_dir, ckpt = saved
    EXPORT_CASES[case](ckpt, outside)
    with opened() as paths, no_hang():
        code = main(["export", str(ckpt_dir), "--to", "hf", str(tmp_path / "out"), "--config", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "step_1" in err
    assert_not_opened(paths, outside)
    assert not (tmp_path / "out").exists()


# --- Hugging Face files: safetensors in, safetensors out ------------------------------------------------------

TINY_LLAMA = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny-llama"


@pytest.mark.parametrize("damage", ["truncated", "malformed header"])
def test_truncated_or_malformed_safetensors_weights_are_refused_naming_the_file(tmp_path, damage):
    transformers = pytest.importorskip("transformers")
    from runtime_adapters.hf_model import HFSource, load_config
    from tangram_launch.plan import Stage

    transformers.AutoModelForCausalLM.from_config(load_config(TINY_LLAMA)).save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x10\x00\x00\x00\x00\x00\x00\x00{[[[")
    source = HFSource.from_pretrained(tmp_path / "m")
    stage = Stage(index=0, layers=(0, 1), island="i", gpus=(("n0", 0),), micro_batch_size=1, has_embedding=True,
                  has_head=False)
    with pytest.raises(SpecError, match="not a readable safetensors file") as err:
        source.build_stage(None, stage, 0)
    assert "model.safetensors" in str(err.value)


def test_export_writes_files_with_the_mode_the_umask_gives(tmp_path, capsys):
    pytest.importorskip("transformers")
    from helpers_plans import make_plan
    from runtime_adapters.hf_model import HFSource
    from tangram_launch.checkpoint import LayerKeyMap, StageState
    from tangram_launch.cli import main

    source = HFSource.from_pretrained(TINY_LLAMA)
    plan = make_plan(source.model_spec(), [(4, "n0")], global_batch=2, num_microbatches=1, seq_len=8)
    module = source.build_stage(None, plan.stages[0], 0)
    state = StageState.from_module(module, LayerKeyMap.for_stage(plan.stages[0], local_numbering="global"))
    old = os.umask(0o022)
    try:
        save_checkpoint(tmp_path / "ckpt", plan=plan, state=state, position=TrainingPosition(1, 2))
        assert main(["export", str(tmp_path / "ckpt"), "--to", "hf", str(tmp_path / "out"),
                     "--config", str(TINY_LLAMA)]) == 0, capsys.readouterr().err
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o644, name
    for path in (tmp_path / "ckpt" / "step_1").rglob("*"):
        if path.is_file():
            assert path.stat().st_mode & 0o044 == 0o044, path  # readable by group and others, as the umask allows


def test_megatron_optimizer_groups_with_crafted_hyperparameters_are_refused():
    from runtime_adapters.megatron_checkpoint import _load_torch_optimizer

    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    group = {k: v for k, v in opt.state_dict()["param_groups"][0].items()}
    for key, value in (("lr", "abc"), ("lr", float("nan")), ("betas", (0.9,)), ("eps", torch.tensor(-1.0))):
        with pytest.raises(SpecError) as err:
            _load_torch_optimizer(opt, {"state": {}, "param_groups": [dict(group, **{key: value})]}, True,
                                  source="ckpt/step_1/megatron")
        assert "ckpt/step_1/megatron" in str(err.value) and f"param_groups[0].{key}" in str(err.value)
    _load_torch_optimizer(opt, {"state": {}, "param_groups": [dict(group, lr=torch.tensor(0.5))]}, True)
    assert float(opt.param_groups[0]["lr"]) == 0.5
