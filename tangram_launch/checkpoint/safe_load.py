"""Reading torch DCP checkpoints without running code from them or reading outside their directory.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load``, opens every ``relative_path`` the
metadata names under its directory with ``Path.open`` (``../x`` and ``/etc/passwd`` included, links followed), and
the default load planner reads byte entries with ``torch.load(weights_only=False)``. The manifest's checksums do not
help against a planted file: the manifest is plain JSON, rewritten by whoever plants one. So:

* ``.metadata`` is read as data by :mod:`tangram_launch.checkpoint.dcp_metadata` (a pickle interpreter of ours
  that builds only plain data and fresh DCP metadata objects), through the confined file layer, size-capped;
* :func:`check_dcp_directory` checks every storage entry before DCP opens anything: its ``relative_path`` is one
  file name inside the directory, a regular file listed in the manifest (so its size and sha256 were verified), and
  ``offset + length`` lies within it; with a request (:func:`check_request`), every tensor asked for is in the
  metadata with the same shape and dtype and its chunks cover it exactly once;
* :func:`safe_reader` is DCP's FileSystemReader whose file system opens through :mod:`~tangram_launch.checkpoint.
  confined` (no links, regular files only, nothing outside the directory) and whose metadata comes from above;
* the result must be a ``Metadata`` whose entries are all tensors (``BytesStorageMetadata`` is refused: Tangram
  never writes byte entries, and they would load with a full unpickler), and the planner refuses byte reads.

Megatron's ``dist_checkpointing`` writes byte entries (``ShardedObject``s) that Megatron reads with a full
unpickler: :func:`check_dcp_directory` with ``allow_bytes=True`` proves beforehand that each of them loads with
``torch.load(weights_only=True)`` (tensors, containers, numbers, strings), so Megatron's own read runs only over
data that cannot run code. Refusals are :class:`UnsafeCheckpointError` (a SpecError: exit status 2).
"""
from __future__ import annotations

import contextlib
import io
import os
import pathlib
from typing import Any, Iterator, Mapping

from tangram_launch.checkpoint import confined
from tangram_launch.checkpoint.dcp_metadata import UnsafeCheckpointError, loads_metadata
from tangram_launch.errors import SpecError

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 256 << 20  # a DCP metadata file is a few KiB per tensor; bigger than this is not one of ours
_MAX_CHUNKS_PAIRWISE = 1024  # overlap is checked pair by pair up to this many chunks of one tensor


def read_metadata_file(state_dir: str, name: str = METADATA_FILE, *, allow_bytes: bool = False) -> Any:
    """The Metadata of DCP directory ``state_dir`` (confined, size-capped, read as data)."""
    data = confined.read_bytes(state_dir, name, max_bytes=MAX_METADATA_BYTES, field="DCP metadata")
    return loads_metadata(data, source=os.path.join(state_dir, name), allow_bytes=allow_bytes)


def check_storage(state_dir: str, metadata: Any, *, listed: Mapping[str, Any] | None = None) -> None:
    """Every storage entry names a regular file of ``state_dir`` that holds its bytes (and, with ``listed``, one
    the manifest lists: {file name: {"bytes": ...}})."""
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        rel = info.relative_path
        field = f"storage_data[{getattr(index, 'fqn', '?')}].relative_path"
        parts = confined.parts_of(rel, root=os.path.join(state_dir, METADATA_FILE), field=field)
        if len(parts) != 1:
            raise UnsafeCheckpointError("a shard must be a file of the checkpoint's own directory",
                                        source=os.path.join(state_dir, METADATA_FILE), field=field, value=rel)
        if listed is not None and rel not in listed:
            raise UnsafeCheckpointError("a shard the manifest does not list (its bytes were never verified)",
                                        source=os.path.join(state_dir, METADATA_FILE), field=field, value=rel)
        if rel not in sizes:
            sizes[rel] = confined.file_size(state_dir, rel, field=field)
        if info.offset + info.length > sizes[rel]:
            raise UnsafeCheckpointError(f"bytes [{info.offset}, {info.offset + info.length}) lie outside {rel} "
                                        f"({sizes[rel]} bytes): a truncated or altered shard",
                                        source=os.path.join(state_dir, METADATA_FILE),
                                        field=f"storage_data[{getattr(index, 'fqn', '?')}]", value=rel)


