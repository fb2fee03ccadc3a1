"""Reading torch DCP checkpoints without running code from them.

torch's ``FileSystemReader.read_metadata`` reads ``.metadata`` with plain ``pickle.load``, and the default load
planner reads byte entries with ``torch.load(weights_only=False)``: whoever can write a checkpoint directory could
plant a pickle that runs a command on the next resume (the manifest's checksums do not help: it is plain JSON, so
the attacker rewrites it too). torch's weights-only unpickler cannot read DCP's metadata (it has no FRAME opcode,
which protocol 4 writes), so this module reads it with a restricted unpickler of its own:

* every opcode is checked before anything is built (``pickletools``): no ``INST``/``OBJ`` (they call any class),
  no persistent ids, no extension codes;
* ``find_class`` answers only the names a DCP metadata file needs: DCP's metadata dataclasses and enum,
  ``_StorageInfo``, ``torch.Size``, torch dtypes, ``torch.serialization._get_layout`` and pure paths. Anything
  else (``os.system``, ``builtins.eval``, ``subprocess.Popen``, ...) is refused before it is looked up.
  ``builtins.getattr`` answers as a getattr that only looks up an enum member by name (``_enum_member``): some
  Python builds (Debian's 3.11.2 among them) pickle enum members as ``getattr(EnumClass, name)``, and the enum
  classes it can reach are those find_class allowed;
* the result must be a ``Metadata`` whose entries are all tensors (``BytesStorageMetadata`` is refused: Tangram
  never writes byte entries, and they would load with a full unpickler), and the planner refuses byte reads.

Megatron's ``dist_checkpointing`` writes byte entries (``ShardedObject``s) that Megatron reads with a full
unpickler: :func:`check_dcp_directory` with ``allow_bytes=True`` proves beforehand that each of them loads with
``torch.load(weights_only=True)`` (tensors, containers, numbers, strings), so Megatron's own read runs only over
data that cannot run code. Refusals are :class:`UnsafeCheckpointError` (a SpecError: exit status 2).
"""
from __future__ import annotations

import functools
import io
import os
import pickle
import pickletools
from typing import Any

from tangram_launch.errors import SpecError

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 256 << 20  # a DCP metadata file is a few KiB per tensor; bigger than this is not one of ours

# Opcodes a pickled DCP Metadata uses (protocol 2-5), and nothing that calls arbitrary classes or external hooks.
_ALLOWED_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT",
    "GET", "BINGET", "LONG_BINGET", "NONE", "NEWTRUE", "NEWFALSE", "INT", "BININT", "BININT1", "BININT2", "LONG",
    "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "EMPTY_TUPLE", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_DICT", "DICT", "SETITEM",
    "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET", "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "NEWOBJ",
    "NEWOBJ_EX",
})

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_NAMES = {
    _DCP_METADATA: frozenset({"Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                              "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),  # and dtypes, checked by value below
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}
_BYTES_NAME = "BytesStorageMetadata"


def _enum_member(cls: Any, name: Any, *, source: str) -> Any:
    """``getattr`` as a restricted unpickle may call it: a member of an enum class, by name, and nothing else."""
    import enum

    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise UnsafeCheckpointError(
        f"refusing getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}): checkpoint metadata may look "
        "up enum members only (nothing was executed)", source=source, field="pickle getattr",
        value=repr(name)[:80])


class UnsafeCheckpointError(SpecError):
    """A checkpoint file that would run code or is not what the format allows: refused, nothing was executed."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, *, source: str, allow_bytes: bool) -> None:
        super().__init__(file)
        self._source = source
        self._allow_bytes = allow_bytes

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_NAMES.get(module, frozenset())
        if module == _DCP_METADATA and name == _BYTES_NAME and self._allow_bytes:
            allowed = allowed | {_BYTES_NAME}
        if name in allowed:
            return super().find_class(module, name)
        if module == "builtins" and name == "getattr":
            return functools.partial(_enum_member, source=self._source)
        if module == "torch":
            import torch

            value = getattr(torch, name, None) if name.isidentifier() and not name.startswith("_") else None
            if isinstance(value, torch.dtype):
                return value
        raise UnsafeCheckpointError(
            f"refusing to load {module}.{name}: a checkpoint's metadata may only name DCP's metadata classes, "
            "torch.Size and dtypes (someone may have planted code in this checkpoint; nothing was executed)",
            source=self._source, field="pickle global", value=f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("refusing a persistent id in checkpoint metadata", source=self._source,
                                    field="pickle", value=repr(pid)[:80])


def _check_opcodes(data: bytes, source: str) -> None:
    try:
        for op, _, pos in pickletools.genops(data):
            if op.name not in _ALLOWED_OPCODES:
                raise UnsafeCheckpointError(
                    f"refusing pickle opcode {op.name} at byte {pos} (not used by checkpoint metadata; nothing was "
                    "executed)", source=source, field="pickle opcode", value=op.name)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # ValueError and friends from a malformed stream
        raise UnsafeCheckpointError(f"not a readable pickle ({type(exc).__name__}: {exc})", source=source) from None


def loads_metadata(data: bytes, *, source: str, allow_bytes: bool = False) -> Any:
    """A DCP ``Metadata`` from the bytes of a ``.metadata`` file, without running anything the file names."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    _check_opcodes(data, source)
    try:
        metadata = _RestrictedUnpickler(io.BytesIO(data), source=source, allow_bytes=allow_bytes).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # a restricted object built with odd arguments, a truncated stream, ...
        raise UnsafeCheckpointError(f"unreadable checkpoint metadata ({type(exc).__name__}: {exc})",
                                    source=source) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpointError("not a DCP Metadata object", source=source, value=type(metadata).__name__)
    kinds = (TensorStorageMetadata, BytesStorageMetadata) if allow_bytes else (TensorStorageMetadata,)
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, kinds):
            raise UnsafeCheckpointError("checkpoint metadata lists a non-tensor entry (Tangram checkpoints hold "
                                        "tensors only)", source=source, field=str(key), value=type(entry).__name__)
    return metadata