def check_dcp_directory(state_dir: str, *, allow_bytes: bool = False,
                        listed: Mapping[str, Any] | None = None) -> Any:
    """Prove that loading ``state_dir`` (a DCP directory) runs no code from it and reads nothing outside it;
    returns its Metadata. With ``allow_bytes`` (Megatron), each byte entry must load with
    ``torch.load(weights_only=True)``."""
    metadata = read_metadata_file(state_dir, allow_bytes=allow_bytes)
    check_storage(state_dir, metadata, listed=listed)
    if allow_bytes:
        _check_byte_entries(state_dir, metadata)
    return metadata


def listed_in(manifest: Mapping[str, Any], subdir: str) -> dict[str, Any]:
    """The manifest's files under ``subdir/``, by name within it."""
    prefix = subdir.rstrip("/") + "/"
    return {k[len(prefix):]: v for k, v in manifest.get("files", {}).items() if k.startswith(prefix)}


def _overlap(a: Any, b: Any) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def check_request(metadata: Any, request: Mapping[str, Any], *, source: str) -> None:
    """Every tensor of ``request`` (name -> tensor to load into) is in ``metadata`` with the same shape and dtype,
    and its chunks lie inside it and cover it exactly once (else DCP would leave part of it unloaded)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = {(i.fqn, tuple(i.offset or ())) for i in (metadata.storage_data or {})}
    for key, target in request.items():
        entry = metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError("the checkpoint's metadata lacks a tensor its manifest lists", source=source,
                                        field=key)
        shape = tuple(target.shape)
        if tuple(entry.size) != shape or entry.properties.dtype != target.dtype:
            raise UnsafeCheckpointError("the checkpoint's metadata disagrees with its manifest", source=source,
                                        field=f"{key}.size", value=f"{list(entry.size)} {entry.properties.dtype}",
                                        valid=f"{list(shape)} {target.dtype}")
        volume = 0
        for chunk in entry.chunks:
            if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape) or any(
                    o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape)):
                raise UnsafeCheckpointError("a chunk outside its tensor", source=source, field=f"{key}.chunks",
                                            value=f"offsets {list(chunk.offsets)} sizes {list(chunk.sizes)}",
                                            valid=f"inside {list(shape)}")
            if (key, tuple(chunk.offsets)) not in stored:
                raise UnsafeCheckpointError("a chunk with no storage entry", source=source, field=f"{key}.chunks",
                                            value=list(chunk.offsets))
            n = 1
            for s in chunk.sizes:
                n *= s
            volume += n
        chunks = entry.chunks
        overlapping = len(chunks) <= _MAX_CHUNKS_PAIRWISE and any(
            _overlap(a, b) for i, a in enumerate(chunks) for b in chunks[i + 1:])
        total = 1
        for d in shape:
            total *= d
        if volume != total or overlapping:
            raise UnsafeCheckpointError("the chunks do not cover the tensor exactly once", source=source,
                                        field=f"{key}.chunks", value=f"{len(chunks)} chunks, {volume} elements",
                                        valid=f"{total} elements, no overlap")


def _check_byte_entries(state_dir: str, metadata: Any) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if not byte_keys:
        return
    for index, info in (metadata.storage_data or {}).items():
        if getattr(index, "fqn", None) not in byte_keys:
            continue
        blob = confined.read_range(state_dir, info.relative_path, info.offset, info.length, field=index.fqn)
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpointError(f"byte entry does not load as plain data ({type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); nothing was "
                                        "executed", source=os.path.join(state_dir, info.relative_path),
                                        field=index.fqn) from None


def _confined_file_system(root: str) -> Any:
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ConfinedFileSystem(FileSystem):
        """DCP's local file system for reading only, every open confined to ``root`` (see the module doc)."""

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            if mode != "rb":
                raise UnsafeCheckpointError("a checkpoint is opened for reading only", source=root, value=mode)
            full, prefix = str(path), str(pathlib.Path(root)).rstrip("/") + "/"
            if not full.startswith(prefix):
                raise UnsafeCheckpointError("refusing a shard outside the checkpoint directory", source=root,
                                            field="relative_path", value=full)
            with confined.open_regular(root, full[len(prefix):], field="DCP shard") as (f, _):
                yield f

    return ConfinedFileSystem()