def read_metadata_file(path: str, *, allow_bytes: bool = False) -> Any:
    try:
        size = os.path.getsize(path)
        if size > MAX_METADATA_BYTES:
            raise UnsafeCheckpointError(f"checkpoint metadata is {size} bytes, more than the "
                                        f"{MAX_METADATA_BYTES} allowed", source=path)
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise SpecError("checkpoint metadata is missing", source=path) from None
    except OSError as exc:
        raise SpecError(f"cannot read checkpoint metadata: {exc.strerror}", source=path) from None
    return loads_metadata(data, source=path, allow_bytes=allow_bytes)


def check_dcp_directory(state_dir: str, *, allow_bytes: bool = False) -> Any:
    """Prove that loading ``state_dir`` (a DCP directory) runs no code from it; returns its Metadata.

    With ``allow_bytes`` (Megatron), each byte entry must load with ``torch.load(weights_only=True)``.
    """
    path = os.path.join(state_dir, METADATA_FILE)
    metadata = read_metadata_file(path, allow_bytes=allow_bytes)
    if allow_bytes:
        _check_byte_entries(state_dir, metadata)
    return metadata


def _check_byte_entries(state_dir: str, metadata: Any) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if not byte_keys:
        return
    for index, info in (metadata.storage_data or {}).items():
        if getattr(index, "fqn", None) not in byte_keys:
            continue
        rel = str(info.relative_path)
        full = os.path.realpath(os.path.join(state_dir, rel))
        if os.path.dirname(full) != os.path.realpath(state_dir):
            raise UnsafeCheckpointError("checkpoint metadata points outside its directory", source=state_dir,
                                        field=index.fqn, value=rel)
        with open(full, "rb") as f:
            f.seek(int(info.offset))
            blob = f.read(int(info.length))
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpointError(f"byte entry does not load as plain data ({type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); nothing was "
                                        "executed", source=full, field=index.fqn) from None


def safe_reader(state_dir: str) -> Any:
    """A DCP FileSystemReader whose metadata comes through the restricted unpickler (tensor entries only)."""
    from torch.distributed.checkpoint import FileSystemReader

    class _SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank")
            name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
            metadata = read_metadata_file(os.path.join(os.fspath(self.path), name))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeFileSystemReader(state_dir)


def safe_planner() -> Any:
    """DCP's default load planner, refusing byte entries (they would load with a full unpickler)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise UnsafeCheckpointError("refusing a non-tensor checkpoint entry (it would be unpickled)",
                                        field=str(read_item.dest_index.fqn))

    return _TensorOnlyLoadPlanner()


__all__ = ["UnsafeCheckpointError", "loads_metadata", "read_metadata_file", "check_dcp_directory", "safe_reader",
           "safe_planner"]


def check_checkpoint(path: str, manifest: Any) -> None:
    """What a resume of checkpoint ``path`` will unpickle is data only (the launcher's pre-check; by state format)."""
    fmt = manifest.get("state_format", "tangram-dcp") if isinstance(manifest, dict) else None
    if fmt == "megatron-dist-checkpointing":
        check_dcp_directory(os.path.join(path, "megatron"), allow_bytes=True)
    elif fmt == "tangram-dcp":
        check_dcp_directory(os.path.join(path, "state"))
    else:
        raise SpecError("unknown checkpoint state format", source=os.path.join(path, "manifest.json"),
                        field="state_format", value=fmt, valid="tangram-dcp, megatron-dist-checkpointing")