def safe_reader(state_dir: str, metadata: Any = None) -> Any:
    """A DCP FileSystemReader that opens through the confined layer and reads its metadata as data (or answers
    ``metadata``, already read and checked)."""
    from torch.distributed.checkpoint import FileSystemReader

    class _SafeFileSystemReader(FileSystemReader):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.fs = _confined_file_system(os.fspath(path))

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
            if metadata is not None and rank is None:
                checked = metadata
            else:
                checked = read_metadata_file(os.fspath(self.path), name)
                check_storage(os.fspath(self.path), checked)
            metadata_out = checked
            if getattr(metadata_out, "storage_meta", None) is None:
                metadata_out.storage_meta = StorageMeta()
            metadata_out.storage_meta.load_id = self.load_id
            return metadata_out

    return _SafeFileSystemReader(state_dir)


def safe_planner() -> Any:
    """DCP's default load planner, refusing byte entries (they would load with a full unpickler)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise UnsafeCheckpointError("refusing a non-tensor checkpoint entry (it would be unpickled)",
                                        field=str(read_item.dest_index.fqn))

    return _TensorOnlyLoadPlanner()


def load_tensors(request: dict[str, Any], state_dir: str, metadata: Any, *, group: Any = None,
                 no_dist: bool = False) -> None:
    """``dcp.load`` of ``request`` from ``state_dir`` with ``metadata`` as checked by :func:`check_dcp_directory`
    and :func:`check_request` (DCP is handed that object: the file is not read again). A shard that still fails to
    read (altered bytes) is a SpecError naming the directory, not a traceback."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        dcp.load(request, storage_reader=safe_reader(state_dir, metadata), planner=safe_planner(),
                 process_group=group, no_dist=no_dist)
    except SpecError:
        raise
    except (Exception, CheckpointException) as exc:  # what a damaged shard makes torch.load raise, on any rank
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise SpecError(f"cannot read the checkpoint's tensors ({type(exc).__name__}: {first}); a shard is "
                        "damaged or does not match its metadata", source=state_dir, field="state") from None


__all__ = ["UnsafeCheckpointError", "loads_metadata", "read_metadata_file", "check_dcp_directory", "check_storage",
           "check_request", "safe_reader", "safe_planner", "load_tensors", "listed_in"]


def check_checkpoint(path: str, manifest: Any) -> None:
    """What a resume of checkpoint ``path`` will unpickle is data only and lies inside it (the launcher's
    pre-check; by state format)."""
    fmt = manifest.get("state_format", "tangram-dcp") if isinstance(manifest, dict) else None
    if fmt == "megatron-dist-checkpointing":
        check_dcp_directory(os.path.join(path, "megatron"), allow_bytes=True, listed=listed_in(manifest, "megatron"))
    elif fmt == "tangram-dcp":
        check_dcp_directory(os.path.join(path, "state"), listed=listed_in(manifest, "state"))
    else:
        raise SpecError("unknown checkpoint state format", source=os.path.join(path, "manifest.json"),
                        field="state_format", value=fmt, valid="tangram-dcp, megatron-dist-checkpointing")
